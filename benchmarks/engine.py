"""Engine benchmark: KV events and blocks emitted per second per rank on the conversation trace.

    python benchmarks/engine.py [--requests N] [--dp-size 4] [--page-size 16]
                                [--max-blocks 16384] [--trace FILE] [--json OUT]

Prints a table and writes the figures as JSON (default
benchmarks/results/engine.json). The work is :func:`kvevents.bench.engine.run_engine_bench`
(also behind ``kvevents bench engine``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvevents.bench.engine import run_engine_bench
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "engine.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trace", default=None, help="Mooncake trace (default: bundled conversation trace)"
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests to replay (0: all)")
    parser.add_argument("--dp-size", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-blocks", type=int, default=16384, help="KV blocks per rank")
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="cap on decode steps per request"
    )
    parser.add_argument("--hash-scheme", choices=("sglang", "vllm"), default="sglang")
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"output (default {DEFAULT_JSON})"
    )
    args = parser.parse_args(argv)
    result = run_engine_bench(
        trace=args.trace,
        requests=args.requests or None,
        dp_size=args.dp_size,
        page_size=args.page_size,
        max_blocks=args.max_blocks,
        max_new_tokens=args.max_new_tokens,
        hash_scheme=args.hash_scheme,
    )
    table = Table(title=f"engine: {result['trace']}, dp {args.dp_size}, page {args.page_size}")
    for col in (
        "rank",
        "requests",
        "batches",
        "events",
        "blocks",
        "hit rate",
        "events/s",
        "blocks/s",
        "blocks/CPU-s",
        "dropped",
    ):
        table.add_column(col, justify="right")
    for r in result["ranks"]:
        table.add_row(
            str(r["dp_rank"]),
            str(r["requests"]),
            str(r["batches"]),
            str(r["events"]),
            str(r["blocks_stored"] + r["blocks_removed"]),
            f"{r['hit_rate']:.1%}",
            f"{r['events_per_s']:,.0f}",
            f"{r['blocks_per_s']:,.0f}",
            f"{r['blocks_per_cpu_s']:,.0f}",
            str(r["publisher_dropped"]),
        )
    Console(width=150).print(table)
    total = result["total"]
    print(
        f"total: {total['requests']} requests, {total['events']} events, {total['blocks']} blocks "
        f"in {total['wall_s']:.1f} s wall on {result['host']['cpus']} CPUs"
    )
    write_results(args.json, result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
