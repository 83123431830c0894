"""The router's work per request in instructions: a figure that does not move with the machine.

On shared cores a wall-clock comparison of two builds of the router moves from one minute
to the next by more than most changes are worth; the count of instructions a request
executes does not. This benchmark runs each case of
:mod:`kvevents.bench.instruction_cases` under valgrind's callgrind (Debian's ``valgrind``
package) twice in a fresh process, once doing nothing past start-up and once serving
``requests`` requests, and reports the difference per request: the bare server's
``/route`` work (the body decoded, the ceiling of ``kvevents bench router``), the
router's ``/route`` and ``/query``, and a relayed ``/v1/completions`` through the bare
relay and through the router, whose engine answers in process. HTTP parsing and socket
work, the same for the router and its bare server, are not counted; what routing adds is.

Instructions are not time: C code runs several instructions per cycle, the interpreter
about one, and a request served from cold caches under load costs more cycles per
instruction than one in a loop. They are what a change to the code changes, exactly, and
what two builds can be compared on in any hour. ``PYTHONHASHSEED=0`` keeps dict layouts,
and the counts, the same from run to run, and ``OPENBLAS_NUM_THREADS=1`` keeps NumPy's
BLAS from starting idle threads whose wake-ups would count in proportion to wall time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvevents.bench.instruction_cases import CASES, PROMPTS, TOKENS
from kvevents.errors import KVEventsError

__all__ = ["Counter", "callgrind_count", "run_instructions_bench"]

Counter = Callable[[str, int], int]
"""Instructions a run of one case with that many requests executes in all."""

_COLLECTED = re.compile(r"Collected : (\d+)")


def _valgrind() -> str:
    path = shutil.which("valgrind")
    if path is None:
        raise KVEventsError(
            "the instruction benchmark needs valgrind: install it (Debian/Ubuntu: "
            "apt-get install valgrind) and run it again"
        )
    return path


def callgrind_count(case: str, requests: int) -> int:
    """Instructions ``python -m kvevents.bench.instruction_cases CASE REQUESTS`` executes
    under callgrind, start-up included."""
    argv = [
        _valgrind(),
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-m",
        "kvevents.bench.instruction_cases",
        case,
        str(requests),
    ]
    # One BLAS thread: NumPy's OpenBLAS otherwise starts a thread per core whose idle
    # wake-ups add instructions in proportion to the run's wall time (different on
    # every run)
    env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        tail = done.stderr.strip().splitlines()[-5:]
        raise KVEventsError(
            f"callgrind of case {case!r} with {requests} requests failed "
            f"(exit {done.returncode}): {' / '.join(tail)}"
        )
    return int(found.group(1))


def run_instructions_bench(
    *,
    requests: int = 2000,
    cases: Sequence[str] = CASES,
    count: Counter | None = None,
) -> dict[str, Any]:
    """Instructions per request of each case; ``count`` runs one (default: callgrind).

    Each case runs three times: once uncounted (whatever a first run does once, such as
    writing bytecode caches, stays out), then with 0 and with ``requests`` requests; the
    per-request figure is the difference over ``requests``. ``results["router_adds"]`` is
    the router's count past the bare server's (``route`` past ``bare``, ``relay`` past
    ``bare_relay``).
    """
    if requests < 1:
        raise ValueError(f"requests={requests}: give at least 1")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
    count = count or callgrind_count
    per_request: dict[str, int] = {}
    for case in cases:
        count(case, 0)  # a first run, not counted: what a first run does once stays out
        idle, served = count(case, 0), count(case, requests)
        per_request[case] = round((served - idle) / requests)
    adds = {
        name: per_request[case] - per_request[base]
        for name, case, base in (("route", "route", "bare"), ("relay", "relay", "bare_relay"))
        if case in per_request and base in per_request
    }
    return {
        "setup": {
            "prompts": PROMPTS,
            "tokens": TOKENS,
            "block_size": 16,
            "ranks": 4,
            "requests": requests,
            "counter": "valgrind --tool=callgrind" if count is callgrind_count else "injected",
        },
        "instructions_per_request": per_request,
        "router_adds": adds,
    }
