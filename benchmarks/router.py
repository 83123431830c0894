"""Router benchmark: /route and /query under wrk load against the bare-stack ceiling.

    python benchmarks/router.py [--prompts 256] [--long-prompts 64] [--duration 10]
                                [--connections 32] [--workers 1 2] [--no-completions]
                                [--sync-rounds 3] [--completions-rounds 3]
                                [--completions-only] [--json OUT]

Needs the load generator ``wrk`` (Debian: ``apt-get install wrk``). Prints the figures
and writes them as JSON (default benchmarks/results/router.json). The work is
:func:`kvevents.bench.router.run_router_bench` (also behind ``kvevents bench router``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from kvevents.bench.router import run_router_bench
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "router.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=256, help="2,048-token prompts stored")
    parser.add_argument("--long-prompts", type=int, default=64, help="8,192-token prompts stored")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument(
        "--workers", type=int, nargs="*", default=[1, 2], help="router processes (none: skip)"
    )
    parser.add_argument("--no-completions", action="store_true", help="skip /v1/completions")
    parser.add_argument(
        "--completions-rounds",
        type=int,
        default=3,
        help="alternating rounds of /v1/completions, engine direct and through the router",
    )
    parser.add_argument(
        "--completions-only",
        action="store_true",
        help="run only the /v1/completions comparison (one router process)",
    )
    parser.add_argument(
        "--sync-rounds",
        type=int,
        default=3,
        help="interleaved rounds of /route recording, --sync on and off (0: skip)",
    )
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"output (default {DEFAULT_JSON})"
    )
    args = parser.parse_args(argv)
    result = run_router_bench(
        prompts=args.prompts,
        long_prompts=args.long_prompts,
        duration=args.duration,
        connections=args.connections,
        workers=args.workers,
        completions=not args.no_completions,
        sync_rounds=args.sync_rounds,
        completions_rounds=args.completions_rounds,
        completions_only=args.completions_only,
    )
    for name, run in result["runs"].items():
        print(
            f"{name:28s} {run['requests_per_s']:9,.0f} req/s   p50 {run['p50_ms']:7.2f} ms   "
            f"p99 {run['p99_ms']:7.2f} ms   errors {run['errors']}"
        )
    for name, value in result["summary"].items():
        print(f"{name:40s} {value:.3f}")
    compared = result.get("completions")
    if compared is not None:
        added = ", ".join(f"{a:+.2f}" for a in compared["added_p50_ms"])
        print(
            f"/v1/completions through the router adds {compared['added_p50_ms_median']:+.2f} ms"
            f" at p50 (median of {len(compared['rounds'])} rounds: {added})"
        )
    cost = result.get("note_cost")
    if cost is not None:
        ratios = ", ".join(f"{r:.3f}" for r in cost["round_ratios_on_over_off"])
        print(
            f"/route recording, --sync off / on: {cost['median_requests_per_s_off']:,.0f} / "
            f"{cost['median_requests_per_s_on']:,.0f} req/s (median of {cost['rounds']}); "
            f"note cost {cost['cost']:.1%}; per-round on/off {ratios}; "
            f"notes sent {cost['notes_sent']:,} for {cost['requests_on']:,} requests"
        )
        if cost["cpu_cost"] is not None:
            print(
                f"router CPU per request, off / on: {cost['median_cpu_us_per_request_off']:.0f}"
                f" / {cost['median_cpu_us_per_request_on']:.0f} us (median); note cost "
                f"{cost['cpu_cost']:.1%}"
            )
        inner = cost["in_process"]
        share = inner.get("share_of_route_cpu")
        print(
            f"in process, per recorded decision off / on: "
            f"{statistics.median(inner['us_per_decision_off']):.1f} / "
            f"{statistics.median(inner['us_per_decision_on']):.1f} us CPU: a note costs "
            f"{inner['note_us']:.1f} us"
            + ("" if share is None else f", {share:.1%} of a /route request's CPU")
        )
    write_results(args.json, result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
