"""Reading a vLLM's per-rank load from its Prometheus /metrics text."""

from __future__ import annotations

import pytest

from kvevents.router.engines import vllm_rank_loads

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 0.0
vllm:num_requests_running{engine="1",model_name="lora-a"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 5.0
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
"""


def test_each_rank_gets_its_running_and_waiting_requests() -> None:
    """The two scheduler gauges per engine label become one entry per rank; models are summed."""
    assert vllm_rank_loads(METRICS) == [
        {"dp_rank": 0, "running": 2, "waiting": 5},
        {"dp_rank": 1, "running": 1, "waiting": 0},
    ]


def test_metrics_without_the_gauges_give_no_ranks_and_garbage_is_refused() -> None:
    """Another server's metrics yield no ranks (the caller then says so); unparsable text is a ValueError."""
    assert vllm_rank_loads("# TYPE up gauge\nup 1.0\n") == []
    with pytest.raises(ValueError):
        vllm_rank_loads("this is {not metrics")


def test_values_that_are_not_finite_counts_are_skipped() -> None:
    """+Inf, NaN or a negative gauge is no request count: skipped, never an overflow."""
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} +Inf\n'
        'vllm:num_requests_running{engine="1"} NaN\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0"} 4.0\n'
        'vllm:num_requests_waiting{engine="1"} -1.0\n'
    )
    assert vllm_rank_loads(text) == [{"dp_rank": 0, "running": 0, "waiting": 4}]
