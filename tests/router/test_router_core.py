"""The in-process Router: subscriber items, loads, in-flight work, and its metrics."""

from __future__ import annotations

import msgspec
import pytest

from kvevents import BlockStored, Delivery, Gap, Holder, KVEventBatch, Loss, Reset, Router
from kvevents.router.decide.models import models_from_names
from kvevents.router.serve.metrics import make_registry, render
from kvevents.subscribe.items import Removed
from kvevents.subscribe.stats import StreamStats

H0, H1 = Holder("http://e:1", 0), Holder("http://e:1", 1)


def stored(hashes: list[int], tokens: list[int], parent: int | None = None) -> KVEventBatch:
    event = BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=2,
        lora_id=None,
        medium=None,
    )
    return KVEventBatch(ts=0.0, events=[event])


def make_router() -> Router:
    router = Router(block_size=2)
    router.add_holder(H0, block_size=2)
    router.add_holder(H1, block_size=2)
    return router


def test_deliveries_feed_the_index_and_route_to_the_cached_rank() -> None:
    """Batches delivered for a holder make it the choice for requests sharing its prefix."""
    router = make_router()
    router.handle(Delivery(H1, 0, stored([1, 2, 3], [5, 6, 7, 8, 9, 10])))
    assert router.query([5, 6, 7, 8, 1, 1])[H1].gpu == 2
    decision = router.route([5, 6, 7, 8, 9, 10, 11, 12])
    assert decision.holder == H1 and decision.chosen.prefill_blocks == 1.0
    assert [s.holder for s in decision.scores] == [H1, H0]


@pytest.mark.parametrize("signal_cls", [Reset, Loss])
def test_reset_and_loss_clear_only_that_holder(signal_cls: type) -> None:
    """A reset or a loss drops the holder's blocks; other holders and gaps change nothing."""
    router = make_router()
    router.handle(Delivery(H0, 0, stored([1], [5, 6])))
    router.handle(Delivery(H1, 0, stored([1], [5, 6])))
    router.handle(Gap(worker=H0.worker, dp_rank=0, first_seq=1, last_seq=2))
    assert router.query([5, 6, 0])[H0].gpu == 1
    extra = {"reason": "test", "last_seq": 3}
    extra |= {"new_seq": 0} if signal_cls is Reset else {"first_seq": 1}
    router.handle(signal_cls(worker=H0.worker, dp_rank=0, **extra))
    assert router.query([5, 6, 0]) == {H0: (0, 0, 0), H1: (1, 0, 0)}
    assert router.signals[(signal_cls.kind, H0)] == 1


def test_a_batch_that_fails_to_apply_clears_its_holder_and_the_next_ones_apply(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug while applying one batch must not stop the router's consumer: the failure
    is counted and logged, the half-applied holder is cleared, later batches apply."""
    router = make_router()
    router.handle(Delivery(H0, 0, stored([1], [5, 6])))
    apply_steps = router.index.apply_steps

    def broken(*args: object, **kwargs: object) -> object:
        yield from apply_steps(*args, **kwargs)  # type: ignore[arg-type]
        raise RuntimeError("a bug")

    monkeypatch.setattr(router.index, "apply_steps", broken)
    router.handle(Delivery(H0, 1, stored([2], [7, 8], parent=1)))
    assert router.apply_failures == 1 and "batch seq 1 of http://e:1 rank 0" in caplog.text
    assert router.query([5, 6, 7, 8, 0])[H0].gpu == 0
    monkeypatch.setattr(router.index, "apply_steps", apply_steps)
    router.handle(Delivery(H0, 2, stored([3], [9, 10])))
    assert router.query([9, 10, 0])[H0].gpu == 1 and router.batches_applied == 3


def test_load_and_inflight_requests_steer_away() -> None:
    """Engine /load figures and the router's own in-flight requests count as pending work."""
    router = make_router()
    router.update_load(
        H0.worker,
        {"dp_size": 2, "ranks": [{"dp_rank": 0, "running": 3, "waiting": 1}, {"dp_rank": 1}]},
    )
    assert router.loads[H0].engine_requests == 4
    assert router.route([1, 2, 3, 4]).holder == H1
    router.update_load(H0.worker, {"ranks": [{"dp_rank": 0, "running": 0, "waiting": 0}]})
    first = router.route([1, 2, 3, 4])
    ticket = router.begin(first)
    assert router.loads[first.holder].inflight_blocks == 2.0
    second = router.route([1, 2, 3, 4])
    assert second.holder != first.holder
    router.finish(ticket)
    assert router.loads[first.holder].inflight_requests == 0


def test_unavailable_rank_and_bad_load_body() -> None:
    """A rank reported unavailable is not chosen; a /load body without ranks is a clear error."""
    router = make_router()
    router.handle(Delivery(H0, 0, stored([1], [5, 6])))
    router.update_load(H0.worker, {"ranks": [{"dp_rank": 0, "available": False}]})
    assert router.route([5, 6]).holder == H1
    with pytest.raises(ValueError, match="no 'ranks' list"):
        router.update_load(H0.worker, {"dp_size": 2})


def test_two_routers_have_separate_metric_registries() -> None:
    """Each router's registry reports only its own events, lookups and routes."""
    a, b = make_router(), make_router()
    a.handle(Delivery(H0, 0, stored([1], [5, 6])))
    a.begin(a.route([5, 6]))
    text_a = render(make_registry(a)).decode()
    text_b = render(make_registry(b)).decode()
    assert 'kvevents_router_events_total{outcome="ok",type="BlockStored"} 1.0' in text_a
    assert "kvevents_router_events_total{" not in text_b
    assert "kvevents_router_lookups_total 1.0" in text_a
    assert 'kvevents_router_routes_total{dp_rank="0",worker="http://e:1"} 1.0' in text_a
    assert "kvevents_router_index_entries 0.0" in text_b


def test_every_stream_counter_is_a_metric_per_stream() -> None:
    """Each stream's counters, the snapshots that filled gaps and those that failed
    included, are ``kvevents_router_stream_*_total{worker,dp_rank}`` with its values."""
    stats = msgspec.structs.replace(
        StreamStats.empty("http://e:1", 2, "tcp://e:5557", "tcp://e:5558"),
        gaps=4,
        replayed=3,
        lost=1,
        snapshots=2,
        snapshot_failures=1,
        unknown_events=5,
    )
    text = render(make_registry(make_router(), lambda: {Holder("http://e:1", 2): stats})).decode()
    labels = '{dp_rank="2",worker="http://e:1"}'
    for name, value in (
        ("gaps", 4),
        ("replayed", 3),
        ("lost", 1),
        ("snapshots", 2),
        ("snapshot_failures", 1),
        ("unknown_events", 5),
        ("malformed", 0),
    ):
        assert f"kvevents_router_stream_{name}_total{labels} {value:.1f}" in text, name


def _serve(router: Router, tokens: list[int], seqs: dict[Holder, int]) -> Holder:
    """Route one request, store its blocks on the chosen holder (as its engine would), finish it."""
    decision = router.route(tokens)
    ticket = router.begin(decision)
    holder = decision.holder
    router.handle(Delivery(holder, seqs[holder], stored_chain(tokens)))
    seqs[holder] += 1
    router.finish(ticket)
    return holder


def stored_chain(tokens: list[int]) -> KVEventBatch:
    """The BlockStored of a whole request's full blocks of 2 tokens, engine hashes made up."""
    n = len(tokens) // 2
    return stored([hash(tuple(tokens[: 2 * (i + 1)])) for i in range(n)], tokens[: 2 * n])


def test_sequential_requests_sharing_one_block_spread_across_ranks() -> None:
    """One request at a time, all sharing their first block: new conversations spread over every rank instead of all going to the holder of the shared block."""
    holders = [Holder("http://e:1", r) for r in range(4)]
    router = Router(block_size=2)
    for h in holders:
        router.add_holder(h, block_size=2)
    seqs = dict.fromkeys(holders, 0)
    shared = [7, 7]
    chosen = [_serve(router, shared + [100 + i] * 80, seqs) for i in range(8)]
    assert all(router.query([*shared, 0])[h].gpu == 1 for h in holders)
    assert sorted(chosen.count(h) for h in holders) == [2, 2, 2, 2]


def test_a_follow_up_stays_with_the_rank_holding_its_conversation() -> None:
    """Turns of a conversation, one at a time, keep going to the rank that holds the conversation so far, despite the recent work it got."""
    holders = [Holder("http://e:1", r) for r in range(2)]
    router = Router(block_size=2)
    for h in holders:
        router.add_holder(h, block_size=2)
    seqs = dict.fromkeys(holders, 0)
    conversation = [7, 7] + [1] * 40
    home = _serve(router, conversation, seqs)
    for turn in range(2, 6):
        conversation += [turn] * 20
        assert _serve(router, conversation, seqs) == home
    assert router.loads[home].recent_blocks > 50


def test_before_any_block_size_is_known_requests_are_spread_by_load() -> None:
    """Engines registered, no block stored anywhere yet (a vLLM found by its URL alone
    advertises no block size): requests are routed by load, not refused; with no engine
    registered at all, routing is still refused."""
    empty = Router()
    with pytest.raises(ValueError, match="no engine rank is known yet"):
        empty.route([1, 2, 3, 4])
    router = Router()
    router.add_holder(H0)
    router.add_holder(H1)
    chosen = []
    for _ in range(4):
        decision = router.route([1, 2, 3, 4])
        assert (decision.n_blocks, decision.block_size) == (0, 0)
        router.begin(decision)
        chosen.append(decision.dp_rank)
    assert sorted(chosen) == [0, 0, 1, 1]  # ties go to the rank sent fewer requests
    router.handle(Delivery(H1, 0, stored([10, 11], [1, 2, 3, 4])))  # now a size is known
    assert router.index.block_size == 2
    assert router.route([1, 2, 3, 4, 5, 6]).dp_rank == 1


def test_holder_summary_gives_each_holder_its_own_signals() -> None:
    """/workers' per-holder signal counts: each holder's kinds and counts, none of
    another holder's, none of the signals that name no holder."""
    router = Router(block_size=4)
    for h in (H0, H1):
        router.add_holder(h, block_size=4)
    router.handle(Gap(worker=H0.worker, dp_rank=0, first_seq=1, last_seq=2))
    router.handle(Gap(worker=H0.worker, dp_rank=0, first_seq=5, last_seq=5))
    router.handle(Reset(worker=H0.worker, dp_rank=0, last_seq=9, new_seq=0, reason="t"))
    router.signals[("unreachable", None)] += 1  # a signal of no one holder
    summary = {(s["worker"], s["dp_rank"]): s["signals"] for s in router.holder_summary()}
    assert summary == {tuple(H0): {"gap": 2, "reset": 1}, tuple(H1): {}}


def test_a_removed_holder_that_comes_back_is_a_candidate_for_its_model_again() -> None:
    """A rank Removed (its engine restarted with fewer) drops out of the model's
    candidates; back (its first batch, or registered again) it is one again (the cached
    candidates kept it out until the models changed)."""
    router = make_router()
    router.models.set(H1.worker, models_from_names(["m"]))
    assert router.candidates("m")[0] == [H0, H1]
    router.handle(Removed(worker=H1.worker, dp_rank=1, reason="the engine has fewer ranks"))
    assert router.candidates("m")[0] == [H0] and router.holders() == [H0]
    router.handle(Delivery(H1, 0, stored([7], [5, 6])))  # rank 1 is back
    assert router.candidates("m")[0] == [H0, H1]
    assert router.route([5, 6, 1, 2], model="m", top=1).holder == H1
    router.handle(Removed(worker=H1.worker, dp_rank=1, reason="again"))
    assert router.candidates("m")[0] == [H0]
    router.add_holder(H1, block_size=2)
    assert router.candidates("m")[0] == [H0, H1]
