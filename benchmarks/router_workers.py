"""How a router's processes share the machine: requests/s, CPU and context switches per
``/route`` request for each ``--workers`` count, in alternating rounds.

    python benchmarks/router_workers.py [--rounds 2] [--duration 8] [--workers 1 2] [--json OUT]

The load is ``kvevents bench router``'s (2,048-token prompts stored on a
``kvevents engine --dp-size 4``, wrk at 32 connections; needs ``wrk``, Debian:
``apt-get install wrk``). Per run it reads, from ``/proc``, the CPU time and the
voluntary and involuntary context switches of every thread of the router's processes
(the parent and its workers), divided by the requests answered: what one more router
process costs the machine beside what it adds.
Prints the figures and writes them as JSON (default benchmarks/results/router_workers.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvevents.bench import router as bench_router  # the router benchmark's own steps
from kvevents.bench.completions import process_cpu_s
from kvevents.demo.procs import Child
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "router_workers.json"
PROMPTS, TOKENS, CONNECTIONS = 256, 2048, 32


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _counters(pids: list[int]) -> tuple[float, int, int]:
    """CPU seconds of ``pids`` (each process's, all its threads), and the voluntary and
    involuntary context switches of every thread of them (``/proc`` counts switches per
    thread only)."""
    cpu, voluntary, involuntary = 0.0, 0, 0
    for pid in pids:
        cpu += process_cpu_s(pid) or 0.0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except OSError:  # a thread that ended meanwhile
                continue
            for line in status.splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    voluntary += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    involuntary += int(line.split()[1])
    return cpu, voluntary, involuntary


def _one_run(engine: str, bodies: Path, workers: int, duration: float) -> dict[str, Any]:
    router, url = bench_router._start_router(engine, workers)
    try:
        bench_router._wait_indexed(url, PROMPTS * TOKENS // 16)
        pids = [router.pid, *_children(router.pid)]
        threads = sum(len(os.listdir(f"/proc/{pid}/task")) for pid in pids)
        before = _counters(pids)
        run = bench_router._load(f"{url}/route", bodies, duration=duration, connections=CONNECTIONS)
        after = _counters(pids)
    finally:
        router.stop()
    n = max(run["requests"], 1)
    run.update(
        workers=workers,
        threads=threads,
        cpu_us_per_request=(after[0] - before[0]) / n * 1e6,
        voluntary_switches_per_request=(after[1] - before[1]) / n,
        involuntary_switches_per_request=(after[2] - before[2]) / n,
    )
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of every run")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per wrk run")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"output (default {DEFAULT_JSON})"
    )
    args = parser.parse_args(argv)
    prompts = bench_router._prompts(PROMPTS, TOKENS, seed=1)
    engine = Child(
        "engine",
        [
            *("--dp-size", "4", "--port", "0", "--max-blocks", "65536"),
            *("--kv-events-config", bench_router.EVENTS_CONFIG_WITH_REPLAY),
        ],
    )
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        bodies = bench_router._write_bodies(
            Path(folder), "route-2048", [{"input_ids": p} for p in prompts]
        )
        engine_url = engine.start(timeout=60.0)
        try:
            bench_router._store(engine_url, prompts)
            for round_no in range(args.rounds):
                for workers in args.workers:
                    run = _one_run(engine_url, bodies, workers, args.duration)
                    run["round"] = round_no
                    runs.append(run)
                    print(
                        f"round {round_no} --workers {workers}: "
                        f"{run['requests_per_s']:9,.0f} req/s  p99 {run['p99_ms']:5.1f} ms  "
                        f"CPU {run['cpu_us_per_request']:6.1f} us  switches "
                        f"{run['voluntary_switches_per_request']:.2f} voluntary, "
                        f"{run['involuntary_switches_per_request']:.2f} involuntary "
                        f"per request  ({run['threads']} threads)",
                        flush=True,
                    )
        finally:
            engine.stop()
    write_results(args.json, {"cores": os.cpu_count(), "runs": runs})
    print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
