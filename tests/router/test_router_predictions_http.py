"""Predicted entries through a real `kvevents router` and `kvevents engine`, over HTTP."""

from __future__ import annotations

import pytest
from router_support import Engine, RouterProc, wait_until

PAGE = 4


@pytest.fixture(scope="module")
def engine_args() -> list[str]:
    """The shared ``engine``'s arguments here: two ranks of 256 blocks."""
    return ["--dp-size", "2", "--page-size", str(PAGE), "--max-blocks", "256"]


@pytest.fixture(scope="module")
def router_args() -> list[str]:
    """The shared ``router``'s options: a long time-to-live, so nothing in these tests
    depends on how fast they run."""
    return ["--load-interval", "0.2", "--prediction-ttl", "600"]


def query(router: RouterProc, tokens: list[int]) -> dict[int, dict[str, int]]:
    body = router.post("/query", {"input_ids": tokens}).json()
    return {m["dp_rank"]: m for m in body["matches"]}


def test_a_recorded_route_predicts_until_the_engine_confirms(
    engine: Engine, router: RouterProc
) -> None:
    """/route with record predicts the prefix on its rank; a sibling follows; the engine's event confirms it."""
    prefix = list(range(5000, 5032))  # 8 pages
    first = router.post("/route", {"input_ids": [*prefix, 1, 2, 3, 4], "record": True}).json()
    rank = first["dp_rank"]
    assert first["predicted_blocks"] == 0 and first["by_prediction"] is False

    found = query(router, [*prefix, 9, 9, 9, 9])
    assert found[rank]["matched_blocks"] == 0
    assert (found[rank]["predicted_blocks"], found[rank]["predicted_tokens"]) == (8, 32)
    assert "predicted_blocks" not in found[1 - rank]

    sibling = router.post("/route", {"input_ids": [*prefix, 5, 6, 7, 8], "record": True}).json()
    assert sibling["dp_rank"] == rank and sibling["by_prediction"] is True
    assert sibling["predicted_blocks"] == 8
    assert sibling["scores"][0]["matched"] == {"gpu": 0, "cpu": 0, "disk": 0}
    assert sibling["scores"][0]["predicted_blocks"] == 8

    engine.generate(prefix, rank=rank)
    wait_until(
        lambda: query(router, [*prefix, 0])[rank]["matched_tokens"] == 32,
        10,
        "the engine's BlockStored in the index",
    )
    assert "predicted_blocks" not in query(router, [*prefix, 0])[rank]
    metrics = router.http.get("/metrics").text
    assert 'kvevents_router_predicted_entries_total{fate="confirmed"} 8.0' in metrics
    assert "kvevents_router_routes_decided_by_prediction_total 1.0" in metrics


def test_completions_report_predicted_tokens(engine: Engine, router: RouterProc) -> None:
    """A completion names the predicted tokens it was routed by in its decision headers."""
    prefix = list(range(6000, 6032))
    router.post("/route", {"input_ids": [*prefix, 1, 2, 3, 4], "record": True})
    answer = router.post("/v1/completions", {"prompt": [*prefix, 7, 7, 7, 7], "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvevents-predicted-tokens"] == "32"
    assert answer.headers["x-kvevents-matched-tokens"] == "0"
