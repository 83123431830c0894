"""What a load note costs the routing hot path: ``/route`` with ``--sync`` on and off.

Part of ``kvevents bench router`` (:mod:`kvevents.bench.router`). ``POST /route`` alone
changes nothing and sends no note; with ``"record": true`` the router counts the
decision in its holder's recent work and, when it shares load, sends a ``routed`` note
(:meth:`kvevents.router.core.Router.record`). So both routers here get the same bodies,
``{"input_ids": [...], "record": true}`` over the stored 2,048-token prompts:

* **off**: ``kvevents router --workers 1``: no peers, so no note is made;
* **on**: ``kvevents router --workers 1 --sync nats://...`` against a local
  ``nats-server``: every request encodes a note and queues it for the task that
  publishes it to NATS.

Both run at once, following the same engine, and ``wrk`` alternates between them,
``rounds`` times (off then on, then on then off, ...), so drift in what else runs on
the machine falls on both alike. The cost is ``1 - median(on) / median(off)`` of
requests per second, beside the spread of the per-round ratios. As throughput on a
shared machine swings with whatever else runs, each run also reads the router
process's CPU time (``/proc/PID/stat``, Linux) and reports CPU microseconds per
request: a one-process router at saturation serves about one request per that much
CPU, and the figure moves much less with the neighbours' load. This measures the
sender's side; the receiving side (applying a peer's note, a dictionary update on the
event loop) is not in it, as no other replica publishes during the runs.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvevents.demo.procs import Child
from kvevents.demo.replicas import NatsChild

__all__ = ["run_note_cost"]


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
        on.argv += ["--sync", nats.start(timeout=30.0)]
        urls = {"off": off.start(timeout=60.0), "on": on.start(timeout=60.0)}
        for url in urls.values():
            wait_indexed(url)
        with httpx.Client(timeout=10.0) as client:
            before = client.get(f"{urls['on']}/workers").json()["process"]
        pids = {"off": off.pid, "on": on.pid}
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for r in range(rounds):
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                cpu = _cpu_s(pids[name])
                run = load(f"{urls[name]}/route", bodies)
                used = _cpu_s(pids[name])
                if cpu is not None and used is not None and run["requests"]:
                    run["cpu_us_per_request"] = (used - cpu) / run["requests"] * 1e6
                runs[name].append(run)
        with httpx.Client(timeout=10.0) as client:
            after = client.get(f"{urls['on']}/workers").json()["process"]
    finally:
        on.stop()
        off.stop()
        nats.stop()
    return _summary(runs, before, after)


def _cpu_s(pid: int | None) -> float | None:
    """User plus system CPU seconds of process ``pid`` so far (None off Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
