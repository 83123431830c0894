"""Stalled holders: a rank whose requests stop completing, or whose engine stops
answering its load poll, is passed over while another can take the request, and is
routable again once it answers (:mod:`kvevents.router.decide.stalls`).

The routers here run on a clock the test moves; the engine-poll test runs a real HTTP
server that stops answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from kvevents import Holder
from kvevents.errors import RouterNotReadyError
from kvevents.http.upstream import Upstream
from kvevents.router.decide.load_board import LoadBoard
from kvevents.router.decide.router import Router, Ticket
from kvevents.router.decide.scoring import HolderLoad, score
from kvevents.router.decide.stalls import ENGINE, REQUESTS, STALL_FLOOR_S, StallWatch
from kvevents.router.fleet.engines import EngineState, watch_engine
from kvevents.router.serve.metrics import make_registry, render
from kvevents.subscribe.engine_spec import EngineSpec
from kvevents.wire.hashing import content_keys_per_block

BLOCK = 4
A, B = "http://a", "http://b"
H0, H1, H2 = Holder(A, 0), Holder(A, 1), Holder(B, 0)
PROMPT = list(range(100, 100 + 8 * BLOCK))  # 8 blocks
OTHER = list(range(500, 500 + 8 * BLOCK))


class Clock:
    """Monotonic seconds the test sets."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _router(clock: Clock, stall_after_s: float | None = 1.0) -> Router:
    """Three holders (two ranks of engine a, one of b); PROMPT cached on H0, OTHER on H1."""
    router = Router(block_size=BLOCK, clock=clock, stall_after_s=stall_after_s)
    for holder in (H0, H1, H2):
        router.add_holder(holder)
    router.index.store_keys(H0, content_keys_per_block(PROMPT, BLOCK))
    router.index.store_keys(H1, content_keys_per_block(OTHER, BLOCK))
    return router


def _begin_on(router: Router, holder: Holder, prompt: list[int] = PROMPT) -> Ticket:
    """A request of ``prompt`` begun on ``holder`` (chosen among it alone)."""
    return router.begin(router.route_keyed(router.key_request([prompt]), [holder]))


def _stall(router: Router, holder: Holder) -> dict[str, Any] | None:
    return next(
        h["stall"] for h in router.holder_summary() if (h["worker"], h["dp_rank"]) == holder
    )


def test_a_holder_whose_requests_stop_completing_is_passed_over_until_one_is_answered() -> None:
    """A request on H0 unanswered past the stall time sends H0's prefix elsewhere, and
    H0 takes it again as soon as that request is answered."""
    clock = Clock()
    router = _router(clock)
    ticket = router.begin(router.route(PROMPT, top=1))
    assert ticket.holder == H0
    clock.now += 0.9
    assert router.route(PROMPT, top=1).holder == H0  # not yet: under a second
    clock.now += 0.2
    assert router.route(PROMPT, top=1).holder != H0
    assert router.route(PROMPT).holder != H0  # every path: all scores too
    assert router.loads[H0].stalled and router.loads[H0].available  # the engine's word kept
    stall = _stall(router, H0)
    assert stall is not None and stall["causes"] == ["requests"]
    assert "1 request(s) in flight, none answered for 1.10 s" in stall["why"]
    assert router.stall_watch is not None and router.stall_watch.stalls[(H0, "requests")] == 1
    router.finish(ticket)
    assert router.route(PROMPT, top=1).holder == H0
    assert _stall(router, H0) is None and not router.loads[H0].stalled


def test_a_holder_progressing_under_load_is_never_stalled() -> None:
    """A holder whose requests keep being answered is not stalled, however long it has
    been busy and however old its oldest request."""
    clock = Clock()
    router = _router(clock)
    prompt = [*PROMPT, 0]
    oldest = router.begin(router.route(prompt, top=1))
    for _ in range(20):
        ticket = router.begin(router.route(prompt, top=1))
        assert ticket.holder == H0
        clock.now += 0.5
        router.finish(ticket)
    assert router.route(prompt, top=1).holder == H0
    router.finish(oldest)


def test_the_stall_time_follows_how_long_requests_take() -> None:
    """Fast requests shorten the stall time to four of their durations (at least the
    floor), slow ones never lengthen it past --stall-after, and a straggler answered
    at last barely moves it."""
    clock = Clock()
    router = _router(clock)
    watch = router.stall_watch
    assert watch is not None and watch.after_s == 1.0  # nothing answered yet
    for took in (0.05, 0.05):
        ticket = router.begin(router.route(OTHER, top=1))
        clock.now += took
        router.finish(ticket)
    assert watch.after_s == pytest.approx(0.2)
    straggler = router.begin(router.route(PROMPT, top=1))
    clock.now += 0.21
    assert router.route(PROMPT, top=1).holder != H0  # stalled after 0.2 s, not 1 s
    clock.now += 10.0
    router.finish(straggler)
    assert watch.typical_s == pytest.approx(0.05 + 0.01 * (4 * 0.05 - 0.05))
    for took, after in ((0.001, STALL_FLOOR_S), (5.0, 1.0)):
        fresh_clock = Clock()
        fresh = _router(fresh_clock)
        ticket = fresh.begin(fresh.route(OTHER, top=1))
        fresh_clock.now += took
        fresh.finish(ticket)
        assert fresh.stall_watch is not None and fresh.stall_watch.after_s == after


def test_a_stall_ends_once_nothing_is_in_flight_there() -> None:
    """A failed request says nothing of progress, but once none of a stalled holder's
    requests is in flight it is routable again (the next request finds out)."""
    clock = Clock()
    router = _router(clock)
    first = router.begin(router.route(PROMPT, top=1))
    second = router.begin(router.route(PROMPT, top=1))
    clock.now += 1.5
    assert router.route(PROMPT, top=1).holder != H0
    router.finish(first, failed=True)
    assert router.loads[H0].stalled  # one still in flight, and a failure is no answer
    router.finish(second, failed=True)
    assert not router.loads[H0].stalled
    assert router.route(PROMPT, top=1).holder == H0


def test_when_no_candidate_is_otherwise_available_a_stalled_one_is_chosen() -> None:
    """Stalled holders are the last resort, chosen by cost before any error: only when
    every candidate is down does routing fail."""
    clock = Clock()
    router = _router(clock)
    for holder in (H0, H1, H2):
        _begin_on(router, holder)
    clock.now += 2.0
    for route in (
        lambda: router.route(PROMPT, top=1),
        lambda: router.route(PROMPT, top=4),
        lambda: router.route(PROMPT, top=20),  # through a ranking
        lambda: router.route(PROMPT, top=20),  # a second time: no ranking kept from before
        lambda: router.route(PROMPT),
        lambda: router.route_batch([PROMPT, PROMPT]),
    ):
        assert route().holder == H0  # every one stalled: the cheapest for the prompt
    assert router.route(PROMPT, policy="round-robin").holder in (H0, H1, H2)
    assert all(router.loads[h].stalled for h in (H0, H1, H2))
    router.update_load(A, {"ranks": [{"dp_rank": 0, "available": False}]})
    assert router.route(PROMPT, top=1).holder in (H1, H2)  # down is worse than stalled
    router.update_load(A, {"ranks": [{"dp_rank": 1, "available": False}]})
    router.update_load(B, {"ranks": [{"dp_rank": 0, "available": False}]})
    with pytest.raises(RouterNotReadyError):
        router.route(PROMPT, top=1)
    with pytest.raises(RouterNotReadyError):
        router.route(PROMPT)
    assert all(router.loads[h].stalled for h in (H0, H1, H2))  # lifted only for a decision


def test_round_robin_skips_a_stalled_holder() -> None:
    """Round-robin takes its turns among the holders that are neither down nor stalled."""
    clock = Clock()
    router = _router(clock)
    router.begin(router.route(PROMPT, top=1))
    clock.now += 2.0
    chosen = {router.route(PROMPT, policy="round-robin").holder for _ in range(6)}
    assert chosen == {H1, H2}


def test_an_engine_silent_to_its_poll_has_every_rank_stalled_until_it_answers() -> None:
    """Engine a's poll unanswered: both its ranks stalled (cause engine), engine b takes
    their prefixes, and a's answer makes them routable again."""
    clock = Clock()
    router = _router(clock)
    router.engine_silent(A)
    assert [router.loads.stalled_by(h) for h in (H0, H1, H2)] == [ENGINE, ENGINE, 0]
    assert router.route(PROMPT, top=1).holder == H2
    stall = _stall(router, H1)
    assert stall is not None and stall["causes"] == ["engine"]
    assert "load poll has had no answer for 2.0 s" in stall["why"]
    router.engine_silent(A)  # still silent: counted once
    assert router.stall_watch is not None and router.stall_watch.stalls[(H0, "engine")] == 1
    router.engine_heard(A)
    assert router.route(PROMPT, top=1).holder == H0 and _stall(router, H0) is None


def test_stalls_show_in_the_metrics() -> None:
    """/metrics counts each stall per holder and cause, and shows which holders are stalled."""
    clock = Clock()
    router = _router(clock)
    router.begin(router.route(PROMPT, top=1))
    clock.now += 2.0
    router.route(OTHER, top=1)
    text = render(make_registry(router, lambda: {})).decode()
    assert (
        'kvevents_router_stalls_total{cause="requests",dp_rank="0",worker="http://a"} 1.0' in text
    )
    assert 'kvevents_router_holder_stalled{dp_rank="0",worker="http://a"} 1.0' in text
    assert 'kvevents_router_holder_stalled{dp_rank="1",worker="http://a"} 0.0' in text


def test_without_a_stall_time_nothing_is_watched() -> None:
    """A Router made without stall_after_s (the class's default) never stalls a holder."""
    clock = Clock()
    router = _router(clock, stall_after_s=None)
    router.begin(router.route(PROMPT, top=1))
    clock.now += 3600.0
    assert router.route(PROMPT, top=1).holder == H0
    assert router.stall_watch is None and _stall(router, H0) is None
    router.engine_silent(A)
    assert router.route(PROMPT, top=1).holder == H0


def test_a_kept_ranking_and_the_native_answer_do_not_outlive_a_stall() -> None:
    """The /route answer (the kept ranking, and the native one made from it) puts a
    holder last once it is stalled, with no relayed request in between to notice it."""
    clock = Clock()
    router = _router(clock)
    ticket = router.begin(router.route(PROMPT, top=1))
    for _ in range(2):  # the second request at unchanged loads keeps a ranking
        assert router.route(PROMPT, top=4).holder == H0
    clock.now += 2.0
    answer = router.native.answer(array("I", PROMPT))  # None without the native core
    if answer is not None:
        chosen = json.loads(answer)
        assert (chosen["worker"], chosen["dp_rank"]) != H0
    decision = router.route(PROMPT, top=4)
    assert decision.holder != H0 and decision.scores[-1].holder == H0
    assert not decision.scores[-1].available
    router.finish(ticket)


def test_a_removed_holder_is_forgotten() -> None:
    """A stalled holder its engine no longer has leaves the watch with its stall."""
    clock = Clock()
    router = _router(clock)
    router.begin(router.route(PROMPT, top=1))
    clock.now += 2.0
    router.route(OTHER, top=1)
    router.remove_holder(H0)
    assert router.loads.stalled_by(H0) == 0 and not router.loads.any_stalled


def test_the_board_keeps_the_engines_word_and_the_stall_apart() -> None:
    """A stall and the engine's availability change the row's routable flag each without
    undoing the other, and lifting makes only stalled holders the engine keeps up routable."""
    board = LoadBoard()
    board.slot(H0)
    board.slot(H1)
    assert board.set_stalled(H0, REQUESTS, True) and not board.set_stalled(H0, REQUESTS, True)
    assert not board.set_engine(H0, True)  # the engine says up: still stalled
    assert board[H0] == HolderLoad(stalled=True) and not board[H0].routable
    board.set_stalled(H1, ENGINE, True)
    board.set_engine(H1, False)
    with board.lifted():
        assert board.table()[0] == 1.0 and board.table()[6] == 0.0
        assert board[H0].routable and not board[H1].routable
    assert board.table()[0] == 0.0 and board[H0] == HolderLoad(stalled=True)
    assert board.set_stalled(H0, ENGINE, True) and board.stalled_by(H0) == REQUESTS | ENGINE
    board.set_stalled(H0, REQUESTS | ENGINE, False)
    assert board[H0].routable and board.table()[0] == 1.0
    copy = LoadBoard.of({H0: HolderLoad(stalled=True), H1: HolderLoad(available=False)})
    assert copy[H0] == HolderLoad(stalled=True) and copy.table()[0] == 0.0


def test_score_ranks_a_stalled_holder_with_the_unavailable_ones() -> None:
    """score() puts a stalled holder after every routable one, whatever its cost, and
    leaves its recent work out of the balance's minimum."""
    scores = score(
        4,
        [H0, H1],
        {},
        {H0: HolderLoad(stalled=True), H1: HolderLoad(recent_blocks=50.0, inflight_blocks=9.0)},
    )
    assert [s.holder for s in scores] == [H1, H0]
    assert not scores[1].available and scores[0].balance_blocks == 0.0


def test_a_stall_time_that_is_no_positive_finite_number_is_refused() -> None:
    """StallWatch refuses 0, a negative or an infinite stall time, naming the option."""
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="--stall-after"):
            StallWatch(LoadBoard(), bad)


# --- the engine's load poll, against a real HTTP server ------------------------------


class _QuietEngine(BaseHTTPRequestHandler):
    """A kvevents engine's /load (two ranks); a /load asked while ``quiet`` is set waits
    for ``speak`` before it answers."""

    protocol_version = "HTTP/1.1"
    quiet: ClassVar[threading.Event] = threading.Event()
    speak: ClassVar[threading.Event] = threading.Event()

    def do_GET(self) -> None:
        if self.path == "/load" and type(self).quiet.is_set():
            type(self).speak.wait(30.0)
        ranks = [{"dp_rank": r, "running": 0, "waiting": 0} for r in (0, 1)]
        body = json.dumps({"dp_size": 2, "ranks": ranks}).encode()
        self.send_response(200 if self.path == "/load" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _quiet_engine() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _QuietEngine)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        _QuietEngine.speak.set()
        server.shutdown()
        thread.join(10.0)
        server.server_close()
        _QuietEngine.quiet.clear()
        _QuietEngine.speak.clear()


async def _until(what: str, check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.mark.slow
def test_an_engine_whose_load_poll_goes_unanswered_is_stalled_until_it_answers() -> None:
    """A poll unanswered for stall_after + 1 s stalls both ranks (the engine's word, and
    the slow-poll tolerance, unchanged); the held answer arriving ends the stall."""
    router = Router(block_size=BLOCK, stall_after_s=0.2)

    async def run(url: str) -> None:
        spec = EngineSpec.create(
            url, kv_endpoint="tcp://127.0.0.1:5557", dp_size=2, kind="kvevents"
        )
        state = EngineState(spec)
        holders = [Holder(spec.worker, r) for r in (0, 1)]
        stopping = asyncio.Event()
        upstream = Upstream(timeout=60.0)
        task = asyncio.create_task(
            watch_engine(router, state, upstream, 0.05, stopping, load_timeout=10.0)
        )
        try:
            await _until("both ranks polled", lambda: all(h in router.loads for h in holders))
            assert not router.loads.any_stalled
            _QuietEngine.quiet.set()
            began = time.monotonic()
            await _until("the engine stalled", lambda: router.loads.any_stalled)
            assert time.monotonic() - began >= 1.0  # 0.2 s + the engine's own margin
            assert [router.loads.stalled_by(h) for h in holders] == [ENGINE, ENGINE]
            assert all(router.loads[h].available for h in holders)
            assert state.error is None and state.slow_polls == 0
            _QuietEngine.quiet.clear()
            _QuietEngine.speak.set()
            await _until("the engine heard", lambda: not router.loads.any_stalled)
        finally:
            stopping.set()
            await asyncio.wait_for(task, 15.0)
            await upstream.close()

    with _quiet_engine() as url:
        asyncio.run(run(url))
