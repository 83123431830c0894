"""Router work per request in instructions (callgrind): a figure the machine's noise does not move.

    python benchmarks/router_instructions.py [--requests 2000] [--cases bare,route,...]
                                             [--json OUT]

Needs valgrind (Debian: ``apt-get install valgrind``). Each case (the bare server's
``/route``, the router's ``/route`` and ``/query``, a relayed ``/v1/completions``
through the bare relay and through the router) runs in a fresh process under callgrind,
with and without requests; the difference per request is printed and written as JSON
(default benchmarks/results/router_instructions.json). Compare two builds of the router
with it: the counts repeat exactly. The work is
:func:`kvevents.bench.instructions.run_instructions_bench` (also ``kvevents bench
instructions``); its docstring says what is and is not counted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvevents.bench.instruction_cases import CASES
from kvevents.bench.instructions import run_instructions_bench
from kvevents.results import write_results

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "router_instructions.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per counted run")
    parser.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    try:
        result = run_instructions_bench(requests=args.requests, cases=cases)
    except ValueError as exc:
        parser.error(str(exc))
    per, adds = result["instructions_per_request"], result["router_adds"]
    print(f"{'case':<12} {'instructions per request':>26}")
    for case, n in per.items():
        print(f"{case:<12} {n:>26,}")
    for name, n in adds.items():
        print(f"the router's {name} adds {n:,} instructions per request past its bare server")
    write_results(args.json, result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
