"""The offline replay: the real router over simulated caches, on the bundled trace."""

from __future__ import annotations

import pytest

from kvevents import ScoringWeights
from kvevents.demo.offline import OfflineRequest, ServiceModel, offline_replay, workload_requests
from kvevents.demo.replay import Workload, hit_rate, pooled_upper_bound
from kvevents.demo.report import summarize

DEMO = {"dp_size": 4, "page_size": 16, "max_blocks": 65536}


@pytest.fixture(scope="module")
def workload() -> Workload:
    return Workload.load(None, 200, speedup=12.0, max_new_tokens=32)


@pytest.fixture(scope="module")
def requests(workload: Workload) -> list[OfflineRequest]:
    return workload_requests(workload)


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 32])
def test_default_weights_keep_prefix_hits_and_balance_one_or_many_in_flight(
    workload: Workload, requests: list[OfflineRequest], concurrency: int
) -> None:
    """With the default weights, one request at a time or 32, KV-aware routing reaches 90% of the pooled bound, beats round-robin and keeps load max/min within 1.3."""
    bound = hit_rate(pooled_upper_bound(workload, 16, 4 * 65536))
    kv = summarize(offline_replay(requests, concurrency=concurrency, **DEMO), 4)
    rr = summarize(
        offline_replay(requests, concurrency=concurrency, policy="round-robin", **DEMO), 4
    )
    assert kv["requests"] == rr["requests"] == 200
    assert kv["hit_rate"] >= 0.9 * bound
    assert kv["hit_rate"] > rr["hit_rate"]
    assert kv["load_max_over_min"] <= 1.3


@pytest.mark.slow
def test_without_the_balance_term_sequential_requests_collapse_onto_one_rank(
    requests: list[OfflineRequest],
) -> None:
    """The finding this replay reproduces: with no recent-work balance, requests sent one at a time all go to the holder of the trace's shared first block."""
    run = offline_replay(
        requests, concurrency=1, weights=ScoringWeights(balance_weight=0.0), **DEMO
    )
    assert {o.dp_rank for o in run.outcomes if o is not None} == {0}


def test_concurrency_bounds_requests_in_flight() -> None:
    """Requests all arriving at once run at most `concurrency` at a time on the simulated clock."""
    reqs = [OfflineRequest([i] * 32, 0.0, 10) for i in range(6)]
    service = ServiceModel(overhead_s=1.0, decode_tokens_per_s=float("inf"))
    run = offline_replay(
        reqs, dp_size=2, page_size=16, max_blocks=64, concurrency=2, service=service
    )
    sent = [o.sent_s for o in run.outcomes if o is not None]
    assert sent == pytest.approx([0.0, 0.0, 1.0, 1.0, 2.0, 2.0], abs=1e-3)
    assert run.wall_s == pytest.approx(3.0, abs=1e-3)
    with pytest.raises(ValueError, match="concurrency=0"):
        offline_replay(reqs, dp_size=2, page_size=16, max_blocks=64, concurrency=0)
