"""The two-pool choice of disaggregated serving, on an in-process Router fed by hand."""

from __future__ import annotations

import pytest

from kvevents import BlockStored, Delivery, Holder, KVEventBatch, Router, RouterNotReadyError
from kvevents.router.decide.pd import PDPools, decide_pd
from kvevents.router.decide.scoring import ScoringWeights

BS = 4
P0, P1 = Holder("http://prefill:1", 0), Holder("http://prefill:1", 1)
D0, D1 = Holder("http://decode:1", 0), Holder("http://decode:1", 1)
POOLS = PDPools(["http://prefill:1"], ["http://decode:1"])
PROMPT = list(range(1, 65))  # 16 blocks


def _router() -> Router:
    router = Router(block_size=BS, prediction_ttl_s=30.0)
    for holder in (P0, P1, D0, D1):
        router.add_holder(holder, block_size=BS)
    return router


def _store(router: Router, holder: Holder, tokens: list[int], seq: int = 0) -> None:
    n = len(tokens) // BS
    event = BlockStored(
        block_hashes=list(range(seq * 1000, seq * 1000 + n)),
        parent_block_hash=None,
        token_ids=tokens[: n * BS],
        block_size=BS,
        lora_id=None,
        medium=None,
    )
    router.handle(Delivery(holder, seq, KVEventBatch(ts=0.0, events=[event])))


def test_each_pool_chooses_among_its_own_holders() -> None:
    """The decode holder is a decode rank and the prefill holder a prefill rank, though a
    rank of the other pool caches the prompt."""
    router = _router()
    _store(router, P1, PROMPT)
    decision = decide_pd(router, POOLS, [PROMPT], max_local_prefill_tokens=0)
    assert decision.decode.holder in (D0, D1)
    assert decision.prefill is not None and decision.prefill.holder == P1
    assert decision.prefill_reason == "cache"
    assert decision.uncached_tokens == len(PROMPT)
    assert decision.decode.candidates == 2 and decision.prefill.candidates == 2


def test_the_prefill_is_skipped_when_the_decode_holds_the_prompt() -> None:
    """A decode rank holding all but N tokens of the prompt serves it alone; past N, or
    with the threshold 0, a prefill holder is chosen."""
    router = _router()
    _store(router, D1, PROMPT[:56])  # 8 tokens short
    alone = decide_pd(router, POOLS, [PROMPT], max_local_prefill_tokens=8)
    assert alone.skipped and alone.prefill is None and alone.prefill_reason is None
    assert alone.decode.holder == D1 and alone.uncached_tokens == 8
    handed = decide_pd(router, POOLS, [PROMPT], max_local_prefill_tokens=7)
    assert not handed.skipped and handed.decode.holder == D1
    never = decide_pd(router, POOLS, [PROMPT], max_local_prefill_tokens=0)
    assert not never.skipped


def test_a_decode_that_computes_the_whole_prompt_serves_alone() -> None:
    """decode_alone: no prefill holder whatever the prompt's length or the threshold, and
    every prompt token counts as computed by the decode, cached or not."""
    router = _router()
    _store(router, D1, PROMPT[:56])
    for threshold in (0, 8, 256):
        alone = decide_pd(
            router, POOLS, [PROMPT], max_local_prefill_tokens=threshold, decode_alone=True
        )
        assert alone.skipped and alone.prefill_reason is None
        assert alone.uncached_tokens == len(PROMPT)


def test_a_decode_engine_that_cannot_serve_alone_always_gets_a_prefill() -> None:
    """serves_alone(worker) False for the chosen decode's engine: a prefill holder is
    chosen though the decode holds all but a few tokens, or would compute them all."""
    router = _router()
    _store(router, D1, PROMPT[:56])
    for alone in (False, True):
        handed = decide_pd(
            router,
            POOLS,
            [PROMPT],
            max_local_prefill_tokens=256,
            decode_alone=alone,
            serves_alone=lambda worker: worker != D1.worker,
        )
        assert not handed.skipped and handed.decode.holder == D1
        assert handed.uncached_tokens == 8


def test_a_partial_last_block_counts_as_uncached() -> None:
    """Tokens past the last full block are never cached, so they count against N."""
    router = _router()
    prompt = [*PROMPT, 99, 98]
    _store(router, D0, PROMPT)
    decision = decide_pd(router, POOLS, [prompt], max_local_prefill_tokens=256)
    assert decision.skipped and decision.uncached_tokens == 2


def test_a_sibling_follows_the_prediction_to_the_same_prefill_rank() -> None:
    """A request begun on a prefill rank predicts its blocks there, so a sibling sent
    before the engine reports them goes to the same rank, chosen by prediction."""
    router = _router()
    first = decide_pd(router, POOLS, [PROMPT], max_local_prefill_tokens=0)
    assert first.prefill is not None and first.prefill_reason == "load"
    router.begin(first.decode)
    router.begin(first.prefill)  # the other prefill rank now looks less busy
    sibling = decide_pd(router, POOLS, [[*PROMPT, 7, 7, 7, 7]], max_local_prefill_tokens=0)
    assert sibling.prefill is not None
    assert sibling.prefill.holder == first.prefill.holder
    assert sibling.prefill_reason == "prediction"


def test_a_withdrawn_prediction_no_longer_draws_the_sibling() -> None:
    """A prefill leg that failed (finish failed) withdraws its predicted blocks."""
    router = _router()
    first = decide_pd(router, POOLS, [PROMPT], max_local_prefill_tokens=0)
    assert first.prefill is not None
    ticket = router.begin(first.prefill)
    assert router.query_predicted([*PROMPT, 0])[1].get(first.prefill.holder) == 16
    router.finish(ticket, failed=True)
    assert router.query_predicted([*PROMPT, 0])[1].get(first.prefill.holder, 0) == 0


def test_a_pool_without_an_available_rank_is_not_ready_only_when_needed() -> None:
    """With every prefill rank down, a request the decode serves alone still routes; one
    that needs a prefill is refused naming the pool."""
    router = _router()
    router.set_worker_available("http://prefill:1", False)
    _store(router, D0, PROMPT)
    assert decide_pd(router, POOLS, [PROMPT], max_local_prefill_tokens=16).skipped
    with pytest.raises(RouterNotReadyError, match="no prefill engine rank"):
        decide_pd(router, POOLS, [[9, 9, 9, 9, *PROMPT]], max_local_prefill_tokens=16)
    router.set_worker_available("http://decode:1", False)
    with pytest.raises(RouterNotReadyError, match="no decode engine rank"):
        decide_pd(router, POOLS, [PROMPT], max_local_prefill_tokens=16)


def test_a_batch_is_placed_whole_in_each_pool() -> None:
    """Several prompts go to one decode and one prefill holder, their tokens summed."""
    router = _router()
    other = list(range(200, 232))
    _store(router, P0, other)
    decision = decide_pd(router, POOLS, [PROMPT, other], max_local_prefill_tokens=0)
    assert decision.prompt_tokens == len(PROMPT) + len(other)
    assert decision.prefill is not None and decision.prefill.holder == P0


def test_route_keyed_among_every_candidate_is_route_batch() -> None:
    """Keying once and choosing among all candidates decides as route_batch does."""
    router = _router()
    _store(router, P1, PROMPT)
    _store(router, D0, PROMPT[:32], seq=1)
    request = router.key_request([PROMPT])
    keyed = router.route_keyed(request, request.holders)
    plain = router.route_batch([PROMPT])
    assert keyed.holder == plain.holder == P1
    assert keyed.scores == plain.scores and list(keyed.keys) == list(plain.keys)


def test_pools_refuse_an_engine_in_both_and_an_empty_pool() -> None:
    """An engine is in one pool only, and each pool has an engine."""
    with pytest.raises(ValueError, match="as --prefill and as --decode"):
        PDPools(["a"], ["a", "b"])
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        PDPools([], ["b"])
    split = POOLS.split([P0, D0, Holder("http://other:1", 0), P1])
    assert split == ([P0, P1], [D0])


def test_round_robin_turns_each_pool_through_all_its_ranks() -> None:
    """With --policy round-robin each pool keeps its own turns: over four requests both
    pools use both of their ranks (one shared turn sent each pool to every other rank)."""
    router = _router()
    chosen = [
        decide_pd(router, POOLS, [[i] * 8], max_local_prefill_tokens=0, policy="round-robin")
        for i in range(1, 5)
    ]
    assert {d.decode.holder for d in chosen} == {D0, D1}
    assert {d.prefill.holder for d in chosen if d.prefill is not None} == {P0, P1}


@pytest.mark.parametrize("counted", ["begin", "record"])
def test_recent_work_decays_once_per_request_as_in_one_pool_mode(counted: str) -> None:
    """Counting both legs of a request (begun by the relay, or recorded by /route) decays
    every holder's recent work once, so each pool's recent work is what a one-pool router
    holds after the same requests: only the decode choice advances the decay."""
    weights = ScoringWeights(balance_half_life=1.0)  # recent work halves per request
    router = Router(block_size=BS, weights=weights)
    for holder in (P0, P1, D0, D1):
        router.add_holder(holder, block_size=BS)
    one_pool = Router(block_size=BS, weights=weights)
    one_pool.add_holder(D0, block_size=BS)
    prompts = [PROMPT, [*PROMPT, *PROMPT], PROMPT[:32]]
    for prompt in prompts:
        decision = decide_pd(router, POOLS, [prompt], max_local_prefill_tokens=0)
        assert decision.decode.decays and decision.prefill is not None
        assert not decision.prefill.decays
        for leg in (decision.decode, decision.prefill):
            router.begin(leg) if counted == "begin" else router.record(leg)
        one_pool.record(one_pool.route(prompt))
    alone = one_pool.loads[D0].recent_blocks
    assert alone == 16 / 4 + 32 / 2 + 8  # each request's blocks, halved per later request
    for pool in ((P0, P1), (D0, D1)):
        assert sum(router.loads[h].recent_blocks for h in pool) == pytest.approx(alone)
