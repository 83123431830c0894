"""Latency through the router while one rank of four is stopped (SIGSTOP) for 10 s.

    python benchmarks/rank_stall.py [--clients 32] [--stall 10] [--baseline 10]
                                    [--modes watch_on watch_off] [--json OUT]

Setup per mode: a fresh ``kvevents engine --dp-size 4`` and one ``kvevents router
--workers 1`` in front of it (``watch_on``: the router's defaults; ``watch_off``:
``--stall-after 0``, stalls not watched: a stopped rank is noticed only through the
engine's ``/load``). ``clients`` clients each hold multi-turn conversations
through the router's ``/v1/completions`` (a system prompt shared by all, a document of
their own, turns appended; a new conversation every few turns), one request at a time.
After a warm-up and ``baseline`` seconds, the process of rank 1 is stopped for
``stall`` seconds, then continued, and the run goes on for a few seconds more.

Figures per mode, over the requests *started* in each window: count, p50, p99 and max
latency before the stall and during it, and the p99 difference (the aim: at most 1 s);
the requests routed to the stopped rank after it stopped, when the last of them was
routed (how long it kept attracting requests), beside those already there when it
stopped (they wait for it whatever the router does), and how many requests it took
after it was continued (it came back). Prints them and writes them as JSON
(default benchmarks/results/rank_stall.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvevents.demo.procs import Child
from kvevents.http.upstream import Upstream
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "rank_stall.json"
MODES: dict[str, list[str]] = {"watch_on": [], "watch_off": ["--stall-after", "0"]}
STOPPED_RANK = 1
_SYSTEM = list(range(1000, 1256))  # 256 tokens every conversation starts with
_HEADERS = {"content-type": "application/json"}


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s"


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _window(
    records: list[tuple[float, float, int, int]], start: float, end: float
) -> dict[str, Any]:
    latencies = [done - began for began, done, _, _ in records if start <= began < end]
    errors = sum(1 for began, _, status, _ in records if start <= began < end and status != 200)
    return {
        "requests": len(latencies),
        "errors": errors,
        "p50_s": _percentile(latencies, 0.50),
        "p99_s": _percentile(latencies, 0.99),
        "max_s": max(latencies, default=None),
    }


async def _client(
    upstream: Upstream,
    url: str,
    seed: int,
    stop_at: float,
    records: list[tuple[float, float, int, int]],
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        conversation = _SYSTEM + [rng.randrange(2000, 30000) for _ in range(512)]
        for _ in range(rng.randrange(3, 9)):
            if time.monotonic() >= stop_at:
                return
            conversation += [rng.randrange(2000, 30000) for _ in range(64)]
            body = json.dumps({"prompt": conversation, "max_tokens": 8}).encode()
            began = time.monotonic()
            try:
                answer = await upstream.post_whole(url, "/v1/completions", body, _HEADERS)
                status, rank = answer.status, int(answer.headers.get("x-kvevents-dp-rank", -1))
            except Exception:  # a failed request is a figure, not the end of the client
                status, rank = 0, -1
            records.append((began, time.monotonic(), status, rank))
            conversation += [rng.randrange(2000, 30000) for _ in range(8)]  # the answer


def _one_mode(name: str, extra: list[str], args: argparse.Namespace) -> dict[str, Any]:
    engine = Child(
        "engine",
        [
            "--dp-size", "4", "--port", "0", "--block-size", "16",
            "--prefill-tokens-per-s", str(args.prefill_tokens_per_s),
            "--decode-steps-per-s", str(args.decode_steps_per_s),
            "--request-timeout", "60",
        ],
    )  # fmt: skip
    router = Child("router", ["--engine", "", "--port", "0", "--workers", "1", *extra])
    try:
        engine_url = engine.start(timeout=60)
        health = httpx.get(f"{engine_url}/health", timeout=10).json()
        pids = [r["pid"] for r in health["ranks"]]
        engine.adopt(pids)
        router.argv[router.argv.index("--engine") + 1] = engine_url
        url = router.start(timeout=60)
        return asyncio.run(_measure(url, pids[STOPPED_RANK], args))
    finally:
        router.stop()
        engine.stop()


async def _measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    upstream = Upstream(timeout=120.0)
    records: list[tuple[float, float, int, int]] = []
    start = time.monotonic()
    stall_at = start + args.warmup + args.baseline
    resume_at = stall_at + args.stall
    stop_at = resume_at + args.after
    clients = [
        asyncio.create_task(_client(upstream, url, 7919 * i, stop_at, records))
        for i in range(args.clients)
    ]
    try:
        await asyncio.sleep(stall_at - time.monotonic())
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(resume_at - time.monotonic())
        finally:
            os.kill(pid, signal.SIGCONT)
        await asyncio.gather(*clients)
    finally:
        for task in clients:
            task.cancel()
        await upstream.close()
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        workers = (await http.get("/workers")).json()
        metrics = (await http.get("/metrics")).text
    before = _window(records, stall_at - args.baseline, stall_at)
    during = _window(records, stall_at, resume_at)
    to_stopped = [began - stall_at for began, _, _, rank in records if rank == STOPPED_RANK]
    during_stopped = [t for t in to_stopped if 0 <= t < args.stall]
    stall_lines = [
        line for line in metrics.splitlines() if line.startswith("kvevents_router_stalls_total")
    ]
    return {
        "before": before,
        "during": during,
        "p99_added_s": (
            None
            if before["p99_s"] is None or during["p99_s"] is None
            else during["p99_s"] - before["p99_s"]
        ),
        "caught_when_stopped": sum(
            1
            for began, done, _, rank in records
            if rank == STOPPED_RANK and began < stall_at < done - 1.0
        ),
        "routed_to_stopped_during_stall": len(during_stopped),
        "last_routed_to_stopped_s": max(during_stopped, default=None),
        "routed_to_stopped_after_resume": sum(1 for t in to_stopped if t >= args.stall),
        "stall_metrics": stall_lines,
        "holders_at_end": [
            {k: h.get(k) for k in ("dp_rank", "routed", "stall")} for h in workers["holders"]
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds")
    parser.add_argument("--baseline", type=float, default=10.0, help="seconds")
    parser.add_argument("--stall", type=float, default=10.0, help="seconds")
    parser.add_argument("--after", type=float, default=4.0, help="seconds")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=100_000.0)
    parser.add_argument("--decode-steps-per-s", type=float, default=1000.0)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"setup": {k: v for k, v in vars(args).items() if k != "json"}}
    results["setup"]["json"] = str(args.json)
    results["modes"] = {}
    for name in args.modes:
        m = results["modes"][name] = _one_mode(name, MODES[name], args)
        b, d = m["before"], m["during"]
        print(
            f"{name:10s} before: {b['requests']} requests p50 {_s(b['p50_s'])} p99 "
            f"{_s(b['p99_s'])} | during the stall: {d['requests']} requests ({d['errors']} "
            f"failed) p50 {_s(d['p50_s'])} p99 {_s(d['p99_s'])} max {_s(d['max_s'])} | p99 "
            f"added {_s(m['p99_added_s'])} | on the stopped rank: {m['caught_when_stopped']} "
            f"caught there, {m['routed_to_stopped_during_stall']} sent after it stopped (the "
            f"last {_s(m['last_routed_to_stopped_s'])} in), "
            f"{m['routed_to_stopped_after_resume']} after it resumed"
        )
    write_results(args.json, results)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
