"""A stopped rank (SIGSTOP) stops attracting requests and comes back once continued,
with a real `kvevents engine --dp-size 4` (or two engines) behind a real router."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from router_support import KV_CONFIG, Engine, RouterProc, wait_until

pytestmark = pytest.mark.slow  # each test starts its own engines and router

PAGE = 4
PREFIX = list(range(3000, 3000 + 16 * PAGE))  # cached on the rank that is stopped
LATER = list(range(5000, 5000 + 16 * PAGE))  # cached there too, asked only once it is back


def _engine(dp_size: int) -> Engine:
    return Engine(
        ["--dp-size", str(dp_size), "--page-size", str(PAGE), "--request-timeout", "60"], KV_CONFIG
    )


@pytest.fixture
def engine() -> Iterator[Engine]:
    eng = _engine(4)
    yield eng
    eng.stop(expect=None)


def matched(router: RouterProc, tokens: list[int]) -> dict[tuple[str, int], int]:
    body = router.post("/query", {"input_ids": tokens}).json()
    return {(m["worker"], m["dp_rank"]): m["matched_tokens"] for m in body["matches"]}


def cache_on(engine: Engine, rank: int, router: RouterProc, *prompts: list[int]) -> None:
    """Run ``prompts`` on ``rank`` of ``engine`` and wait until the router knows it holds
    them (asked with one token more, so that every block is one an engine reuses)."""
    worker = engine.url
    for prompt in prompts:
        engine.generate(prompt, rank=rank)
        wait_until(
            lambda p=prompt: matched(router, [*p, 0]).get((worker, rank)) == len(p),
            20,
            f"the router to see rank {rank} holding a prompt",
        )


def holders(router: RouterProc) -> list[dict[str, Any]]:
    holders: list[dict[str, Any]] = router.http.get("/workers").json()["holders"]
    return holders


def stall_of(router: RouterProc, worker: str, rank: int) -> dict[str, Any] | None:
    return next(
        h["stall"] for h in holders(router) if h["worker"] == worker and h["dp_rank"] == rank
    )


def completion(router: RouterProc, prompt: list[int], timeout: float = 30.0) -> httpx.Response:
    """``prompt`` through the router's /v1/completions (one token)."""
    return router.http.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=timeout
    )


def placed(response: httpx.Response) -> tuple[str, int]:
    assert response.status_code == 200, response.text
    return response.headers["x-kvevents-worker"], int(response.headers["x-kvevents-dp-rank"])


def test_a_stopped_rank_stops_attracting_its_prefix_and_comes_back(engine: Engine) -> None:
    """SIGSTOP on the rank holding a prefix: the request stuck there stalls it (the engine's
    /load, polled every 30 s, says nothing meanwhile), new requests for the prefix go to
    other ranks, and once continued the stuck request is answered and the rank takes its
    prefixes again."""
    router = RouterProc([engine.url], "--load-interval", "30")
    try:
        wait_until(lambda: router.connected() == 4, 20, "the router to follow all four ranks")
        worker, rank = engine.url, 2
        assert {h["worker"] for h in holders(router)} == {worker}
        cache_on(engine, rank, router, PREFIX, LATER)
        assert placed(completion(router, [*PREFIX, 1])) == (worker, rank)
        pid = engine.rank_pids()[rank]
        os.kill(pid, signal.SIGSTOP)
        stuck: list[httpx.Response] = []
        try:
            waiting = threading.Thread(
                target=lambda: stuck.append(completion(router, [*PREFIX, 2], timeout=60.0))
            )
            waiting.start()
            wait_until(
                lambda: stall_of(router, worker, rank) is not None,
                10,
                "the stopped rank to be stalled",
                interval=0.05,
            )
            stall = stall_of(router, worker, rank)
            assert stall is not None and stall["causes"] == ["requests"]
            elsewhere = [placed(completion(router, [*PREFIX, 3, i])) for i in range(4)]
            assert all(w == worker and r != rank for w, r in elsewhere), elsewhere
            metrics = router.http.get("/metrics").text
            assert (
                f'kvevents_router_stalls_total{{cause="requests",dp_rank="{rank}",'
                f'worker="{worker}"}} 1.0' in metrics
            )
        finally:
            os.kill(pid, signal.SIGCONT)
        waiting.join(60.0)
        assert not waiting.is_alive() and placed(stuck[0]) == (worker, rank)
        wait_until(lambda: stall_of(router, worker, rank) is None, 10, "the rank to come back")
        assert placed(completion(router, [*LATER, 4])) == (worker, rank)
    finally:
        router.stop()


def test_a_whole_engine_stopped_sends_its_prefixes_to_the_other_engine() -> None:
    """SIGSTOP on an engine's server and every rank of it, with nothing in flight there:
    its unanswered load poll stalls both its ranks, its prefix goes to the other engine,
    and once continued it answers and takes its prefixes again."""
    first, second = _engine(2), _engine(2)
    router = None
    try:
        router = RouterProc([first.url, second.url], "--load-interval", "0.2")
        wait_until(lambda: router.connected() == 4, 20, "the router to follow all four ranks")
        cache_on(second, 1, router, PREFIX, LATER)
        pids = [second.proc.pid, *second.rank_pids()]
        worker = second.url
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(
                lambda: all(stall_of(router, worker, r) is not None for r in (0, 1)),
                15,
                "the stopped engine's ranks to be stalled",
            )
            stall = stall_of(router, worker, 0)
            assert stall is not None and stall["causes"] == ["engine"]
            for i in range(3):
                assert placed(completion(router, [*PREFIX, i]))[0] != worker
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        wait_until(
            lambda: all(stall_of(router, worker, r) is None for r in (0, 1)),
            15,
            "the engine to come back",
        )
        assert placed(completion(router, [*LATER, 4])) == (worker, 1)
    finally:
        if router is not None:
            router.stop()
        first.stop(expect=None)
        second.stop(expect=None)
