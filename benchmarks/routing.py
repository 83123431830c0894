"""Routing-quality benchmark: the demo's KV-aware vs round-robin replay, as JSON.

    python benchmarks/routing.py [--requests N] [--quick] [--json PATH]

Starts the simulated engine (dp 4, a cache small enough to evict) and the router,
replays the bundled conversation trace through the router (KV-aware) and straight to
the engine (round-robin), and compares both with one pooled cache of the same total
capacity. The measurement is :func:`kvevents.demo.main.run_routing_bench` (``kvevents demo``
without the chart). Prints the demo's tables and writes its results document (default
``benchmarks/results/routing.json``); the targets (hit rate against the pooled upper
bound and round-robin, load balance, nothing lost) are :mod:`kvevents.bench.report`'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from kvevents.demo.main import run_routing_bench
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "routing.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=None, help="requests per policy")
    parser.add_argument("--quick", action="store_true", help="300 requests per policy")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    result = run_routing_bench(quick=args.quick, requests=args.requests, console=Console())
    write_results(args.json, result)
    print(f"wrote {args.json}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
