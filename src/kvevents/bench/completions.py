"""What the router's relay adds to ``/v1/completions``: the engine direct against through the router.

Part of ``kvevents bench router`` (:mod:`kvevents.bench.router`), and all of it with
``kvevents bench router --completions-only``. The same bodies,
``{"model": "sim", "prompt": [2,048 token ids], "max_tokens": 1}`` over the prompts
stored on the engine, go under the same ``wrk`` load to the engine's ``/v1/completions``
and to the router's, which routes each and relays it to that engine. Both are measured
``rounds`` times, alternating (direct then via, then via then direct, ...), so drift in
what else runs on the machine falls on both alike. The added latency is the difference
of the p50s within each round; the summary reports each round's and their median.

With a bare relay (``bare_url``: :mod:`kvevents.bench.bare_server` ``--relay-to``, the
router's HTTP stack and client forwarding without routing) each round measures it too,
on the other side of the direct run (via, direct, bare, then bare, direct, via, ...), so
each comparison is of two runs next to each other in time, as a shared machine's speed
drifts within minutes. Its added p50 is what relaying alone costs on this stack, so the
router's added p50 minus it is what routing adds.

Each run also reads the CPU time of the engine and router processes
(``/proc/PID/stat``, Linux), as CPU microseconds per request: on a shared machine
throughput swings with the neighbours' load, the CPU a request costs much less.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["process_cpu_s", "run_completions"]


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (None off Linux or without one)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_completions(
    engine_url: str,
    router_url: str,
    bodies: Path,
    load: Callable[[str, Path], dict[str, Any]],
    *,
    pids: dict[str, int | None],
    rounds: int = 1,
    bare_url: str | None = None,
) -> dict[str, Any]:
    """``rounds`` alternating sets of loads; the runs and the added p50s (see above).

    ``pids``: the processes whose CPU time each run reads (``{"engine": pid, "router":
    pid}``, and the bare relay's). The first round's runs are also the results'
    ``completions_direct`` and ``completions_via_router`` (the caller's run names since
    the benchmark began), and with ``bare_url`` ``completions_via_bare_relay``.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: the comparison needs at least one round")
    targets = {"direct": f"{engine_url}/v1/completions", "via": f"{router_url}/v1/completions"}
    sides = ["direct", "via"]
    if bare_url is not None:  # direct in the middle: next to each run it is compared with
        targets["bare"] = f"{bare_url}/v1/completions"
        sides = ["via", "direct", "bare"]
    runs: list[dict[str, Any]] = []
    for i in range(rounds):
        order = sides if i % 2 == 0 else sides[::-1]
        pair: dict[str, Any] = {}
        for side in order:
            before = {name: process_cpu_s(pid) for name, pid in pids.items()}
            run = load(targets[side], bodies)
            for name, pid in pids.items():
                after, start = process_cpu_s(pid), before[name]
                if after is not None and start is not None and run["requests"]:
                    run[f"{name}_cpu_us_per_request"] = (after - start) / run["requests"] * 1e6
            pair[side] = run
        pair["added_p50_ms"] = pair["via"]["p50_ms"] - pair["direct"]["p50_ms"]
        if "bare" in pair:
            pair["bare_added_p50_ms"] = pair["bare"]["p50_ms"] - pair["direct"]["p50_ms"]
        runs.append(pair)
    added = [r["added_p50_ms"] for r in runs]
    compared: dict[str, Any] = {
        "rounds": runs,
        "added_p50_ms": added,
        "added_p50_ms_median": statistics.median(added),
    }
    if bare_url is not None:
        bare = [r["bare_added_p50_ms"] for r in runs]
        compared["bare_added_p50_ms"] = bare
        compared["bare_added_p50_ms_median"] = statistics.median(bare)
    return compared
