"""What the router adds to a disaggregated request: both legs sent directly, against through it.

Part of ``kvevents bench router`` (:mod:`kvevents.bench.router`), and all of it with
``kvevents bench router --pd-only``. Setup, as real processes: ``kvevents engine
--disaggregation-mode prefill`` and ``--disaggregation-mode decode``, one DP rank each,
so the fixed pair of ranks the direct client uses is the pair the router must choose
(the comparison is of the relay, not of where load lands); ``kvevents router --prefill
P --decode D --max-local-prefill-tokens 0``, so every request is handed off though the
decode soon holds every prompt. The bodies are ``{"model": "sim", "prompt": [2,048
token ids], "max_tokens": M}`` over ``prompts`` distinct prompts, each first sent once
through the router (both engines then cache it, and the router's index holds it).
``max_tokens`` (``--pd-max-tokens``, default :data:`TYPICAL_ANSWER_TOKENS`, an
answer's usual length) is what a request decodes, each prompt its own count within
``max_tokens // 8`` of it (drawn once, the same for both clients): at the usual length
the requests spend their time decoding and the added p50 is the relay's own delay;
with 1 the requests are as short as they get and the closed loop saturates the CPUs (see
below), a measure of the router's CPU per request. The counts differ because equal ones lock the requests into cohorts that are
admitted on one step, finish on one step and come back at once, so the engines' servers
take each cohort's legs in a burst and a request's p50 depends on its place in it,
which changes from run to run by more than the relay adds. ``together``
(``--pd-together``, the default; ``--no-pd-together``: back to back) runs a round's two
clients at once, each in a process of its own (:mod:`kvevents.bench.pd_together`): what
slows the machine and the engines meanwhile slows both alike.

Then ``rounds`` rounds, each a run of the direct client and one of the router's
(:mod:`kvevents.bench.pd_load`: ``protocol``'s legs, ``connections`` requests in flight,
``duration`` seconds measured after ``warmup``), alternating as
:mod:`kvevents.bench.completions`' rounds do (direct then via, then via then direct,
...), so drift in what else runs on the machine falls on both alike. The added latency
is the difference of the p50s within each round; the target (at most
:data:`TARGET_ADDED_P50_MS` added) is checked against their median, reported with the
rounds' spread. Each run also reads the CPU time of the router and engine processes per
request (:func:`~kvevents.bench.completions.process_cpu_s`). ``protocol`` chooses the
hand-off: SGLang's legs at once, or vLLM's in turn (``kvevents router --pd-protocol
vllm``; the direct client then sends the prefill, then the decode with its answer).

Placement (``pin_router``, :mod:`kvevents.bench.placement`): unpinned, the client, the
engines and the router share every core, as on a laptop, so the router's CPU is taken
from the engines'. Pinned, the router has a core of its own and the client and engines
the rest, in both paths alike, as a deployment gives a router cores of its own. Either
way the closed loop keeps the busiest cores saturated, so a round's added p50 follows
the CPU per request spent on them (which each run records per process, and the report
shows beside the figure for both paths), more than the relay's own delay. The placement
read back from each process tree is in the results (``setup.placement``).
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx

from kvevents.bench.completions import process_cpu_s
from kvevents.bench.pd_load import DirectLegs, Send, ViaRouter, VllmDirectLegs, run_load
from kvevents.bench.pd_together import run_together
from kvevents.bench.placement import Placement, cpus_of, pinned
from kvevents.demo.procs import Child
from kvevents.errors import KVEventsError
from kvevents.http.serving import run_event_loop
from kvevents.router.serve.pd_legs import PROTOCOLS, PDProtocol

__all__ = ["TARGET_ADDED_P50_MS", "TYPICAL_ANSWER_TOKENS", "pd_bodies", "run_pd_bench"]

TARGET_ADDED_P50_MS = 2.0
"""The bar: the router adds at most this to the p50, at 32 requests in flight."""

TYPICAL_ANSWER_TOKENS = 350
"""An answer's usual length: the bundled conversation trace's median ``output_length``
(what each request decodes unless told)."""

_BLOCK = 16
_TOKENS = 2048
_SPREAD = 8
"""Each prompt decodes ``max_tokens`` give or take ``max_tokens // _SPREAD`` (see the
module docstring)."""
_EVENTS = (
    '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", '
    '"replay_endpoint": "tcp://127.0.0.1:0", "bind": true}'
)


def _engine(mode: str) -> Child:
    args = ["--dp-size", "1", "--port", "0", "--block-size", str(_BLOCK)]
    args += ["--max-blocks", "65536", "--kv-events-config", _EVENTS]
    args += ["--disaggregation-mode", mode]
    if mode == "prefill":
        args += ["--disaggregation-bootstrap-port", "0"]
    return Child("engine", args)


def _warm(router: str, prefill: str, decode: str, bodies: list[dict[str, Any]]) -> int:
    """Send every body once through the router; wait until its index holds each prompt on
    both engines; the prefill's bootstrap port."""
    with httpx.Client(timeout=60.0) as client:
        for body in bodies:
            answer = client.post(f"{router}/v1/completions", json=body)
            if answer.status_code != 200:
                raise KVEventsError(
                    f"warming up through the router: HTTP {answer.status_code}: {answer.text[:300]}"
                )
        blocks = len(bodies) * _TOKENS // _BLOCK
        deadline = time.monotonic() + 60.0
        while True:
            workers = client.get(f"{router}/workers").json()
            held = {h["worker"]: h["index_entries"] for h in workers["holders"]}
            if held.get(prefill, 0) >= blocks and held.get(decode, 0) >= blocks:
                break
            if time.monotonic() > deadline:
                raise KVEventsError(
                    f"the router's index holds {held} blocks per engine within 60 s; "
                    f"{blocks} each expected"
                )
            time.sleep(0.2)
        port = client.get(f"{prefill}/server_info").json()["disaggregation_bootstrap_port"]
    return int(port)


def pd_bodies(prompts: int, max_tokens: int) -> list[dict[str, Any]]:
    """The bench's bodies: ``prompts`` prompts of 2,048 random token ids, each decoding
    its own count within ``max_tokens // 8`` of ``max_tokens`` (the module docstring
    says why); the same on every call."""
    rng = random.Random(3)
    spread = max_tokens // _SPREAD
    return [
        {
            "model": "sim",
            "prompt": [rng.randrange(1, 50_000) for _ in range(_TOKENS)],
            "max_tokens": max_tokens + rng.randint(-spread, spread),
        }
        for _ in range(prompts)
    ]


def run_pd_bench(
    *,
    prompts: int = 256,
    duration: float = 10.0,
    connections: int = 32,
    rounds: int = 5,
    warmup: float = 1.0,
    protocol: PDProtocol = "sglang",
    pin_router: bool = False,
    max_tokens: int = TYPICAL_ANSWER_TOKENS,
    together: bool = True,
) -> dict[str, Any]:
    """Set up, warm up and run the rounds (see the module docstring); JSON-ready results:
    ``setup`` (with ``placement``), ``rounds`` (each ``direct``, ``via`` and
    ``added_p50_ms``), ``added_p50_ms`` and its ``_median``, ``_min`` and ``_max``,
    ``router_cpu_us_per_request`` per round and its median, and ``target`` (what was
    checked against what)."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: the comparison needs at least one round")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r}: give one of {', '.join(PROTOCOLS)}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: a request decodes at least one token")
    placement = Placement.split() if pin_router else None
    bodies = pd_bodies(prompts, max_tokens)
    prefill, decode = _engine("prefill"), _engine("decode")
    router: Child | None = None
    runs: list[dict[str, Any]] = []
    try:
        with _on(None if placement is None else placement.others):
            prefill_url = prefill.start(timeout=60.0)
            decode_url = decode.start(timeout=60.0)
            router = Child(
                "router",
                ["--port", "0", "--workers", "1", "--prefill", prefill_url, "--decode",
                 decode_url, "--max-local-prefill-tokens", "0", "--pd-protocol", protocol],
            )  # fmt: skip
            with _on(None if placement is None else placement.router):
                router_url = router.start(timeout=60.0)
            warming = [{**body, "max_tokens": 1} for body in bodies]  # the prompts, quickly
            port = _warm(router_url, prefill_url, decode_url, warming)
            direct: DirectLegs | VllmDirectLegs = (
                DirectLegs(prefill_url, decode_url, ("127.0.0.1", port), bodies)
                if protocol == "sglang"
                else VllmDirectLegs(prefill_url, decode_url, bodies)
            )
            sides: dict[str, Send] = {"direct": direct, "via": ViaRouter(router_url, bodies)}
            pids = {"router": router.pid, "prefill": prefill.pid, "decode": decode.pid}
            held = _placement(placement, pids)
            for i in range(rounds):
                play = _together if together else _round
                runs.append(play(sides, pids, i, connections, duration, warmup))
        prefill_failures = direct.prefill_failures
    finally:
        if router is not None:
            router.stop()
        decode.stop()
        prefill.stop()
    return _results(
        runs,
        held,
        {
            "protocol": protocol,
            "dp_size_per_engine": 1,
            "ranks": {"prefill": 0, "decode": 0},
            "prompts": prompts,
            "prompt_tokens": _TOKENS,
            "max_tokens": max_tokens,
            "max_tokens_spread": max_tokens // _SPREAD,
            "together": together,
            "block_size": _BLOCK,
            "connections": connections,
            "duration_s": duration,
            "warmup_s": warmup,
            "load_generator": "asyncio client, kvevents.http.upstream.Upstream",
            "router_args": ["--max-local-prefill-tokens", "0", "--pd-protocol", protocol],
        },
        prefill_failures,
    )


@contextlib.contextmanager
def _on(cpus: frozenset[int] | None) -> Iterator[None]:
    """This thread (and what it starts) on ``cpus``, or as it is when None."""
    if cpus is None:
        yield
        return
    with pinned(cpus):
        yield


def _placement(placement: Placement | None, pids: dict[str, int | None]) -> dict[str, Any]:
    """Each process tree's CPUs as read back (the client: this thread); KVEventsError
    when a pinned one is not where it was put."""
    held = {name: cpus_of(pid) for name, pid in pids.items() if pid is not None}
    held["client"] = sorted(os.sched_getaffinity(0))
    if placement is None:
        return {"pinned": False, "read_back": held}
    wanted = {name: sorted(placement.others) for name in held}
    wanted["router"] = sorted(placement.router)
    if held != wanted:
        raise KVEventsError(f"the CPU placement did not hold: wanted {wanted}, read {held}")
    return {"pinned": True, **placement.as_json(), "read_back": held}


def _round(
    sides: dict[str, Send],
    pids: dict[str, int | None],
    i: int,
    connections: int,
    duration: float,
    warmup: float,
) -> dict[str, Any]:
    """Round ``i``: both clients' runs, back to back (the direct one first in even rounds)."""
    pair: dict[str, Any] = {}
    for side in ("direct", "via") if i % 2 == 0 else ("via", "direct"):
        before = {name: process_cpu_s(pid) for name, pid in pids.items()}
        run = run_event_loop(
            run_load(sides[side], connections=connections, duration=duration, warmup=warmup)
        )
        for name, pid in pids.items():
            after, start = process_cpu_s(pid), before[name]
            if after is not None and start is not None and run["requests_all"]:
                run[f"{name}_cpu_us_per_request"] = (after - start) / run["requests_all"] * 1e6
        pair[side] = run
    pair["added_p50_ms"] = pair["via"]["p50_ms"] - pair["direct"]["p50_ms"]
    return pair


def _together(
    sides: dict[str, Send],
    pids: dict[str, int | None],
    i: int,
    connections: int,
    duration: float,
    warmup: float,
) -> dict[str, Any]:
    """Round ``i`` with both clients at once, each in a process of its own with
    ``connections`` in flight (:mod:`kvevents.bench.pd_together`), so whatever slows the
    engines meanwhile slows both alike; each client's CPU per request is its own, and the
    router's is over the requests it relayed (the engines' serve both and are not split).
    The direct client's prefill failures are added to its count."""
    router = pids.get("router")
    began: list[float | None] = []

    def starting() -> None:  # the clients are ready: the router's CPU from here
        began.append(process_cpu_s(router) if router else None)

    runs = run_together(
        sides, connections=connections, duration=duration, warmup=warmup, starting=starting
    )
    before = began[0] if began else None
    after = process_cpu_s(router) if router else None
    direct, via = runs["direct"], runs["via"]
    for run in runs.values():
        run.pop("client_pid", None)
    failures = direct.pop("prefill_failures", 0)
    sent = sides["direct"]
    if isinstance(sent, (DirectLegs, VllmDirectLegs)):
        sent.prefill_failures += failures
    via.pop("prefill_failures", None)
    if before is not None and after is not None and via["requests_all"]:
        via["router_cpu_us_per_request"] = (after - before) / via["requests_all"] * 1e6
    return {"direct": direct, "via": via, "added_p50_ms": via["p50_ms"] - direct["p50_ms"]}


def _results(
    runs: list[dict[str, Any]],
    placement: dict[str, Any],
    setup: dict[str, Any],
    prefill_failures: int,
) -> dict[str, Any]:
    added = [r["added_p50_ms"] for r in runs]
    median = statistics.median(added)
    cpu = [r["via"].get("router_cpu_us_per_request") for r in runs]
    known = [c for c in cpu if c is not None]
    return {
        "setup": {**setup, "placement": placement},
        "rounds": runs,
        "direct_prefill_failures": prefill_failures,
        "added_p50_ms": added,
        "added_p50_ms_median": median,
        "added_p50_ms_min": min(added),
        "added_p50_ms_max": max(added),
        "router_cpu_us_per_request": cpu,
        "router_cpu_us_per_request_median": statistics.median(known) if known else None,
        "target": {
            "added_p50_ms_at_most": TARGET_ADDED_P50_MS,
            "checked_against": "added_p50_ms_median: the median over the rounds of the p50 "
            "through the router minus the p50 of the legs sent directly, each round's two "
            "runs "
            + ("at once (setup.together)" if setup.get("together") else "back to back")
            + ", with the placement in setup.placement",
            "met": median <= TARGET_ADDED_P50_MS,
            "rounds_within": sum(a <= TARGET_ADDED_P50_MS for a in added),
        },
    }
