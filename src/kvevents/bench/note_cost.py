"""What a load note costs the routing hot path: ``/route`` with ``--sync`` on and off.

Part of ``kvevents bench router`` (:mod:`kvevents.bench.router`). ``POST /route`` with
``"record": true`` counts the decision in its holder's recent work and, when the router
shares load, sends a ``routed`` note (:meth:`kvevents.router.decide.router.Router.record`).
Both routers here get the same such bodies over the stored 2,048-token prompts: **off**
is ``kvevents router --workers 1`` (no peers, no note), **on** the same with ``--sync``
to a local ``nats-server`` (every request encodes and queues a note). Both follow the same
engine, and ``wrk`` alternates between them for ``rounds`` rounds, so drift in what else
runs falls on both alike. The cost is ``1 - median(on) / median(off)`` of requests per
second, beside the spread of the per-round ratios, and the router process's CPU per
request (``/proc/PID/stat``), which moves much less with the neighbours' load. The
receiving side (applying a peer's note) is not in it: no other replica publishes.

:func:`note_cpu_in_process` asks the same without HTTP: one in-process
:class:`~kvevents.router.decide.router.Router` records the same decision ``count`` times,
yielding to the event loop after each (so the publishing task runs as between requests),
with a NATS :class:`LoadNotes` attached and without, interleaved; the difference in CPU
per decision is what one note costs, publishing included.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvevents.bench.completions import process_cpu_s
from kvevents.demo.procs import Child
from kvevents.demo.replicas import NatsChild
from kvevents.router.decide.router import Router
from kvevents.router.fleet.nats_sync import NatsNoteTransport
from kvevents.router.fleet.peers import LoadNotes
from kvevents.types import Holder

__all__ = ["note_cpu_in_process", "run_note_cost"]


def run_note_cost(
    engine_url: str,
    bodies: Path,
    wait_indexed: Callable[[str], None],
    load: Callable[[str, Path], dict[str, Any]],
    *,
    rounds: int,
) -> dict[str, Any]:
    """Interleaved ``rounds`` of wrk against both routers; see the module docstring.

    ``wait_indexed(url)`` returns once a router holds every stored block; ``load(url,
    bodies)`` is one wrk run of the router benchmark."""
    nats = NatsChild()
    off = Child("router", ["--engine", engine_url, "--port", "0", "--workers", "1"])
    on = Child("router", ["--engine", engine_url, "--port", "0", "--workers", "1"])
    try:
        nats_url = nats.start(timeout=30.0)
        on.argv += ["--sync", nats_url]
        urls = {"off": off.start(timeout=60.0), "on": on.start(timeout=60.0)}
        for url in urls.values():
            wait_indexed(url)
        with httpx.Client(timeout=10.0) as client:
            before = client.get(f"{urls['on']}/workers").json()["process"]
        pids = {"off": off.pid, "on": on.pid}
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for r in range(rounds):
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                cpu = process_cpu_s(pids[name])
                run = load(f"{urls[name]}/route", bodies)
                used = process_cpu_s(pids[name])
                if cpu is not None and used is not None and run["requests"]:
                    run["cpu_us_per_request"] = (used - cpu) / run["requests"] * 1e6
                runs[name].append(run)
        with httpx.Client(timeout=10.0) as client:
            after = client.get(f"{urls['on']}/workers").json()["process"]
        in_process = note_cpu_in_process(nats_url, rounds=max(2, rounds))
    finally:
        on.stop()
        off.stop()
        nats.stop()
    doc = _summary(runs, before, after)
    doc["in_process"] = in_process
    per_request = doc["median_cpu_us_per_request_off"]
    if per_request:
        doc["in_process"]["share_of_route_cpu"] = in_process["note_us"] / per_request
    return doc


def note_cpu_in_process(nats_url: str, *, rounds: int, count: int = 20_000) -> dict[str, Any]:
    """CPU microseconds per recorded decision with and without a NATS note; see above."""
    return asyncio.run(_in_process(nats_url, rounds, count))


async def _in_process(nats_url: str, rounds: int, count: int) -> dict[str, Any]:
    router = Router(block_size=16)
    for rank in range(4):
        router.add_holder(Holder("http://engine", rank))
    decision = router.route(list(range(1, 2049)))
    transport = NatsNoteTransport(nats_url, "kvevents.bench.note-cost")
    notes = LoadNotes(router, "bench", [transport])
    notes.start()
    try:
        deadline = time.monotonic() + 10.0
        while not transport.connected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        listeners = list(router.note_listeners)
        us: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(rounds):
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                router.note_listeners[:] = listeners if name == "on" else []
                start = time.process_time()
                for _ in range(count):
                    router.record(decision)
                    await asyncio.sleep(0)
                await asyncio.sleep(0.05)  # the last notes published
                us[name].append((time.process_time() - start) / count * 1e6)
        router.note_listeners[:] = listeners
        connected = transport.connected
    finally:
        await notes.close()
    off, on = statistics.median(us["off"]), statistics.median(us["on"])
    return {
        "decisions_per_round": count,
        "us_per_decision_off": us["off"],
        "us_per_decision_on": us["on"],
        "note_us": on - off,
        "notes_sent": notes.sent,
        "notes_dropped": transport.dropped,
        "connected": connected,
    }


def _summary(
    runs: dict[str, list[dict[str, Any]]], before: dict[str, Any], after: dict[str, Any]
) -> dict[str, Any]:
    rate = {name: [run["requests_per_s"] for run in rs] for name, rs in runs.items()}
    p99 = {name: [run["p99_ms"] for run in rs] for name, rs in runs.items()}
    ratios = [on / off for on, off in zip(rate["on"], rate["off"], strict=True) if off]
    median_off = statistics.median(rate["off"])
    median_on = statistics.median(rate["on"])
    requests_on = sum(run["requests"] for run in runs["on"])
    cpu = {
        name: [run["cpu_us_per_request"] for run in rs if "cpu_us_per_request" in run]
        for name, rs in runs.items()
    }
    cpu_off = statistics.median(cpu["off"]) if cpu["off"] else None
    cpu_on = statistics.median(cpu["on"]) if cpu["on"] else None
    return {
        "rounds": len(ratios),
        "body": '{"input_ids": [2,048 ids], "record": true}',
        "requests_per_s_off": rate["off"],
        "requests_per_s_on": rate["on"],
        "p99_ms_off": p99["off"],
        "p99_ms_on": p99["on"],
        "median_requests_per_s_off": median_off,
        "median_requests_per_s_on": median_on,
        "cost": 1.0 - median_on / median_off if median_off else 0.0,
        "round_ratios_on_over_off": ratios,
        "cpu_us_per_request_off": cpu["off"],
        "cpu_us_per_request_on": cpu["on"],
        "median_cpu_us_per_request_off": cpu_off,
        "median_cpu_us_per_request_on": cpu_on,
        # CPU a request costs more with notes on, over its cost without
        "cpu_cost": cpu_on / cpu_off - 1.0 if cpu_on and cpu_off else None,
        "errors": sum(run["errors"] for rs in runs.values() for run in rs),
        # every recorded /route of the "on" router should have made one note
        "requests_on": requests_on,
        "notes_sent": after["notes"]["sent"] - before["notes"]["sent"],
        "notes_dropped": after["sync"]["dropped"] - before["sync"]["dropped"],
        "sync_connected": bool(after["sync"]["connected"]),
    }
