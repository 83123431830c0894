"""The warm-start benchmark end to end, on a tiny index: real engine, peer and replica.

Only what the run must produce is asserted (no speed): the replica restarted with
``--peer`` while the engine kept storing prompts ends with every rank's blocks exactly,
the figures are there, and the headline rows read them.
"""

from __future__ import annotations

import pytest

from kvevents.bench.report import headlines
from kvevents.bench.warm_start import run_warm_start_bench

pytestmark = pytest.mark.slow  # runs an engine subprocess


def test_a_tiny_warm_start_run_ends_exact_and_reports_every_figure() -> None:
    r = run_warm_start_bench(
        prompts=16, prompt_blocks=8, dp_size=2, repeat=1, restarts=1, trickle_per_s=10.0
    )
    assert r["index_blocks"] == r["engine_hashes"] == 16 * 8
    assert r["snapshot_bytes"] > 0 and r["all_exact"] is True
    (run,) = r["restarts"]
    assert run["exact"] is True and run["equal_after_launch_s"] is not None
    assert run["ready_after_launch_s"] <= run["equal_after_launch_s"]
    warm = run["warm_start"]
    assert warm["streams"] == 2 and warm["blocks"] >= 16 * 8 and warm["errors"] == []
    rows = [f for f in headlines({"warm_start": r}) if f.benchmark == "warm_start"]
    assert len(rows) == 5 and all(f.what != "results unreadable" for f in rows)
