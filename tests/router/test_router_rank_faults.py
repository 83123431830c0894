"""A dead, restarting or stalled rank: the router routes around exactly that rank."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from router_support import KV_CONFIG, Engine, RouterProc, wait_until

PAGE = 4
pytestmark = pytest.mark.slow  # each test starts its own engine and router


@pytest.fixture
def engine() -> Iterator[Engine]:
    eng = Engine(
        [
            "--dp-size",
            "2",
            "--page-size",
            str(PAGE),
            "--dead-rank-grace",
            "120",
            "--request-timeout",
            "3",
        ],
        KV_CONFIG,
    )
    yield eng
    eng.stop(expect=None)


@pytest.fixture
def router(engine: Engine) -> Iterator[RouterProc]:
    proc = RouterProc([engine.url], "--load-interval", "0.2")
    wait_until(lambda: availability(proc) == {0: True, 1: True}, 20, "both ranks available")
    yield proc
    proc.stop()


def availability(router: RouterProc) -> dict[int, bool]:
    holders = router.http.get("/workers").json()["holders"]
    return {h["dp_rank"]: h["load"]["available"] for h in holders}


def route_many(router: RouterProc, n: int, seed: int) -> list[tuple[int, Any]]:
    """(status, engine dp_rank or the error) of ``n`` distinct prompts sent through the router."""
    out = []
    for i in range(n):
        prompt = [seed, i, *range(100, 112)]
        response = router.post("/generate", {"input_ids": prompt, "max_new_tokens": 1})
        body = response.json()
        out.append((response.status_code, body.get("dp_rank", body)))
    return out


def test_a_killed_rank_is_unroutable_until_restarted(engine: Engine, router: RouterProc) -> None:
    """After kill -9 of rank 0 every request goes to rank 1; once restarted, rank 0 is routable again."""
    os.kill(engine.rank_pids()[0], signal.SIGKILL)
    wait_until(lambda: availability(router) == {0: False, 1: True}, 20, "rank 0 unavailable")
    assert route_many(router, 12, seed=1) == [(200, 1)] * 12
    restarted = engine.http.post("/admin/restart_rank", params={"dp_rank": 0})
    assert restarted.status_code == 200, restarted.text
    wait_until(lambda: availability(router) == {0: True, 1: True}, 20, "rank 0 available again")
    assert (200, 0) in route_many(router, 12, seed=2)


def test_a_stalled_rank_makes_only_itself_unroutable(engine: Engine, router: RouterProc) -> None:
    """SIGSTOP on rank 0: /load reports it unavailable, rank 1 keeps serving, and a request
    pinned to rank 0 answers 504 after --request-timeout instead of hanging."""
    pid = engine.rank_pids()[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        load = engine.http.get("/load").json()["ranks"]
        assert [r["available"] for r in load] == [False, True]
        assert "did not answer 'load'" in load[0]["error"]
        wait_until(lambda: availability(router) == {0: False, 1: True}, 20, "only rank 0 down")
        assert route_many(router, 8, seed=3) == [(200, 1)] * 8
        with httpx.Client(base_url=engine.url, timeout=30.0) as client:
            stuck = client.post(
                "/generate", json={"input_ids": [1, 2, 3], "routed_dp_rank": 0, "max_new_tokens": 1}
            )
        assert stuck.status_code == 504
        assert "did not answer 'generate' in 3 s" in stuck.json()["error"]
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: availability(router) == {0: True, 1: True}, 20, "rank 0 back after SIGCONT")
