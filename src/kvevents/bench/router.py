"""Router under load: routing requests per second against the bare-stack ceiling, one run.

Setup, as a new user would have it: ``kvevents engine --dp-size 4`` and ``kvevents
router --engine URL [--workers N]`` as real processes, and ``prompts`` distinct prompts
of 2,048 (and 8,192) tokens stored on the engine, spread over its ranks, until the
router's index holds every block. Then `wrk <https://github.com/wg/wrk>`_ (Debian's
``wrk`` package) posts ``{"input_ids": [...]}`` bodies, cycling through the stored
prompts, at ``connections`` connections for ``duration`` seconds to:

* ``/route`` and ``/query`` of the router, with one process and with ``--workers 2``;
* the bare server (:mod:`kvevents.bench.bare_server`): the same HTTP stack that only
  parses the body, the ceiling for any router on it;
* ``/v1/completions`` through the router, against the same requests sent to the engine
  directly and through a bare relay, alternating over ``completions_rounds`` rounds
  (several, because one round's added p50 moves a lot on shared cores:
  :mod:`kvevents.bench.completions`; ``results["completions"]``); ``completions_only``
  runs this comparison and nothing else;
* ``/route`` recording its decision with ``--sync`` to a local ``nats-server`` against
  without, interleaved over ``sync_rounds`` rounds (:mod:`kvevents.bench.note_cost`;
  ``results["note_cost"]``);
* disaggregated serving, once the rest has stopped: a prefill and a decode engine
  behind ``kvevents router --prefill --decode``, against a client sending both legs
  itself, alternating over ``pd_rounds`` rounds (:mod:`kvevents.bench.pd_router`;
  ``results["pd"]``); ``pd_only`` runs this comparison and nothing else, without wrk.

Every figure is from the same run on the same machine; wrk runs with one thread, which
competes with the servers for the cores, as it would for any router.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

from kvevents.bench.bare_server import READY_PREFIX as BARE_READY
from kvevents.bench.completions import run_completions
from kvevents.bench.note_cost import run_note_cost
from kvevents.bench.pd_router import TYPICAL_ANSWER_TOKENS, run_pd_bench
from kvevents.demo.procs import Child
from kvevents.errors import KVEventsError
from kvevents.router.serve.pd_legs import PDProtocol

__all__ = ["EVENTS_CONFIG_WITH_REPLAY", "run_router_bench"]

_DP_SIZE = 4
_BLOCK = 16
# Replay on, so that each router started after the prompts were stored replays them all
# (the warm-start benchmark runs its engine the same way).
EVENTS_CONFIG_WITH_REPLAY = json.dumps(
    {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
        "bind": True,
    }
)


def _wrk() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise KVEventsError(
            "the router benchmark needs the load generator wrk: install it "
            "(Debian/Ubuntu: apt-get install wrk) and run the benchmark again"
        )
    return path


def _lua_script() -> str:
    return str(resources.files("kvevents.bench") / "data" / "post_bodies.lua")


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 50_000) for _ in range(length)] for _ in range(count)]


def _store(engine: str, prompts: Sequence[list[int]]) -> None:
    """Prefill every prompt on the engine, rank by rank in turn, 8 at a time."""
    with httpx.Client(timeout=120.0) as client:

        def one(i: int) -> None:
            body = {"input_ids": prompts[i], "max_new_tokens": 1, "routed_dp_rank": i % _DP_SIZE}
            client.post(f"{engine}/generate", json=body).raise_for_status()

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(len(prompts))))


def _wait_indexed(router: str, blocks: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    seen = -1
    with httpx.Client(timeout=10.0) as client:
        while time.monotonic() < deadline:
            workers = client.get(f"{router}/workers").json()
            seen = workers["index"]["blocks"]
            # measured once start-up has settled (native mirror built, heap frozen)
            if seen >= blocks and workers["process"].get("settled", True):
                return
            time.sleep(0.2)
    raise KVEventsError(f"the router indexed {seen} of {blocks} blocks within {timeout:g} s")


def _load(
    url: str, bodies: Path, *, duration: float, connections: int, timeout: float = 5.0
) -> dict[str, Any]:
    """One wrk run: requests/s and latency percentiles (ms) of POSTs of ``bodies``."""
    argv = [
        _wrk(),
        "-t1",
        f"-c{connections}",
        f"-d{duration:g}s",
        f"--timeout={timeout:g}s",
        "-s",
        _lua_script(),
        url,
        "--",
        str(bodies),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60, check=True)
    line = next(ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("{"))
    raw = json.loads(line)
    seconds = raw["duration_us"] / 1e6
    return {
        "url": url,
        "requests": raw["requests"],
        "requests_per_s": raw["requests"] / seconds,
        "p50_ms": raw["p50_us"] / 1000,
        "p90_ms": raw["p90_us"] / 1000,
        "p99_ms": raw["p99_us"] / 1000,
        "max_ms": raw["max_us"] / 1000,
        "errors": raw["socket_errors"] + raw["non_2xx"],
        "connections": connections,
        "duration_s": seconds,
    }


def _write_bodies(folder: Path, name: str, docs: Sequence[dict[str, Any]]) -> Path:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(d, separators=(",", ":")) + "\n" for d in docs))
    return path


def _bare_child(relay_to: str | None = None) -> Child:
    bare = Child("bare", [])
    bare.argv = [bare.argv[0], "-m", "kvevents.bench.bare_server", "--port", "0"]
    if relay_to is not None:
        bare.argv += ["--relay-to", relay_to]
    bare.ready_prefix = BARE_READY
    return bare


def _start_router(engine: str, workers: int) -> tuple[Child, str]:
    args = ["--engine", engine, "--port", "0", "--workers", str(workers)]
    router = Child("router", args)
    return router, router.start(timeout=60.0)


def run_router_bench(
    *,
    prompts: int = 256,
    long_prompts: int = 64,
    duration: float = 10.0,
    connections: int = 32,
    workers: Sequence[int] = (1, 2),
    completions: bool = True,
    sync_rounds: int = 3,
    completions_rounds: int = 5,
    completions_only: bool = False,
    pd: bool = True,
    pd_rounds: int = 5,
    pd_only: bool = False,
    pd_protocol: PDProtocol = "sglang",
    pin_router: bool = False,
    pd_max_tokens: int = TYPICAL_ANSWER_TOKENS,
    pd_together: bool = True,
) -> dict[str, Any]:
    """Run every load above once; results as a JSON-ready dict (see the module docstring).

    ``completions_only``: only the ``/v1/completions`` comparison (one router process,
    the 2,048-token prompts stored; no bare server, no ``/route`` or ``/query`` loads, no
    note-cost rounds).
    ``pd``: the disaggregated comparison too; ``pd_only``: that alone; ``pd_protocol``
    and ``pin_router``: its hand-off and its CPU placement, ``pd_max_tokens`` what each of
    its requests decodes, ``pd_together`` its two clients at once (:func:`run_pd_bench`).
    """
    if pd_only:
        return _pd_only(
            prompts,
            duration,
            connections,
            pd_rounds,
            pd_protocol,
            pin_router,
            pd_max_tokens,
            pd_together,
        )
    _wrk()
    if completions_only:
        completions, workers, sync_rounds = True, (1,), 0
        long_prompts, pd = 0, False
    short = _prompts(prompts, 2048, seed=1)
    long = _prompts(long_prompts, 8192, seed=2)
    blocks = (len(short) * 2048 + len(long) * 8192) // _BLOCK
    results: dict[str, Any] = {
        "setup": {
            "dp_size": _DP_SIZE,
            "block_size": _BLOCK,
            "prompts_2048": len(short),
            "prompts_8192": len(long),
            "blocks_indexed": blocks,
            "connections": connections,
            "duration_s": duration,
            "load_generator": "wrk -t1",
            "sync_rounds": sync_rounds,
            "completions_rounds": completions_rounds if completions else 0,
            "completions_only": completions_only,
            "pd_rounds": pd_rounds if pd else 0,
        },
        "runs": {},
    }
    runs: dict[str, Any] = results["runs"]
    engine = Child(
        "engine",
        [
            *("--dp-size", str(_DP_SIZE), "--port", "0", "--max-blocks", "65536"),
            *("--kv-events-config", EVENTS_CONFIG_WITH_REPLAY),
        ],
    )
    bare = None if completions_only else _bare_child()
    with tempfile.TemporaryDirectory(prefix="kvevents-bench-router-") as tmp:
        folder = Path(tmp)
        short_ids = _write_bodies(folder, "ids-2048", [{"input_ids": p} for p in short])
        long_ids = _write_bodies(folder, "ids-8192", [{"input_ids": p} for p in long])
        completion_bodies = _write_bodies(
            folder,
            "completions",
            [{"model": "sim", "prompt": p, "max_tokens": 1} for p in short],
        )
        recorded = _write_bodies(
            folder, "record-2048", [{"input_ids": p, "record": True} for p in short]
        )
        try:
            engine_url = engine.start(timeout=60.0)
            _store(engine_url, short + long)
            if bare is not None:
                bare_url = bare.start(timeout=30.0)
                for name, bodies in (("2048", short_ids), ("8192", long_ids)):
                    runs[f"bare_{name}"] = _load(
                        f"{bare_url}/route", bodies, duration=duration, connections=connections
                    )
                bare.stop()
            for n in workers:
                router, url = _start_router(engine_url, n)
                try:
                    _wait_indexed(url, blocks)
                    for path in () if completions_only else ("route", "query"):
                        for name, bodies in (("2048", short_ids), ("8192", long_ids)):
                            runs[f"{path}_{name}_workers{n}"] = _load(
                                f"{url}/{path}", bodies, duration=duration, connections=connections
                            )
                    if completions and n == 1:
                        relay = _bare_child(relay_to=engine_url)
                        try:
                            relay_url = relay.start(timeout=30.0)
                            compared = run_completions(
                                engine_url,
                                url,
                                completion_bodies,
                                functools.partial(
                                    _load, duration=duration, connections=connections
                                ),
                                pids={
                                    "engine": engine.pid,
                                    "router": router.pid,
                                    "bare_relay": relay.pid,
                                },
                                rounds=completions_rounds,
                                bare_url=relay_url,
                            )
                        finally:
                            relay.stop()
                        results["completions"] = compared
                        first = compared["rounds"][0]
                        runs["completions_direct"] = first["direct"]
                        runs["completions_via_router"] = first["via"]
                        runs["completions_via_bare_relay"] = first["bare"]
                finally:
                    router.stop()
            if sync_rounds > 0:
                wait, load = (
                    functools.partial(_wait_indexed, blocks=blocks),
                    functools.partial(_load, duration=duration, connections=connections),
                )
                results["note_cost"] = run_note_cost(
                    engine_url, recorded, wait, load, rounds=sync_rounds
                )
        finally:
            if bare is not None:
                bare.stop()
            engine.stop()
    if pd:
        compared = run_pd_bench(
            duration=duration,
            connections=connections,
            rounds=pd_rounds,
            protocol=pd_protocol,
            pin_router=pin_router,
            max_tokens=pd_max_tokens,
            together=pd_together,
        )
        _add_pd(results, compared)
    _summarise(results)
    return results


def _pd_only(
    prompts: int,
    duration: float,
    connections: int,
    rounds: int,
    protocol: PDProtocol,
    pin_router: bool,
    max_tokens: int,
    together: bool,
) -> dict[str, Any]:
    setup = {"connections": connections, "duration_s": duration, "pd_only": True}
    results: dict[str, Any] = {"setup": {**setup, "pd_rounds": rounds}, "runs": {}}
    compared = run_pd_bench(
        prompts=prompts,
        duration=duration,
        connections=connections,
        rounds=rounds,
        protocol=protocol,
        pin_router=pin_router,
        max_tokens=max_tokens,
        together=together,
    )
    _add_pd(results, compared)
    _summarise(results)
    return results


def _add_pd(results: dict[str, Any], compared: dict[str, Any]) -> None:
    """The P/D comparison in the results; its first round's runs under their run names."""
    results["pd"] = compared
    first = compared["rounds"][0]
    results["runs"]["pd_direct"] = first["direct"]
    results["runs"]["pd_via_router"] = first["via"]


def _summarise(results: dict[str, Any]) -> None:
    runs = results["runs"]
    summary: dict[str, Any] = {}
    for name in ("2048", "8192"):
        for key, run in runs.items():
            if not key.startswith(("route_", "query_")) or f"_{name}_" not in key:
                continue
            ceiling = runs.get(f"bare_{name}", {}).get("requests_per_s")
            if ceiling:
                summary[f"{key}_share_of_bare"] = run["requests_per_s"] / ceiling
    direct = runs.get("completions_direct")
    via = runs.get("completions_via_router")
    if direct and via:
        summary["completions_added_p50_ms"] = via["p50_ms"] - direct["p50_ms"]
    bare = runs.get("completions_via_bare_relay")
    if direct and bare:
        summary["completions_bare_relay_added_p50_ms"] = bare["p50_ms"] - direct["p50_ms"]
    pd = results.get("pd")
    if pd is not None:
        summary["pd_added_p50_ms_median"] = pd["added_p50_ms_median"]
    compared = results.get("completions")
    if compared is not None:
        summary["completions_added_p50_ms_median"] = compared["added_p50_ms_median"]
        if "bare_added_p50_ms_median" in compared:
            summary["completions_bare_relay_added_p50_ms_median"] = compared[
                "bare_added_p50_ms_median"
            ]
    results["summary"] = summary
