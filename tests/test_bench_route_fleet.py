"""The fleet-size /route benchmark on a tiny run: both ways chose alike, every figure is there.

No speed is asserted; the run itself fails if the best-few path and the every-holder
path ever choose differently.
"""

from __future__ import annotations

import pytest

from kvevents.bench.route_fleet import run_route_fleet_bench


def test_a_tiny_run_reports_every_fleet_size() -> None:
    r = run_route_fleet_bench(ranks=(4, 70), prompts=8, tokens=256, requests=20, rounds=1)
    assert r["settings"]["top"] == 4
    assert set(r["fleets"]) == {"4", "70"}
    for fleet in r["fleets"].values():
        assert fleet["top_us"] > 0 and fleet["every_us"] > 0 and fleet["request_us"] > 0
        assert fleet["relayed_us"] > 0 and fleet["recorded_us"] > 0


def test_no_fleet_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one fleet size"):
        run_route_fleet_bench(ranks=())
