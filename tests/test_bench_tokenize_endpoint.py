"""The --tokenize-endpoint benchmark on a few requests: a real engine, both ways measured.

Only what the run must produce is asserted (no speed): both ways tokenized the same
prompt (the run fails otherwise) and every figure is there.
"""

from __future__ import annotations

import pytest

from kvevents.bench.tokenize_endpoint import run_tokenize_endpoint_bench


@pytest.mark.slow
def test_a_short_run_measures_both_ways_on_a_real_engine() -> None:
    r = run_tokenize_endpoint_bench(requests=20, rounds=2)
    assert r["settings"] == {"requests": 20, "rounds": 2, "prompt_ids": 2080}
    assert set(r["ways"]) == {"upstream", "httpx"}
    for way in r["ways"].values():
        assert way["cpu_us_per_request"] > 0 and way["wall_us_per_request"] > 0
        assert len(way["rounds_cpu_us"]) == 2
    assert r["cpu_ratio"] > 0


def test_no_requests_is_refused_before_an_engine_starts() -> None:
    with pytest.raises(ValueError, match="give at least 1"):
        run_tokenize_endpoint_bench(requests=0)
