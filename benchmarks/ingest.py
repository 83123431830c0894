"""Ingest capacity: engines one router process follows while answering /route.

    python benchmarks/ingest.py [--engines 4 8 16 32 64] [--block-ops 3000]
                                [--route-rate 200] [--seconds 10] [--workers 1 2]
                                [--json OUT]

Prints each round and writes the figures as JSON (default benchmarks/results/ingest.json).
The work is :func:`kvevents.bench.ingest.run_ingest_bench` (also ``kvevents bench ingest``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvevents.bench.ingest import run_ingest_bench
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "ingest.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--block-ops", type=float, default=3000.0, help="per engine per second")
    parser.add_argument("--route-rate", type=float, default=200.0, help="/route requests/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured per round")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    result = run_ingest_bench(
        engine_counts=args.engines,
        block_ops=args.block_ops,
        route_rate=args.route_rate,
        seconds=args.seconds,
        workers=args.workers,
    )
    for run in result["rounds"]:
        print(
            f"{run['engines']:4d} engines, {run['router_processes']} process(es): "
            f"backlog {run['backlog_s']:.2f} s, applied {run['batches_applied_per_s']:.0f} "
            f"of {run['batches_fed_per_s']:.0f} batches/s, /route p50 {run['route_p50_ms']:.1f} "
            f"p99 {run['route_p99_ms']:.1f} ms, keeps up: {run['keeps_up']}"
        )
    print(f"engines kept up with: {result['engines_kept_up']}")
    write_results(args.json, result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
