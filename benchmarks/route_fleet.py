"""What one ``/route`` costs as the fleet grows: the best few scored, against every holder,
and what a relayed or recorded request costs the router.

    python benchmarks/route_fleet.py [--ranks 4 16 64 256] [--requests 4000] [--rounds 5] [--json OUT]

Prints CPU microseconds per request for each fleet size and writes them as JSON
(default benchmarks/results/route_fleet.json). The work is
:func:`kvevents.bench.route_fleet.run_route_fleet_bench`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvevents.bench.route_fleet import run_route_fleet_bench
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "route_fleet.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--requests", type=int, default=4000, help="per round and way")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    results = run_route_fleet_bench(ranks=args.ranks, requests=args.requests, rounds=args.rounds)
    print(
        "ranks   route, top 4   route, every holder   POST /route in process   "
        "relayed (top 1, begin, finish)   recorded (top 4, record)   (CPU us)"
    )
    for count, fleet in results["fleets"].items():
        print(
            f"{count:>5}   {fleet['top_us']:12.1f}   {fleet['every_us']:19.1f}   "
            f"{fleet['request_us']:22.1f}   {fleet['relayed_us']:30.1f}   "
            f"{fleet['recorded_us']:24.1f}"
        )
    write_results(args.json, results)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
