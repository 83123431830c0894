"""Publisher benchmark: blocks/s end to end against a bare pyzmq PUB, publish() latency, CPU.

    python benchmarks/publisher.py [--json PATH] [--messages N] [--repeats R] [--blocks 1,32]

Prints a table and writes the figures as JSON (default
``benchmarks/results/publisher.json``). The measurement is
:func:`kvevents.bench.publisher.run_publisher_bench`; its docstring describes the setup,
and :mod:`kvevents.bench.report` holds the targets (throughput against the ceiling with
nothing lost, publish() latency).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path
from typing import Any

from kvevents.bench.publisher import run_publisher_bench
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "publisher.json"


def _print_round(r: dict[str, Any]) -> None:
    call = r["call_us"]
    print(
        f"  {r['kind']:<11} {r['blocks_per_batch']:>3}-block  {r['messages_per_s']:>9,.0f} msg/s "
        f"{r['blocks_per_s']:>11,.0f} blocks/s  call p50 {call['p50']:.2f} p99 {call['p99']:.2f} "
        f"max {call['max']:,.0f} us  lost {r['lost'] + r['seq_gaps'] + r.get('dropped', 0)}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--messages", type=int, default=200_000, help="batches per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per kind and batch size")
    parser.add_argument("--blocks", default="1,32", help="blocks per batch, comma-separated")
    args = parser.parse_args(argv)
    blocks = tuple(int(b) for b in args.blocks.split(",") if b.strip())
    print("rounds:")
    result = run_publisher_bench(
        messages=args.messages, block_counts=blocks, repeats=args.repeats, progress=_print_round
    )
    result["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count() or 0}

    header = (
        f"{'blocks':>6} {'ceiling blk/s':>14} {'ours blk/s':>12} {'share':>6} {'raw':>5} "
        f"{'p50 us':>7} {'p99 us':>7} {'max us':>8} {'cpu s/M blk':>11} {'ceil cpu':>9} {'lost':>5}"
    )
    print()
    print(header)
    print("-" * len(header))
    for c in result["cases"]:
        print(
            f"{c['blocks_per_batch']:>6} {c['ceiling_blocks_per_s']:>14,.0f} "
            f"{c['publisher_blocks_per_s']:>12,.0f} {c['share_of_ceiling']:>6.0%} "
            f"{c['share_of_raw_ceiling']:>5.0%} "
            f"{c['publish_us']['p50']:>7.2f} {c['publish_p99_us_median']:>7.2f} "
            f"{c['publish_max_us_worst']:>8,.0f} {c['sender_cpu_s_per_million_blocks']:>11.2f} "
            f"{c['ceiling_cpu_s_per_million_blocks']:>9.2f} {c['lost_in_all_rounds']:>5}"
        )
    print("share: of the ceiling (send_multipart); raw: of the raw ceiling (C-level frame sends)")
    setup = result["setup"]
    print(
        f"load average (1 min) before/after: {setup['loadavg_1m_before']:.2f} / "
        f"{setup['loadavg_1m_after']:.2f} on {result['machine']['cpus']} CPUs"
    )
    for c in result["cases"]:
        print(
            f"{c['blocks_per_batch']}-block: calls over 5 ms: publish() {c['publish_calls_over_5ms']}, "
            f"bare send_multipart {c['ceiling_calls_over_5ms']} (its worst "
            f"{c['ceiling_call_max_us_worst']:,.0f} us), C-level sends "
            f"{c['raw_ceiling_calls_over_5ms']} (worst {c['raw_ceiling_call_max_us_worst']:,.0f} us)"
        )
    for c in result["cases"]:
        missed = [name for name, ok in c["targets"].items() if not ok]
        verdict = "all targets met" if not missed else "NOT met: " + ", ".join(missed)
        print(f"{c['blocks_per_batch']}-block batches: {verdict}")
    write_results(args.json, result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
