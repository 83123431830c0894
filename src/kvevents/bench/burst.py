"""Sibling bursts: groups of requests sharing a new long prefix, sent at once, with and without predictions.

Agents fan out (parallel tool calls, best-of-N, map-reduce): several requests sharing a
long prefix nobody has cached yet arrive within milliseconds. The engine reports the
prefix's blocks only once it has admitted the first of them, so until then the index
says nobody holds it; predictions (:mod:`kvevents.index.predictions`) let the router
send the siblings after the first.

Setup: one ``kvevents engine --dp-size 4`` with a prefill speed that makes a long prefill
take a noticeable time (``--prefill-tokens-per-s``), and one ``kvevents router --workers
1`` per mode in turn (predictions are per router process, so one process shows what they
do). Per mode, ``groups`` groups of ``siblings`` requests, each group a fresh random
``prefix_tokens`` prefix plus 32-128 tokens of its own; a group's siblings go out
together through the router's ``/v1/completions`` (or ``sibling_interval_s`` apart, which
shows how long the time-to-live must be), a new group every ``group_interval_s``. Modes
run one after the other on the same engine, each with prefixes of its own.

Figures per mode: the engine-reported cached tokens (``usage.prompt_tokens_details``)
against the ideal (every sibling after a group's first reusing the whole prefix), the
distinct ranks per group and the share of groups on at most 2, the requests per rank
(max/min), and from the router's ``/metrics`` the requests whose route a prediction
decided and how long the engine took to confirm predictions (what the time-to-live must
exceed).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx

from kvevents.demo.procs import Child
from kvevents.errors import KVEventsError

__all__ = ["DEFAULT_MODES", "run_burst_bench"]

_DP_SIZE = 4
_PAGE = 16
# with a replay endpoint, as docs/deployment.md advises: each mode's router joins an engine
# that holds the earlier modes' blocks, and replays their history before it is measured
_EVENTS_CONFIG = json.dumps(
    {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
        "bind": True,
    }
)
DEFAULT_MODES: dict[str, list[str]] = {
    "predictions_off": ["--prediction-ttl", "0"],
    "predictions_on": [],  # the router's defaults
}
_FROM_METRICS = {
    "decided_by_prediction": "kvevents_router_routes_decided_by_prediction_total",
    "confirm_seconds_mean": "kvevents_router_prediction_confirm_seconds_mean",
    "confirm_seconds_max": "kvevents_router_prediction_confirm_seconds_max",
    "predicted_entries_expired": 'kvevents_router_predicted_entries_total{fate="expired"}',
}


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _groups(n: int, siblings: int, prefix_tokens: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prefix = [rng.randrange(1, 50_000) for _ in range(prefix_tokens)]
        out.append(
            [
                prefix + [rng.randrange(1, 50_000) for _ in range(rng.randint(32, 128))]
                for _ in range(siblings)
            ]
        )
    return out


async def _send(
    client: httpx.AsyncClient,
    url: str,
    groups: Sequence[Sequence[list[int]]],
    interval: float,
    spacing: float,
) -> list[list[tuple[int, int, int]]]:
    """Every group, a group every ``interval`` s, its siblings ``spacing`` s apart
    (0: at once): (rank, cached, prompt) per request."""

    async def one(j: int, prompt: list[int]) -> tuple[int, int, int]:
        if spacing:
            await asyncio.sleep(j * spacing)  # the workload's arrival schedule
        body = {"model": "sim", "prompt": prompt, "max_tokens": 1}
        answer = await client.post(f"{url}/v1/completions", json=body)
        answer.raise_for_status()
        usage = answer.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return int(answer.headers["x-kvevents-dp-rank"]), cached, usage["prompt_tokens"]

    async def group(i: int, prompts: Sequence[list[int]]) -> list[tuple[int, int, int]]:
        await asyncio.sleep(i * interval)  # the workload's arrival schedule
        return list(await asyncio.gather(*(one(j, p) for j, p in enumerate(prompts))))

    return list(await asyncio.gather(*(group(i, g) for i, g in enumerate(groups))))


def _wait_ranks(url: str, engine_url: str, timeout: float = 60.0) -> None:
    """Until the router at ``url`` follows every rank and has applied every batch the
    (idle) engine published before it joined: the earlier modes' history, replayed on
    join. A mode measured while that replay is still coming in would route its first
    groups on an index that lacks blocks the engine holds."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=10.0) as client:
        published = {
            r["dp_rank"]: r["batches_published"]
            for r in client.get(f"{engine_url}/load").json()["ranks"]
        }
        while time.monotonic() < deadline:
            workers = client.get(f"{url}/workers").json()
            connected = sum(s["status"] == "connected" for s in workers["streams"])
            applied = {
                h["dp_rank"]: -1 if h["applied_seq"] is None else h["applied_seq"]
                for h in workers["holders"]
                if h["worker"] == engine_url
            }
            if connected >= _DP_SIZE and all(
                applied.get(rank, -1) + 1 >= count for rank, count in published.items()
            ):
                return
            time.sleep(0.1)
    raise KVEventsError(
        f"the router at {url} did not follow {_DP_SIZE} ranks and apply their "
        f"{sum(published.values())} published batches in {timeout:g} s"
    )


def _figures(
    results: list[list[tuple[int, int, int]]], prefix_tokens: int, wall_s: float
) -> dict[str, Any]:
    ideal = sum((len(g) - 1) * (prefix_tokens // _PAGE * _PAGE) for g in results)
    cached = sum(c for g in results for _, c, _ in g)
    prompt = sum(p for g in results for _, _, p in g)
    ranks = [len({r for r, _, _ in g}) for g in results]
    per_rank = Counter(r for g in results for r, _, _ in g)
    counts = [per_rank.get(r, 0) for r in range(_DP_SIZE)]
    return {
        "requests": sum(len(g) for g in results),
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "ideal_cached_tokens": ideal,
        "hit_rate_of_ideal": cached / ideal if ideal else 0.0,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ranks_per_group": ranks,
        "mean_ranks_per_group": sum(ranks) / len(ranks),
        "groups_on_at_most_2_ranks": sum(n <= 2 for n in ranks) / len(ranks),
        "requests_per_rank": counts,
        "load_max_min": max(counts) / min(counts) if min(counts) else float("inf"),
        "wall_s": wall_s,
    }


def run_burst_bench(
    *,
    groups: int = 16,
    siblings: int = 8,
    prefix_tokens: int = 2048,
    prefill_tokens_per_s: float = 20_480.0,
    group_interval_s: float = 0.025,
    sibling_interval_s: float = 0.0,
    modes: dict[str, list[str]] | None = None,
    seed: int = 1,
) -> dict[str, Any]:
    """Run every mode once on one engine; results as a JSON-ready dict (see the module docstring).

    ``modes`` maps a name to extra ``kvevents router`` flags (default :data:`DEFAULT_MODES`).
    """
    modes = DEFAULT_MODES if modes is None else modes
    results: dict[str, Any] = {
        "setup": {
            "dp_size": _DP_SIZE,
            "page_size": _PAGE,
            "groups": groups,
            "siblings": siblings,
            "prefix_tokens": prefix_tokens,
            "own_tokens": [32, 128],
            "prefill_tokens_per_s": prefill_tokens_per_s,
            "prefix_prefill_ms": 1000 * prefix_tokens / prefill_tokens_per_s,
            "group_interval_s": group_interval_s,
            "sibling_interval_s": sibling_interval_s,
            "router_workers": 1,
        },
        "modes": {},
    }
    engine = Child(
        "engine",
        [
            *("--dp-size", str(_DP_SIZE), "--port", "0", "--page-size", str(_PAGE)),
            *("--max-blocks", "65536", "--prefill-tokens-per-s", f"{prefill_tokens_per_s:g}"),
            *("--kv-events-config", _EVENTS_CONFIG),
        ],
    )
    try:
        engine_url = engine.start(timeout=60.0)
        for i, (name, flags) in enumerate(modes.items()):
            router = Child(
                "router", ["--engine", engine_url, "--port", "0", "--workers", "1", *flags]
            )
            try:
                url = router.start(timeout=60.0)
                _wait_ranks(url, engine_url)
                work = _groups(groups, siblings, prefix_tokens, seed=seed * 1000 + i)
                t0 = time.monotonic()
                done = asyncio.run(_run(url, work, group_interval_s, sibling_interval_s))
                figures = _figures(done, prefix_tokens, time.monotonic() - t0)
                metrics = httpx.get(f"{url}/metrics", timeout=10.0).text
                for key, metric in _FROM_METRICS.items():
                    figures[key] = _metric(metrics, metric)
                figures["router_flags"] = flags
                results["modes"][name] = figures
            finally:
                router.stop()
    finally:
        engine.stop()
    return results


async def _run(
    url: str, work: Sequence[Sequence[list[int]]], interval: float, spacing: float
) -> list[list[tuple[int, int, int]]]:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        return await _send(client, url, work, interval, spacing)
