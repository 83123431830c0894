"""What ``--tokenize-endpoint`` costs the router per text prompt: its engine client against httpx.

    python benchmarks/tokenize_endpoint.py [--requests 2000] [--rounds 3] [--json OUT]

Prints each way's CPU and wall time per request and writes them as JSON (default
benchmarks/results/tokenize_endpoint.json). The work is
:func:`kvevents.bench.tokenize_endpoint.run_tokenize_endpoint_bench`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvevents.bench.tokenize_endpoint import run_tokenize_endpoint_bench
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "tokenize_endpoint.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000, help="per round and way")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    results = run_tokenize_endpoint_bench(requests=args.requests, rounds=args.rounds)
    print(f"prompt of {results['settings']['prompt_ids']} ids, one request at a time")
    for name, way in results["ways"].items():
        print(
            f"{name:9s} cpu {way['cpu_us_per_request']:7.1f} us/request "
            f"(rounds {way['rounds_cpu_us']}), wall {way['wall_us_per_request']:7.1f} us/request"
        )
    print(f"httpx costs {results['cpu_ratio']}x the CPU of the router's engine client")
    write_results(args.json, results)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
