"""The sibling-burst benchmark: real engine and router processes, predictions off and on."""

from __future__ import annotations

import pytest

from kvevents.bench.burst import run_burst_bench
from kvevents.bench.report import headlines

pytestmark = pytest.mark.slow  # runs an engine subprocess


def test_burst_bench_runs_both_modes_and_reports_the_targets() -> None:
    """A small burst run measures each mode; with predictions every group stays on one rank."""
    result = run_burst_bench(groups=4, siblings=4, prefix_tokens=512, prefill_tokens_per_s=1e6)
    off, on = result["modes"]["predictions_off"], result["modes"]["predictions_on"]
    for mode in (off, on):
        assert mode["requests"] == 16 and len(mode["ranks_per_group"]) == 4
        assert mode["ideal_cached_tokens"] == 4 * 3 * 512
    # All siblings of a group leave together; the router decides them in turn before any
    # event can arrive, so with predictions the prefix holds them on the first's rank.
    assert on["mean_ranks_per_group"] == 1.0 and on["hit_rate_of_ideal"] == 1.0
    assert on["decided_by_prediction"] > 0 and off["decided_by_prediction"] == 0
    rows = {f.what: f for f in headlines({"burst": result})}
    assert rows["predictions_on: engine hit rate, share of ideal"].met is True
    assert rows["predictions_off: engine hit rate, share of ideal"].met is None
