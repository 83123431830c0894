"""Sibling bursts: groups sharing a new long prefix, through the router, predictions off and on.

    python benchmarks/burst.py [--groups 16] [--siblings 8] [--prefix-tokens 2048]
                               [--prefill-tokens-per-s 20480] [--group-interval 0.025]
                               [--sibling-interval 0] [--json OUT]

Prints each mode's figures and writes them as JSON (default benchmarks/results/burst.json).
The work is :func:`kvevents.bench.burst.run_burst_bench` (also ``kvevents bench burst``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvevents.bench.burst import run_burst_bench
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "burst.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--siblings", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=20_480.0)
    parser.add_argument("--group-interval", type=float, default=0.025, help="seconds")
    parser.add_argument("--sibling-interval", type=float, default=0.0, help="seconds")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    results = run_burst_bench(
        groups=args.groups,
        siblings=args.siblings,
        prefix_tokens=args.prefix_tokens,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        group_interval_s=args.group_interval,
        sibling_interval_s=args.sibling_interval,
    )
    for name, m in results["modes"].items():
        print(
            f"{name:16s} hit rate {100 * m['hit_rate_of_ideal']:5.1f}% of ideal, "
            f"groups on <= 2 ranks {100 * m['groups_on_at_most_2_ranks']:5.1f}% "
            f"(mean {m['mean_ranks_per_group']:.2f} ranks), requests per rank "
            f"{m['requests_per_rank']} (max/min {m['load_max_min']:.2f}), "
            f"decided by a prediction {m['decided_by_prediction']:.0f}, "
            f"confirmation mean/max {m['confirm_seconds_mean']:.3f}/{m['confirm_seconds_max']:.3f} s"
        )
    write_results(args.json, results)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
