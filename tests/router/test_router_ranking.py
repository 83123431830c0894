"""Ranking: the best few of score()'s list, exactly, without scoring every holder.

:class:`~kvevents.router.decide.scoring.Ranking` ranks the holders once by the part of their
cost that does not depend on the request, then answers each request from the holders
it matched and the first few of the rest. Whatever the loads, matches, predictions,
ties and unavailable holders, its answer must be ``score(...)[:top]``, field for field;
and the router that keeps one must see every change of the loads made through it.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents import Holder, HolderLoad, HolderMatch, ScoringWeights, TierCredits, kernels
from kvevents.router.decide import load_board
from kvevents.router.decide.load_board import LoadBoard, board_top_scores
from kvevents.router.decide.router import Router
from kvevents.router.decide.scoring import Ranking, score

# small values on purpose: equal costs, and so every tie-break, come up often
_blocks = st.integers(min_value=0, max_value=6)
_loads = st.builds(
    HolderLoad,
    engine_requests=st.integers(0, 3),
    inflight_requests=st.integers(0, 3),
    inflight_blocks=st.sampled_from([0.0, 0.5, 1.0, 2.0, 8.0]),
    routed=st.integers(0, 2),
    available=st.booleans(),
    recent_blocks=st.sampled_from([0.0, 1.0, 3.0, 3.5, 64.0]),
)
_weights = st.sampled_from(
    [
        ScoringWeights(),
        ScoringWeights(load_weight=1.0, balance_weight=0.0),
        ScoringWeights(load_weight=0.0, balance_weight=0.0),
        ScoringWeights(load_weight=0.3, balance_weight=0.7, predicted_credit=0.5),
    ]
)


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    count = draw(st.integers(min_value=1, max_value=12))
    holders = [Holder(f"http://e{i % 3}", i) for i in range(count)]
    loads = {h: draw(_loads) for h in holders if draw(st.booleans())}  # some missing: idle
    matched = draw(st.lists(st.sampled_from(holders), unique=True, max_size=count))
    matches = {h: HolderMatch(draw(_blocks), draw(_blocks), draw(_blocks)) for h in matched}
    if draw(st.booleans()):
        matches[Holder("http://not-a-candidate", 0)] = HolderMatch(5, 0, 0)
    guessed = draw(st.lists(st.sampled_from(holders), unique=True, max_size=3))
    predicted = {h: draw(st.integers(1, 4)) for h in guessed}
    credits = draw(st.sampled_from([TierCredits(), TierCredits(cpu=0.5, disk=0.0)]))
    n_blocks = draw(st.integers(min_value=0, max_value=12))
    top = draw(st.integers(min_value=1, max_value=count + 2))
    return holders, loads, matches, predicted, credits, draw(_weights), n_blocks, top


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(cases())
def test_top_is_exactly_the_head_of_score(case: tuple) -> None:
    holders, loads, matches, predicted, credits, weights, n_blocks, top = case
    full = score(
        n_blocks, holders, matches, loads, credits=credits, weights=weights, predicted=predicted
    )
    ranking = Ranking(holders, loads, weights)
    got = ranking.top(n_blocks, matches, top, credits=credits, predicted=predicted)
    assert got == full[:top]
    # the same Ranking answers every request: another one, and one without predictions
    plain = score(n_blocks + 1, holders, matches, loads, credits=credits, weights=weights)
    assert ranking.top(n_blocks + 1, matches, top, credits=credits) == plain[:top]
    # what it keeps of the holders that cache nothing serves other requests alike: the
    # same request again, one that matches nothing, and one matching one holder fewer
    assert ranking.top(n_blocks, matches, top, credits=credits, predicted=predicted) == got
    bare = score(n_blocks, holders, {}, loads, credits=credits, weights=weights)
    assert ranking.top(n_blocks, {}, top, credits=credits) == bare[:top]
    fewer = dict(list(matches.items())[1:])
    less = score(n_blocks, holders, fewer, loads, credits=credits, weights=weights)
    assert ranking.top(n_blocks, fewer, top, credits=credits) == less[:top]
    # what is kept for one count never answers another: a new size, 1 first, then more
    wider = score(n_blocks + 2, holders, matches, loads, credits=credits, weights=weights)
    for count in (1, top + 1, top):
        assert ranking.top(n_blocks + 2, matches, count, credits=credits) == wider[:count]


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(cases(), st.lists(st.integers(0, 11), max_size=6))
def test_one_pass_scores_are_exactly_the_head_of_score(case: tuple, routed: list[int]) -> None:
    """The best few over the router's load table (what a relayed request, or a /route
    right after the loads changed, is routed by) are score()'s head, field for field,
    from the Python scan and the compiled one alike; also once requests routed have
    decayed the table's recent work by its scale (``routed``: their holders)."""
    holders, loads, matches, predicted, credits, weights, n_blocks, top = case
    assert kernels.load() is not None, kernels.status()
    board = LoadBoard.of(loads)
    for i in routed:
        board.note_routed(holders[i % len(holders)], 1.0 + i, weights.decay, count=True)
    if not routed:  # the board shows the loads it was given
        assert {h: board[h] for h in loads} == loads
    compiled_from = load_board._COMPILED_FROM
    try:
        for load_board._COMPILED_FROM in (1 << 30, 0):  # one Python pass, the kernel
            for guessed in (predicted, None):
                full = score(
                    n_blocks,
                    holders,
                    matches,
                    board.snapshot(),
                    credits=credits,
                    weights=weights,
                    predicted=guessed,
                )
                for count in (top, 2, 1):
                    few = board_top_scores(
                        board,
                        holders,
                        n_blocks,
                        matches,
                        count,
                        credits=credits,
                        weights=weights,
                        predicted=guessed,
                    )
                    assert few == full[:count]
    finally:
        load_board._COMPILED_FROM = compiled_from


def test_costs_that_round_to_a_tie_rank_by_the_next_field() -> None:
    """B's own part is below A's, but both vanish next to 8 blocks of prefill: the costs
    tie, and A's lower pending wins, as score() ranks them. Taking only the first of the
    holders in B-before-A order would answer B."""
    a, b, c = Holder("e", 0), Holder("e", 1), Holder("e", 2)
    loads = {
        a: HolderLoad(recent_blocks=2e-16),  # balance 2e-16, pending 0
        b: HolderLoad(inflight_blocks=1e-16),  # pending 1e-16, balance 0
        c: HolderLoad(inflight_blocks=5.0),
    }
    weights = ScoringWeights(load_weight=1.0, balance_weight=1.0)
    full = score(8, [a, b, c], {}, loads, weights=weights)
    assert [s.holder for s in full] == [a, b, c] and full[0].cost == full[1].cost
    assert Ranking([a, b, c], loads, weights).top(8, {}, 1) == full[:1]


def test_credits_of_minus_zero_count_as_zero() -> None:
    """A credit of -0.0 is within 0..1; it is kept as 0.0, so no answer says that a
    holder caching nothing has -0.0 blocks cached, ranked or scored in full."""
    credits = TierCredits(gpu=-0.0, cpu=-0.0, disk=-0.0)
    assert [math.copysign(1.0, c) for c in credits.as_tuple()] == [1.0] * 3
    a, b = Holder("e", 0), Holder("e", 1)
    loads = {a: HolderLoad(inflight_blocks=1.0)}
    ranking = Ranking([a, b], loads)
    for scores in (
        ranking.top(8, {}, 2, credits=credits),
        score(8, [a, b], {}, loads, credits=credits),
    ):
        assert [math.copysign(1.0, s.cached_blocks) for s in scores] == [1.0, 1.0]
    assert ranking.top(8, {}, 2, credits=TierCredits(gpu=0.0, cpu=0.0, disk=0.0)) == scores


def test_a_fleet_of_ranks_that_cache_nothing_ranks_by_load_and_work() -> None:
    """64 holders, one matched: the answer is the matched one, then the least loaded."""
    holders = [Holder(f"http://e{i // 4}", i % 4) for i in range(64)]
    loads = {h: HolderLoad(inflight_blocks=float(64 - i)) for i, h in enumerate(holders)}
    loads[holders[5]].available = False
    matches = {holders[10]: HolderMatch(100, 0, 0)}
    got = Ranking(holders, loads).top(128, matches, 3)
    assert [s.holder for s in got] == [holders[10], holders[63], holders[62]]
    assert got[1].matched == HolderMatch(0, 0, 0) and got[1].prefill_blocks == 128.0


def _router(ranks: int) -> Router:
    router = Router(block_size=4)
    for rank in range(ranks):
        router.add_holder(Holder("http://e", rank))
    return router


def _same_choice(router: Router, tokens: list[int]) -> None:
    """route() with top answers the head of route() without it: with ``top=1`` first,
    the loads having just changed (one pass, no ranking), then from the new ranking."""
    assert router._kept_ranking(router.holders()) is None, "called after a change of the loads"
    one = router.route(tokens, top=1)
    assert router._kept_ranking(router.holders()) is None, "top=1 built no ranking for itself"
    every = router.route(tokens)
    assert one.scores == every.scores[:1] and one.by_prediction == every.by_prediction
    assert (one.worker, one.dp_rank, one.candidates) == (every.worker, every.dp_rank, 4)
    few = router.route(tokens, top=2)
    assert router.route(tokens, top=1).scores == one.scores, "now from the ranking"
    assert router._kept_ranking(router.holders()) is not None
    assert few.scores == every.scores[:2]
    assert (few.worker, few.dp_rank, few.candidates) == (every.worker, every.dp_rank, 4)
    assert few.n_blocks == every.n_blocks and list(few.keys) == list(every.keys)


def test_the_router_sees_every_change_of_the_loads_it_makes() -> None:
    """Each way the loads change moves the answer, and route(top=) follows at once."""
    router = _router(4)
    tokens = list(range(16))
    router.index.store_keys(Holder("http://e", 2), list(router._keys(tokens, None, None)))
    _same_choice(router, tokens)
    assert router.route(tokens, top=1).dp_rank == 2
    router.update_load("http://e", {"ranks": [{"dp_rank": 2, "available": False}]})
    _same_choice(router, tokens)
    assert router.route(tokens, top=1).dp_rank != 2
    router.update_load("http://e", {"ranks": [{"dp_rank": 2, "running": 0, "waiting": 0}]})
    assert router.route(tokens, top=1).dp_rank == 2
    ticket = router.begin(router.route(tokens, top=1))
    _same_choice(router, tokens)
    for _ in range(6):
        router.route(tokens, top=3)  # a /route, from the ranking kept
        # a relayed request, from that ranking; its begin and finish change the loads
        router.finish(router.begin(router.route(tokens, top=1)))
        # a /route right after: one pass, no ranking built for it
        three = router.route(tokens, top=3)
        assert router._kept_ranking(router.holders()) is None
        assert three.scores == router.route(tokens).scores[:3]
        router.finish(router.begin(router.route(tokens, top=1)))  # ranks, then changes
        _same_choice(router, [t + 1 for t in tokens])
    router.remote_inflight(Holder("http://e", 0), 5, 40.0)
    _same_choice(router, tokens)
    # /route with "top": 1 and loads that hold still: the second request ranks, and
    # the ones after it answer from that ranking
    router.remote_inflight(Holder("http://e", 3), 1, 4.0)
    first = router.route(tokens, top=1)
    assert router._kept_ranking(router.holders()) is None
    assert router.route(tokens, top=1) == first
    kept = router._kept_ranking(router.holders())
    assert kept is not None and router.route(tokens, top=1) == first
    assert router._kept_ranking(router.holders()) is kept
    router.remote_routed(Holder("http://e", 1), 200)
    _same_choice(router, tokens)
    router.record(router.route(tokens, top=1))
    router.finish(ticket)
    _same_choice(router, tokens)
    router.set_worker_available("http://e", False)
    with pytest.raises(Exception, match="no available holder"):
        router.route(tokens, top=1)
    router.set_worker_available("http://e", True)
    router.add_holder(Holder("http://f", 0))
    assert router.route(tokens, top=9).candidates == 5
    assert len(router.route(tokens, top=9).scores) == 5


def test_predictions_decide_the_same_with_and_without_top() -> None:
    """A prediction that changes the choice is reported as such on both paths."""
    router = Router(block_size=4, prediction_ttl_s=30.0)
    for rank in range(3):
        router.add_holder(Holder("http://e", rank))
    tokens = list(range(40))
    keys = list(router._keys(tokens, None, None))
    router.index.store_keys(Holder("http://e", 0), keys[:3])
    router.remote_inflight(Holder("http://e", 0), 1, 30.0)  # busy: confirmed blocks lose
    first = router.route(tokens, top=1)
    router.begin(first)  # predicts all 10 blocks on its holder
    again, every = router.route(tokens, top=1), router.route(tokens)
    assert again.scores == every.scores[:1]
    assert again.by_prediction == every.by_prediction
    assert again.scores[0].predicted_blocks > 0
