"""Predicted entries: a request's blocks count on its holder until confirmed, expired or failed."""

from __future__ import annotations

import pytest

from kvevents import (
    AllBlocksCleared,
    BlockStored,
    Delivery,
    Holder,
    KVEventBatch,
    Loss,
    PrefixIndex,
    Reset,
    Router,
)
from kvevents.router.decide.scoring import ScoringWeights
from kvevents.router.serve.metrics import make_registry, render
from kvevents.subscribe.items import Signal
from kvevents.wire.hashing import content_keys

H0, H1, H2 = (Holder("http://e:1", r) for r in range(3))
PREFIX = list(range(100, 132))  # 16 blocks of 2


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored(tokens: list[int], *, cache_salt: str | None = None) -> KVEventBatch:
    n = len(tokens) // 2
    event = BlockStored(
        block_hashes=list(range(1, n + 1)),
        parent_block_hash=None,
        token_ids=tokens,
        block_size=2,
        lora_id=None,
        medium=None,
        cache_salt=cache_salt,
    )
    return KVEventBatch(ts=0.0, events=[event])


def make_router(clock: Clock, *, ttl: float = 2.0, **weights: float) -> Router:
    router = Router(
        block_size=2, prediction_ttl_s=ttl, clock=clock, weights=ScoringWeights(**weights)
    )
    for h in (H0, H1, H2):
        router.add_holder(h, block_size=2)
    return router


def sibling(own: int) -> list[int]:
    return [*PREFIX, own, own + 1, own + 2, own + 3]


def test_a_sibling_follows_the_first_request_within_the_prediction_lifetime() -> None:
    """A sibling routed before any event goes where the first went, its prefix reported as predicted."""
    clock = Clock()
    router = make_router(clock)
    first = router.route(sibling(1))
    router.begin(first)
    clock.now += 1.0
    second = router.route(sibling(5))
    assert second.holder == first.holder
    assert second.chosen.predicted_blocks == 16 and second.chosen.matched.blocks == 0
    assert second.predicted_tokens == 32 and second.by_prediction
    matches, predicted = router.query_predicted(sibling(9))
    assert predicted == {first.holder: 16} and matches[first.holder].blocks == 0


def test_without_predictions_siblings_spread() -> None:
    """The baseline: with predictions off, the balance term sends a sibling elsewhere."""
    router = Router(block_size=2)
    for h in (H0, H1, H2):
        router.add_holder(h, block_size=2)
    first = router.route(sibling(1))
    router.begin(first)
    assert router.route(sibling(5)).holder != first.holder


def test_load_outweighing_the_predicted_prefix_sends_the_sibling_elsewhere() -> None:
    """The cost decides: a holder whose pending work outweighs the predicted prefix loses."""
    clock = Clock()
    router = make_router(clock)
    first = router.route(sibling(1))
    router.begin(first)
    router.update_load(
        first.holder.worker,
        {"ranks": [{"dp_rank": first.dp_rank, "running": 10, "waiting": 10}]},
    )
    second = router.route(sibling(5))
    assert second.holder != first.holder
    predicted = next(s for s in second.scores if s.holder == first.holder)
    assert predicted.predicted_blocks == 16


def test_a_prediction_expires_after_its_time_to_live() -> None:
    """Past the time-to-live nothing is predicted, and the expiry is counted."""
    clock = Clock()
    router = make_router(clock, ttl=0.5)
    router.begin(router.route(sibling(1)))
    clock.now += 0.5
    assert router.query_predicted(sibling(5))[1] == {}
    stats = router.index.predictions.stats
    assert (stats.made, stats.expired, router.index.predictions.count) == (18, 18, 0)


def test_a_newer_prediction_of_the_same_blocks_extends_their_life() -> None:
    """A sibling begun later refreshes the shared blocks' deadline."""
    clock = Clock()
    router = make_router(clock, ttl=1.0)
    first = router.route(sibling(1))
    router.begin(first)
    clock.now += 0.75
    router.begin(router.route(sibling(5)))
    clock.now += 0.75
    assert router.query_predicted(sibling(9))[1] == {first.holder: 16}


def test_the_engines_event_confirms_a_prediction() -> None:
    """The holder's BlockStored turns predicted blocks into ordinary ones."""
    clock = Clock()
    router = make_router(clock)
    first = router.route(sibling(1))
    router.begin(first)
    clock.now += 0.25
    router.handle(Delivery(first.holder, 0, stored(sibling(1))))
    matches, predicted = router.query_predicted(sibling(5))
    assert predicted == {} and matches[first.holder].gpu == 16
    stats = router.index.predictions.stats
    assert (stats.confirmed, router.index.predictions.count) == (18, 0)
    assert router.index.predictions.confirm_age_max_s == 0.25
    clock.now += 10.0
    assert router.query(sibling(5))[first.holder].gpu == 16


def test_another_holders_event_does_not_confirm() -> None:
    """Only the predicted holder's own store confirms its prediction."""
    clock = Clock()
    router = make_router(clock)
    first = router.route(sibling(1))
    router.begin(first)
    other = next(h for h in (H0, H1, H2) if h != first.holder)
    router.handle(Delivery(other, 0, stored(PREFIX)))
    assert router.index.predictions.stats.confirmed == 0
    assert router.query_predicted(sibling(5))[1] == {first.holder: 16}


@pytest.mark.parametrize(
    "signal",
    [
        Reset(worker="http://e:1", dp_rank=0, reason="test", last_seq=3, new_seq=0),
        None,  # an AllBlocksCleared event
    ],
    ids=["reset", "all-blocks-cleared"],
)
def test_reset_and_flush_clear_predictions(signal: Signal | None) -> None:
    """A holder's reset or AllBlocksCleared drops its predictions, not others'."""
    clock = Clock()
    router = make_router(clock)
    router.begin(router.route(sibling(1)))
    assert router.routes[H0] == 1
    router.record(router.route([7, 7, 7, 7]))
    other = next(h for h in router.routes if h != H0)
    if signal is None:
        router.handle(Delivery(H0, 0, KVEventBatch(ts=0.0, events=[AllBlocksCleared()])))
    else:
        router.handle(signal)
    _, predicted = router.query_predicted(sibling(5))
    assert predicted == {}
    assert router.query_predicted([7, 7, 7, 7, 7])[1] == {other: 2}
    assert router.index.predictions.stats.cleared == 18


def test_a_loss_clears_confirmed_blocks_but_keeps_predictions() -> None:
    """A loss (events missed, e.g. the history a router joining a busy engine cannot
    replay) forgets what the holder had confirmed, but the requests just sent there
    still count: their siblings follow them."""
    clock = Clock()
    router = make_router(clock)
    router.handle(Delivery(H0, 0, stored(PREFIX)))
    fresh = list(range(500, 532))  # a prefix nobody holds: 16 blocks of 2
    first = router.route([*fresh, 1, 2])
    router.begin(first)
    for holder in {H0, first.holder}:
        loss = Loss(
            worker=holder.worker, dp_rank=holder.dp_rank, reason="test", first_seq=0, last_seq=3
        )
        router.handle(loss)
    assert router.query(sibling(2))[H0].blocks == 0  # confirmed blocks are gone
    assert router.query_predicted([*fresh, 3, 4])[1] == {first.holder: 16}
    second = router.route([*fresh, 3, 4])
    assert second.holder == first.holder and second.by_prediction
    assert router.index.predictions.stats.cleared == 0


def test_predictions_stay_in_their_namespace() -> None:
    """A prediction made for one adapter or cache salt never matches another's requests."""
    clock = Clock()
    router = make_router(clock)
    first = router.route(sibling(1), cache_salt="tenant-a")
    router.begin(first)
    assert router.query_predicted(sibling(5), cache_salt="tenant-a")[1] == {first.holder: 16}
    assert router.query_predicted(sibling(5), cache_salt="tenant-b")[1] == {}
    assert router.query_predicted(sibling(5))[1] == {}
    assert router.query_predicted(sibling(5), lora="adapter-1")[1] == {}
    lora = router.route(sibling(1), lora="adapter-1")
    router.record(lora)
    assert router.query_predicted(sibling(5), lora="adapter-1")[1] == {lora.holder: 16}
    assert router.query_predicted(sibling(5), lora="adapter-2")[1] == {}


def test_a_failed_request_withdraws_its_prediction() -> None:
    """finish(failed=True) drops what the request predicted; a normal finish keeps it."""
    clock = Clock()
    router = make_router(clock)
    ticket = router.begin(router.route(sibling(1)))
    router.finish(ticket, failed=True)
    assert router.query_predicted(sibling(5))[1] == {}
    assert router.index.predictions.stats.withdrawn == 18
    first = router.route(sibling(1))
    router.finish(router.begin(first))
    assert router.query_predicted(sibling(5))[1] == {first.holder: 16}


def test_a_failed_sibling_leaves_the_others_predictions() -> None:
    """A sibling that fails takes back only what it added, not the prefix others predicted."""
    clock = Clock()
    router = make_router(clock)
    first = router.route(sibling(1))
    router.begin(first)
    clock.now += 0.1
    failing = router.route(sibling(5))
    assert failing.holder == first.holder
    router.finish(router.begin(failing), failed=True)
    assert router.index.predictions.stats.withdrawn == 2  # its own two blocks
    assert router.query_predicted(sibling(9))[1] == {first.holder: 16}

    other = router.route(list(range(300, 332)))  # a new prefix, on another holder
    ticket = router.begin(other)
    clock.now += 0.1
    router.begin(router.route([*range(300, 332), 1, 2]))  # its sibling predicts it again
    router.finish(ticket, failed=True)
    assert router.query_predicted([*range(300, 332), 0])[1] == {other.holder: 16}


def test_predicted_blocks_count_at_their_credit() -> None:
    """With predicted_credit 0.5 a predicted block saves half a block of prefill."""
    clock = Clock()
    router = make_router(clock, predicted_credit=0.5)
    first = router.route(sibling(1))
    router.begin(first)
    score = next(s for s in router.route(sibling(5)).scores if s.holder == first.holder)
    assert score.cached_blocks == 8.0 and score.prefill_blocks == 10.0


def test_predictions_never_pass_the_memory_bound() -> None:
    """Confirmed plus predicted entries stay within max_entries; predictions give way first."""
    clock = Clock()
    index = PrefixIndex(block_size=2, max_entries=20, clock=clock)
    index.add_holder(H0)
    index.add_holder(H1)
    keys = content_keys(PREFIX, 2)
    index.store_keys(H0, keys[:10])
    assert len(index.predict(H1, keys)[0]) == 10  # only 10 of 16 fit
    assert len(index) + index.predictions.count == 20
    index.store_keys(H0, keys[10:])  # confirmed blocks push predictions out
    assert len(index) + index.predictions.count <= 20
    assert len(index) == 16 and index.predictions.stats.dropped >= 6


def test_confirmed_match_is_unchanged_with_predictions() -> None:
    """match_keys reports confirmed blocks only, predictions or not."""
    clock = Clock()
    index = PrefixIndex(block_size=2, clock=clock)
    index.add_holder(H0)
    keys = content_keys(PREFIX, 2)
    index.store_keys(H0, keys[:4])
    index.predict(H0, keys)
    assert index.predictions.count == 12
    result = index.match_keys(keys)
    assert result.by_holder() == {H0: (4, 0, 0)}
    assert index.predicted(keys, result) == {H0: 12}


def test_metrics_count_predictions_and_decisions() -> None:
    """The router's metrics report predictions by fate and the requests they decided."""
    clock = Clock()
    router = make_router(clock, ttl=1.0)
    first = router.route(sibling(1))
    router.begin(first)
    router.begin(router.route(sibling(5)))
    router.handle(Delivery(first.holder, 0, stored(PREFIX)))
    clock.now += 2.0
    router.index.predictions.expire()
    text = render(make_registry(router)).decode()
    assert "kvevents_router_predictions_total" in text
    assert 'kvevents_router_predicted_entries_total{fate="made"} 20.0' in text
    assert 'kvevents_router_predicted_entries_total{fate="confirmed"} 16.0' in text
    assert 'kvevents_router_predicted_entries_total{fate="expired"} 4.0' in text
    assert "kvevents_router_routes_decided_by_prediction_total 1.0" in text
    assert "kvevents_router_routes_decided_by_prediction_ratio 0.5" in text


def test_a_request_cached_whole_on_its_holder_predicts_without_a_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every block already on the chosen holder: nothing to predict, and the index is
    not asked which blocks it lacks; one block short, the missing one is predicted."""
    clock = Clock()
    router = make_router(clock)
    router.handle(Delivery(H1, 0, stored(sibling(1))))
    whole = router.route([*sibling(1), 0])
    assert whole.holder == H1 and whole.chosen.matched.blocks == whole.n_blocks == 18
    asked: list[int] = []
    predict = router.index.predict

    def counting(holder: Holder, keys: list[int]) -> tuple[list[int], float]:
        asked.append(len(keys))
        return predict(holder, keys)

    monkeypatch.setattr(router.index, "predict", counting)
    router.finish(router.begin(whole))
    assert asked == [] and router.index.predictions.count == 0
    assert router.predictions_made == 1  # still counted as a request predicted for
    longer = router.route([*sibling(1), 7, 8])
    assert longer.holder == H1 and longer.chosen.matched.blocks == 18
    router.begin(longer)
    assert asked == [19] and router.index.predictions.count == 1
