"""Warm restart from a peer at fleet scale: snapshot size, encode, decode, launch to equality.

    python benchmarks/warm_start.py [--prompts 2100] [--prompt-blocks 128] [--dp-size 4]
                                    [--repeat 3] [--restarts 3] [--trickle 20] [--json OUT]

Real processes on loopback: a simulated engine, a router (the peer) holding
``prompts x prompt_blocks`` blocks (268,800 by default), and replicas started with
``--peer`` while the engine keeps storing prompts. Prints the figures and writes them as
JSON (default benchmarks/results/warm_start.json). The work, and what each figure
means, is :func:`kvevents.bench.warm_start.run_warm_start_bench` (also
``kvevents bench warm_start``). Target: index equal to the engine's within 2 s of
launch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvevents.bench.warm_start import run_warm_start_bench
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "warm_start.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=2_100)
    parser.add_argument("--prompt-blocks", type=int, default=128)
    parser.add_argument("--dp-size", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="snapshot fetches")
    parser.add_argument("--restarts", type=int, default=3, help="replicas started with --peer")
    parser.add_argument(
        "--trickle", type=float, default=20.0, help="prompts/s stored during each restart"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    r = run_warm_start_bench(
        prompts=args.prompts,
        prompt_blocks=args.prompt_blocks,
        dp_size=args.dp_size,
        repeat=args.repeat,
        restarts=args.restarts,
        trickle_per_s=args.trickle,
    )
    print(
        f"index: {r['index_blocks']:,} blocks, {r['engine_hashes']:,} engine hashes; "
        f"snapshot {r['snapshot_bytes']:,} bytes"
    )
    print(
        f"peer /dump request {r['dump_request_s']:.3f} s; encode {r['encode_s']:.3f} s; "
        f"decode+load {r['decode_load_s']:.3f} s"
    )
    for i, run in enumerate(r["restarts"]):
        warm = run["warm_start"]
        equal = run["equal_after_launch_s"]
        print(
            f"restart {i}: ready {run['ready_after_launch_s']:.2f} s, equal "
            f"{'never' if equal is None else f'{equal:.2f} s'} after launch "
            f"(peer load {warm.get('seconds', 0.0):.2f} s), exact {run['exact']}, "
            f"peer's slowest /route meanwhile {run['peer_route_max_ms']:.0f} ms"
        )
    print(
        f"median: ready {r['ready_after_launch_s']:.2f} s, equal "
        f"{r['equal_after_launch_s']} s after launch (target 2 s); "
        f"peer's slowest /route idle {r['peer_route_idle_max_ms']:.0f} ms"
    )
    write_results(args.json, r)
    print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
