"""Router scoring: the documented cost, tier credits, recent-work balance, tie-breaks and availability."""

from __future__ import annotations

import math

import pytest

from kvevents import Holder, HolderLoad, HolderMatch, ScoringWeights, TierCredits
from kvevents.router.decide.scoring import choose, pending_blocks, score

H0, H1, H2 = Holder("e", 0), Holder("e", 1), Holder("e", 2)


def test_cost_is_uncached_prefill_plus_weighted_pending() -> None:
    """cost = n - credit-weighted cached blocks + load_weight * pending blocks."""
    scores = score(
        10,
        [H0, H1],
        {H0: HolderMatch(4, 2, 2)},
        {H1: HolderLoad(inflight_requests=1, inflight_blocks=3.0)},
        weights=ScoringWeights(load_weight=2.0),
    )
    by = {s.holder: s for s in scores}
    assert by[H0].cached_blocks == pytest.approx(4 + 2 * 0.75 + 2 * 0.25)
    assert by[H0].cost == pytest.approx(10 - 6.0)
    assert by[H1].pending_blocks == 3.0 and by[H1].cost == pytest.approx(10 + 2 * 3.0)
    assert choose(scores).holder == H0


def test_credits_change_what_a_cached_tier_is_worth() -> None:
    """A holder with the prefix on CPU beats an empty one, and loses to GPU when credits say so."""
    matches = {H0: HolderMatch(0, 8, 0), H1: HolderMatch(6, 0, 0)}
    default = score(8, [H0, H1], matches, {})
    assert choose(default).holder == H0  # 8 * 0.75 = 6.0 ties 6 on GPU; tie -> earlier holder
    stingy = score(8, [H0, H1], matches, {}, credits=TierCredits(cpu=0.5))
    assert choose(stingy).holder == H1


def test_engine_requests_not_sent_by_the_router_count_as_foreign_work() -> None:
    """Engine-reported requests beyond the router's own in-flight ones add foreign_request_blocks each."""
    weights = ScoringWeights(foreign_request_blocks=5.0)
    load = HolderLoad(engine_requests=4, inflight_requests=1, inflight_blocks=2.0)
    assert pending_blocks(load, weights) == 2.0 + 3 * 5.0
    assert pending_blocks(HolderLoad(engine_requests=1, inflight_requests=3), weights) == 0.0


@pytest.mark.parametrize("foreign", [0.0, 5.0, math.inf])
def test_pending_blocks_is_the_pending_work_score_ranks_by(foreign: float) -> None:
    """pending_blocks() is the figure score() reports for any mix of the engine's and the
    router's requests, an infinite weight per foreign request included: with no foreign
    request that weight adds nothing (not NaN)."""
    weights = ScoringWeights(foreign_request_blocks=foreign)
    for engine in range(4):
        for inflight in range(3):
            load = HolderLoad(
                engine_requests=engine, inflight_requests=inflight, inflight_blocks=2.5
            )
            scored = score(4, [H0], {}, {H0: load}, weights=weights)[0]
            assert pending_blocks(load, weights) == scored.pending_blocks


def test_load_outweighs_a_small_cache_advantage() -> None:
    """A busy holder with a short cached prefix loses to an idle one."""
    scores = score(
        10,
        [H0, H1],
        {H0: HolderMatch(2, 0, 0)},
        {H0: HolderLoad(inflight_requests=2, inflight_blocks=40.0)},
    )
    assert choose(scores).holder == H1


def test_ties_go_to_lower_pending_then_less_recent_work_then_fewer_routed_then_order() -> None:
    """Equal cost: lower pending wins; then less recent work (not fewer requests); then fewer routed; then order."""
    no_balance = ScoringWeights(balance_weight=0.0)
    loads = {
        H0: HolderLoad(routed=1, recent_blocks=10.0),
        H1: HolderLoad(routed=5, recent_blocks=2.0),
        H2: HolderLoad(routed=3, recent_blocks=2.0),
    }
    assert [s.holder for s in score(4, [H0, H1, H2], {}, loads, weights=no_balance)] == [H2, H1, H0]
    even = score(4, [H0, H1, H2], {}, {H0: HolderLoad(routed=3), H1: HolderLoad(routed=1)})
    assert [s.holder for s in even] == [H2, H1, H0]
    # Same cost, different load: H0 caches 1 block but has 1 pending block.
    mixed = score(
        4,
        [H0, H1],
        {H0: HolderMatch(1, 0, 0)},
        {H0: HolderLoad(inflight_blocks=1.0)},
        weights=ScoringWeights(load_weight=1.0),
    )
    assert mixed[0].cost == mixed[1].cost and choose(mixed).holder == H1


def test_recent_work_above_the_least_loaded_available_holder_is_weighted() -> None:
    """The balance term is balance_weight times recent work above the least recent work of an available holder."""
    loads = {
        H0: HolderLoad(recent_blocks=300.0),
        H1: HolderLoad(recent_blocks=100.0),
        H2: HolderLoad(recent_blocks=200.0, available=False),
    }
    by = {s.holder: s for s in score(10, [H0, H1, H2], {}, loads)}  # default weight 0.05
    assert by[H0].balance_blocks == 200.0 and by[H0].cost == pytest.approx(10 + 0.05 * 200)
    assert by[H1].balance_blocks == 0.0 and by[H1].cost == 10.0
    assert by[H2].balance_blocks == 100.0  # unavailable: not the reference, and never chosen
    # A cached prefix is worth more than a modest excess of recent work, not a large one.
    prefix = {H0: HolderMatch(8, 0, 0)}
    loads[H0].recent_blocks = 140.0
    assert choose(score(10, [H0, H1], prefix, loads)).holder == H0  # 2 + 0.05 * 40 < 10
    loads[H0].recent_blocks = 400.0
    assert choose(score(10, [H0, H1], prefix, loads)).holder == H1  # 2 + 0.05 * 300 > 10


def test_unavailable_holders_are_never_chosen() -> None:
    """A rank the engine reports unavailable ranks last; with none available, choose() says so."""
    scores = score(4, [H0, H1], {H0: HolderMatch(4, 0, 0)}, {H0: HolderLoad(available=False)})
    assert choose(scores).holder == H1
    down = score(4, [H0], {}, {H0: HolderLoad(available=False)})
    with pytest.raises(ValueError, match="no available holder"):
        choose(down)


def test_weights_are_validated() -> None:
    """Negative weights and a half-life that is not a positive finite number are refused with the field named."""
    with pytest.raises(ValueError, match="load_weight=-1"):
        ScoringWeights(load_weight=-1)
    with pytest.raises(ValueError, match=r"balance_weight=-0\.5"):
        ScoringWeights(balance_weight=-0.5)
    for bad in (0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="balance_half_life"):
            ScoringWeights(balance_half_life=bad)
