"""What the router adds to a disaggregated request: both legs sent directly, against through it.

Part of ``kvevents bench router`` (:mod:`kvevents.bench.router`), and all of it with
``kvevents bench router --pd-only``. Setup, as real processes: ``kvevents engine
--disaggregation-mode prefill`` and ``--disaggregation-mode decode``, one DP rank each,
so the fixed pair of ranks the direct client uses is the pair the router must choose
(the comparison is of the relay, not of where load lands); ``kvevents router --prefill
P --decode D --max-local-prefill-tokens 0``, so every request is handed off though the
decode soon holds every prompt. The bodies are ``{"model": "sim", "prompt": [2,048
token ids], "max_tokens": 1}`` over ``prompts`` distinct prompts, each first sent once
through the router (both engines then cache it, and the router's index holds it).

Then ``rounds`` rounds, each a run of the direct client and one of the router's
(:mod:`kvevents.bench.pd_load`: SGLang's protocol, ``connections`` requests in flight,
``duration`` seconds measured after ``warmup``), alternating as
:mod:`kvevents.bench.completions`' rounds do (direct then via, then via then direct,
...), so drift in what else runs on the machine falls on both alike. The added latency
is the difference of the p50s within each round; the summary is their median. Each run
also reads the CPU time of the router and engine processes per request
(:func:`~kvevents.bench.completions.process_cpu_s`).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import httpx

from kvevents.bench.completions import process_cpu_s
from kvevents.bench.pd_load import DirectLegs, Send, ViaRouter, run_load
from kvevents.demo.procs import Child
from kvevents.errors import KVEventsError
from kvevents.http.serving import run_event_loop

__all__ = ["run_pd_bench"]

_BLOCK = 16
_TOKENS = 2048
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


def run_pd_bench(
    *,
    prompts: int = 256,
    duration: float = 10.0,
    connections: int = 32,
    rounds: int = 5,
    warmup: float = 1.0,
) -> dict[str, Any]:
    """Set up, warm up and run the rounds (see the module docstring); JSON-ready results:
    ``setup``, ``rounds`` (each ``direct``, ``via`` and ``added_p50_ms``), ``added_p50_ms``
    and ``added_p50_ms_median``."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: the comparison needs at least one round")
    rng = random.Random(3)
    bodies = [
        {
            "model": "sim",
            "prompt": [rng.randrange(1, 50_000) for _ in range(_TOKENS)],
            "max_tokens": 1,
        }
        for _ in range(prompts)
    ]
    prefill, decode = _engine("prefill"), _engine("decode")
    router: Child | None = None
    runs: list[dict[str, Any]] = []
    try:
        prefill_url = prefill.start(timeout=60.0)
        decode_url = decode.start(timeout=60.0)
        router = Child(
            "router",
            ["--port", "0", "--workers", "1", "--prefill", prefill_url, "--decode", decode_url,
             "--max-local-prefill-tokens", "0"],
        )  # fmt: skip
        router_url = router.start(timeout=60.0)
        port = _warm(router_url, prefill_url, decode_url, bodies)
        sides: dict[str, Send] = {
            "direct": DirectLegs(prefill_url, decode_url, ("127.0.0.1", port), bodies),
            "via": ViaRouter(router_url, bodies),
        }
        pids = {"router": router.pid, "prefill": prefill.pid, "decode": decode.pid}
        for i in range(rounds):
            pair: dict[str, Any] = {}
            for side in ("direct", "via") if i % 2 == 0 else ("via", "direct"):
                before = {name: process_cpu_s(pid) for name, pid in pids.items()}
                run = run_event_loop(
                    run_load(sides[side], connections=connections, duration=duration, warmup=warmup)
                )
                for name, pid in pids.items():
                    after, start = process_cpu_s(pid), before[name]
                    if after is not None and start is not None and run["requests_all"]:
                        run[f"{name}_cpu_us_per_request"] = (
                            (after - start) / run["requests_all"] * 1e6
                        )
                pair[side] = run
            pair["added_p50_ms"] = pair["via"]["p50_ms"] - pair["direct"]["p50_ms"]
            runs.append(pair)
        direct = sides["direct"]
        assert isinstance(direct, DirectLegs)
        prefill_failures = direct.prefill_failures
    finally:
        if router is not None:
            router.stop()
        decode.stop()
        prefill.stop()
    added = [r["added_p50_ms"] for r in runs]
    return {
        "setup": {
            "protocol": "sglang",
            "dp_size_per_engine": 1,
            "ranks": {"prefill": 0, "decode": 0},
            "prompts": prompts,
            "prompt_tokens": _TOKENS,
            "block_size": _BLOCK,
            "connections": connections,
            "duration_s": duration,
            "warmup_s": warmup,
            "load_generator": "asyncio client, kvevents.http.upstream.Upstream",
            "router_args": ["--max-local-prefill-tokens", "0"],
        },
        "rounds": runs,
        "direct_prefill_failures": prefill_failures,
        "added_p50_ms": added,
        "added_p50_ms_median": statistics.median(added),
    }
