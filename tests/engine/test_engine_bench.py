"""The engine benchmark's library entry point, on a small slice of the bundled trace."""

from __future__ import annotations

import pytest

from kvevents.bench.engine import run_engine_bench

pytestmark = pytest.mark.slow


def test_run_engine_bench_reports_every_rank() -> None:
    """run_engine_bench replays the trace round-robin and reports events and blocks per rank, nothing dropped."""
    result = run_engine_bench(requests=12, dp_size=2, max_blocks=512, max_new_tokens=4)
    assert result["benchmark"] == "engine" and result["trace"] == "conversation_trace.jsonl"
    assert [r["dp_rank"] for r in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        assert rank["requests"] == 6
        assert rank["events"] > 0 and rank["blocks_stored"] > 0
        assert rank["blocks_removed"] > 0  # 512 blocks of 16 tokens: the trace overflows them
        assert rank["publisher_published"] == rank["batches"]
        assert rank["publisher_dropped"] == 0
    assert result["total"]["requests"] == 12


def test_run_engine_bench_refuses_bad_sizes() -> None:
    """Non-positive sizes are refused, naming them."""
    with pytest.raises(ValueError, match="dp_size=0"):
        run_engine_bench(dp_size=0)
