"""Subscriber benchmark: batches and blocks decoded per second, per core, on 1 and 4 streams.

    python benchmarks/subscriber.py [--json PATH] [--blocks-target N] [--modes backlog,live]

Prints a table and writes the figures as JSON (default
``benchmarks/results/subscriber.json``). The measurement itself is
:func:`kvevents.bench.subscriber.run_subscriber_bench`; see its docstring for the setup,
and :mod:`kvevents.bench.report` for the target (blocks per CPU second for 32-block
batches).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

from kvevents.bench.subscriber import run_subscriber_bench
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "subscriber.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument(
        "--blocks-target",
        type=int,
        default=2_000_000,
        help="blocks sent per case (default 2,000,000)",
    )
    parser.add_argument(
        "--modes", default="backlog,live", help="comma-separated: backlog, live (default both)"
    )
    args = parser.parse_args(argv)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    result = run_subscriber_bench(blocks_target=args.blocks_target, modes=modes)
    result["machine"] = {"python": platform.python_version(), "cpus": _cpus()}

    header = (
        f"{'mode':<8} {'streams':>7} {'blk/batch':>9} {'batches':>9} {'batches/s':>11} "
        f"{'blocks/s':>11} {'blocks/cpu-s':>13} {'signals':>8}"
    )
    print(header)
    print("-" * len(header))
    for c in result["cases"]:
        print(
            f"{c['mode']:<8} {c['streams']:>7} {c['blocks_per_batch']:>9} "
            f"{c['batches_delivered']:>9,} {c['batches_per_s']:>11,.0f} {c['blocks_per_s']:>11,.0f} "
            f"{c['blocks_per_cpu_s']:>13,.0f} {sum(c['signals'].values()):>8}"
        )
    for blocks, ceiling in result["decode_ceiling"].items():
        print(
            f"decode_batch alone, {blocks}-block batches: {ceiling['batches_per_s']:,.0f} batches/s, "
            f"{ceiling['blocks_per_s']:,.0f} blocks/s"
        )
    worst = min(
        (c["blocks_per_cpu_s"] for c in result["cases"] if c["blocks_per_batch"] == 32),
        default=0.0,
    )
    result["target_met_32"] = worst >= result["target_blocks_per_cpu_s_32"]
    print(
        f"32-block batches, worst case: {worst:,.0f} blocks per CPU second "
        f"(target {result['target_blocks_per_cpu_s_32']:,}): "
        f"{'met' if result['target_met_32'] else 'NOT met'}"
    )
    write_results(args.json, result)
    print(f"wrote {args.json}")
    return 0


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
