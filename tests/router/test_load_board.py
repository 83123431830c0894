"""LoadBoard: the router's loads in one table, ``recent`` decayed by one scale.

What it must keep: every holder's ``recent`` is what decaying each one per routed
request would give (the scale folded in long before float64 runs out), in-flight
counts never go below zero, and what it shows as ``Router.loads`` are copies that say
what the board holds. That its best few are ``score()``'s head is
``tests/router/test_router_ranking.py``'s.
"""

from __future__ import annotations

import random

import pytest

from kvevents import Holder, HolderLoad, ScoringWeights
from kvevents.router.decide import load_board
from kvevents.router.decide.load_board import LoadBoard
from kvevents.router.decide.router import Router
from kvevents.router.decide.scoring import pending_blocks

H0, H1, H2 = Holder("http://a", 0), Holder("http://a", 1), Holder("http://b", 0)


def test_recent_work_halves_every_half_life_and_a_new_holder_is_added() -> None:
    """Each routed request decays every holder's recent work; after half_life requests
    elsewhere it has halved. Only the router's own requests count in ``routed``."""
    decay = ScoringWeights(balance_half_life=4.0).decay
    board = LoadBoard()
    board.slot(H1)
    board.note_routed(H0, 100.0, decay, count=True)
    for _ in range(4):
        board.note_routed(H1, 1.0, decay, count=False)
    assert board[H0].recent_blocks == pytest.approx(50.0)
    assert board[H1].recent_blocks == pytest.approx(sum(0.5 ** (k / 4) for k in range(4)))
    assert (board[H0].routed, board[H1].routed) == (1, 0)
    board.note_routed(H2, 8.0, decay, count=True)
    assert board[H2].recent_blocks == pytest.approx(8.0)  # a holder not seen before
    assert list(board) == [H1, H0, H2] and len(board) == 3


@pytest.mark.parametrize("decay", [0.99, 0.5, 1e-30, 0.0])
def test_recent_work_is_what_decaying_every_holder_gives(decay: float) -> None:
    """Thousands of requests, the scale folded in many times over (0.5 ** 3,000 is far
    below float64's smallest number): every holder's recent work is, within rounding,
    what multiplying each one by the decay per request gives."""
    rng = random.Random(7)
    holders = [Holder("http://e", r) for r in range(8)]
    board = LoadBoard()
    expected = dict.fromkeys(holders, 0.0)
    for _ in range(3000):
        chosen, blocks = rng.choice(holders), float(rng.randrange(1, 200))
        board.note_routed(chosen, blocks, decay, count=True)
        for h in expected:
            expected[h] *= decay
        expected[chosen] += blocks
    for h in holders:
        assert board[h].recent_blocks == pytest.approx(expected[h], rel=1e-9, abs=1e-300)
    assert board.scale >= load_board._FOLD_BELOW


def test_in_flight_counts_never_go_below_zero() -> None:
    """Late or repeated removals stop at zero; removing from an unknown holder adds none."""
    board = LoadBoard()
    board.add_inflight(H0, 1, 5.0)
    board.add_inflight(H0, -1, -5.0)
    board.add_inflight(H0, -1, -5.0)
    assert (board[H0].inflight_requests, board[H0].inflight_blocks) == (0, 0.0)
    board.add_inflight(H1, -1, -3.0)
    assert H1 not in board


def test_polls_say_whether_they_changed_anything() -> None:
    """An engine's poll changes availability and its request count; the same poll
    again changes nothing (the router keeps its ranking then)."""
    board = LoadBoard()
    assert board.set_engine(H0, True, 3)
    assert not board.set_engine(H0, True, 3)
    assert not board.set_engine(H0, True)  # no count told: the last one stays
    assert board.set_engine(H0, False)
    assert board[H0] == HolderLoad(engine_requests=3, available=False)
    board.set_engine(H1, True, 0)
    board.set_engine(H2, True, 0)
    assert board.set_worker_available("http://a", False)
    assert [board[h].available for h in (H0, H1, H2)] == [False, False, True]
    assert not board.set_worker_available("http://a", False)  # said again: no change


def test_router_loads_are_copies_of_what_the_board_holds() -> None:
    """``Router.loads`` shows the board: changing a copy changes nothing, and each
    change through the router shows in the next read."""
    router = Router(block_size=4)
    router.add_holder(H0, block_size=4)
    shown = router.loads[H0]
    shown.inflight_requests = 9  # a copy: the router's loads are not changed so
    assert router.loads[H0].inflight_requests == 0
    ticket = router.begin(router.route([1, 2, 3, 4]))
    assert router.loads[H0].inflight_requests == 1 and router.loads[H0].routed == 1
    router.finish(ticket)
    assert router.loads[H0] == HolderLoad(routed=1, recent_blocks=1.0)
    assert router.loads.snapshot() is router.loads.snapshot()  # built once per change


def test_a_fleet_routes_by_the_native_scan_as_score_ranks_it() -> None:
    """Past a few candidates a relayed request's choice comes from the native scan over
    the board's table (weights given as ints too), and it is the holder score() puts
    first."""
    from kvevents import kernels

    compiled = kernels.load()
    assert compiled is not None, kernels.status()
    assert compiled.ROW_STRIDE == load_board._STRIDE, "the table's layout, read alike"
    router = Router(block_size=4, weights=ScoringWeights(load_weight=1, balance_weight=0))
    router.native._module = None  # the one-pass choice, not the whole native one
    holders = [Holder(f"http://e{r // 8}", r % 8) for r in range(load_board._COMPILED_FROM + 8)]
    for h in holders:
        router.add_holder(h, block_size=4)
    router.index.store_keys(holders[5], router.index.keys_for(list(range(16))))
    rng = random.Random(3)
    tickets = []
    scans = kernels.calls()["scan"]
    for n in range(200):
        prompt = list(range(16)) if n % 3 == 0 else [rng.randrange(1000) for _ in range(8)]
        chosen = router.route(prompt, top=1)
        every = router.route(prompt)  # all scored by score(), over the same loads
        assert chosen.scores == every.scores[:1]
        tickets.append(router.begin(chosen))
        if n % 2:
            router.finish(tickets.pop(0))
    assert kernels.calls()["scan"] >= scans + 200, "the native scan chose them"


def test_the_table_the_scan_reads_is_every_row_as_it_is_now() -> None:
    """The compiled scan reads a copy of the rows, brought up to date from the rows that
    changed since it last read them: one row per slot, equal to what the board shows."""
    board = LoadBoard()
    holders = [Holder("http://e", r) for r in range(5)]
    for h in holders[:3]:
        board.slot(h)
    assert len(board.table()) == 3 * 6
    board.add_inflight(holders[1], 2, 7.5)
    board.note_routed(holders[4], 3.0, 0.5, count=True)  # a new slot, and a decay
    board.set_engine(holders[0], False, 4)
    table = board.table()
    assert len(board) == 4 and len(table) == 4 * 6  # holders[3] never came
    for h in board:
        slot = board.slot(h)
        available, engine, inflight, blocks, raw, routed = table[slot * 6 : slot * 6 + 6]
        shown = board[h]
        assert (available != 0.0, engine, inflight, blocks, raw * board.scale, routed) == (
            shown.available,
            shown.engine_requests,
            shown.inflight_requests,
            shown.inflight_blocks,
            shown.recent_blocks,
            shown.routed,
        )


def test_a_request_ending_between_polls_leaves_no_foreign_request_behind() -> None:
    """The engine's count moves with this router's requests between its polls: a poll
    taken while a request of ours ran, then the request's end, leaves the rank idle
    (before, it looked busy with a foreign request until the next poll); the engine's
    own requests stay counted as the poll said; a request begun after a poll is not
    taken for one of the engine's own; and the count never goes below zero."""
    weights = ScoringWeights()
    board = LoadBoard()
    board.add_inflight(H0, 1, 5.0)
    # polled while it ran: the one request it counts is ours, as the board had it
    assert not board.set_engine(H0, True, 1)
    board.add_inflight(H0, -1, -5.0)
    assert board[H0] == HolderLoad(engine_requests=0)
    assert pending_blocks(board[H0], weights) == 0.0

    board.set_engine(H1, True, 3)  # two of the engine's own, and ours
    board.add_inflight(H1, 1, 2.0)
    board.set_engine(H1, True, 3)
    assert pending_blocks(board[H1], weights) == 2.0 + 2 * weights.foreign_request_blocks
    board.add_inflight(H1, -1, -2.0)
    assert board[H1].engine_requests == 2
    assert pending_blocks(board[H1], weights) == 2 * weights.foreign_request_blocks

    board.set_engine(H2, True, 0)
    board.add_inflight(H2, 2, 4.0)  # begun after the poll: the engine has them, ours
    assert (board[H2].engine_requests, pending_blocks(board[H2], weights)) == (2, 4.0)
    board.set_engine(H2, True, 1)  # the poll saw one of them: the other began after it
    board.add_inflight(H2, -2, -4.0)
    board.add_inflight(H2, -1, -2.0)  # a late removal: nothing below zero
    assert board[H2] == HolderLoad(engine_requests=0)


def test_a_router_polled_while_its_request_ran_sees_the_rank_idle_once_it_ends() -> None:
    """Through the router: an engine's ``/load`` taken while the router's request ran
    there, then that request's end: the rank's score has nothing pending."""
    router = Router(block_size=4)
    router.add_holder(H0, block_size=4)
    ticket = router.begin(router.route([1, 2, 3, 4]))
    router.update_load("http://a", {"ranks": [{"dp_rank": 0, "running": 1, "waiting": 0}]})
    router.finish(ticket)
    assert router.loads[H0].engine_requests == 0
    assert router.route([5, 6, 7, 8]).scores[0].pending_blocks == 0.0


def test_a_request_ending_while_a_poll_waits_is_taken_out_of_the_engines_count() -> None:
    """The engine may count a request that ends while its poll is on the way back: a
    poll that says which requests had ended when it asked (``ended_before``) takes those
    that ended since out of the count, the engine's own requests stay, and the count
    never goes below zero; without it the ended request lingers as a foreign one."""
    router = Router(block_size=4)
    for rank in (0, 1):
        router.add_holder(Holder("http://a", rank), block_size=4)
    ours = [router.begin(router.route([1, 2, 3, 4])) for _ in range(2)]
    assert {t.holder.dp_rank for t in ours} == {0, 1}
    asked = router.requests_ended("http://a")
    assert asked == {0: 0.0, 1: 0.0}
    for ticket in ours:
        router.finish(ticket)  # ended while the poll waited, counted by the engine
    answer = {
        "ranks": [
            {"dp_rank": 0, "running": 1, "waiting": 0},  # ours alone
            {"dp_rank": 1, "running": 2, "waiting": 1},  # ours and two of the engine's own
        ]
    }
    router.update_load("http://a", answer, ended_before=asked)
    assert [router.loads[Holder("http://a", r)].engine_requests for r in (0, 1)] == [0, 2]
    assert router.requests_ended("http://a") == {0: 1.0, 1: 1.0}

    router.update_load("http://a", answer)  # not told what had ended: taken as said
    assert [router.loads[Holder("http://a", r)].engine_requests for r in (0, 1)] == [1, 3]
    idle = {"ranks": [{"dp_rank": 0, "running": 0, "waiting": 0}]}
    router.update_load("http://a", idle, ended_before={0: 0.0})  # counted after it ended
    assert router.loads[Holder("http://a", 0)].engine_requests == 0
