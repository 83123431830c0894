"""Prefix-index benchmark: match latency, ingest rate, memory and the full decode+apply path.

    python benchmarks/index.py [--trace FILE] [--holders 8,64] [--limit N] [--json PATH]

For each request of a Mooncake trace (default: the bundled conversation trace), match
its hash ids as content keys, then store them on holder ``i mod W``. Prints a table and
writes the figures as JSON (default ``benchmarks/results/index.json``). The measurement
is :func:`kvevents.bench.index.run_index_bench`; its docstring describes each figure,
and :mod:`kvevents.bench.report` holds the targets they are checked against.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

from kvevents.bench.index import run_index_bench
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "index.json"
TARGETS = {
    "match_p99_us": {"8": 15.0, "64": 20.0},
    "ingest_block_ops_per_s": 800_000,
    "full_path_block_ops_per_s": 300_000,
    "bytes_per_holder_block": 100.0,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=None, help="Mooncake trace (JSONL)")
    parser.add_argument("--holders", default="8,64", help="comma-separated holder counts W")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per block, full path")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass")
    parser.add_argument(
        "--repeat", type=int, default=3, help="match/ingest runs; the median-p99 run is reported"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    try:
        holders = [int(w) for w in args.holders.split(",") if w.strip()]
    except ValueError:
        parser.error(f"--holders {args.holders!r}: give comma-separated integers, e.g. 8,64")
    result = run_index_bench(
        args.trace,
        holders=holders,
        limit=args.limit,
        block_size=args.block_size,
        memory=not args.no_memory,
        repeat=args.repeat,
    )
    result["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    result["targets"] = TARGETS

    print(f"trace: {result['trace']} ({result['requests']:,} requests)")
    header = (
        f"{'W':>4} {'match p50 us':>12} {'match p99 us':>12} {'ingest ops/s':>13} "
        f"{'B/(blk,holder)':>14} {'full path ops/s':>15} {'entries':>9}"
    )
    print(header)
    print("-" * len(header))
    for w, f in result["results"].items():
        print(
            f"{w:>4} {f['match_p50_us']:>12.2f} {f['match_p99_us']:>12.2f} "
            f"{f['ingest_block_ops_per_s']:>13,.0f} {f.get('bytes_per_holder_block', 0):>14.1f} "
            f"{f['full_path_block_ops_per_s']:>15,.0f} {f['entries']:>9,}"
        )
    for w, f in result["results"].items():
        runs = ", ".join(f"{p:.2f}" for p in f["match_p99_us_runs"])
        print(f"W={w}: match p99 of each run (us): {runs}")
    print(
        "targets: p99 <= 15 us (W=8), <= 20 us (W=64); ingest >= 800,000/s; "
        "full path >= 300,000/s; <= 100 B per (block, holder)"
    )
    print("for scale (issue 5): Dynamo RadixTree via Python bindings, 87 us p99, ~390,000 ops/s")
    write_results(args.json, result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
