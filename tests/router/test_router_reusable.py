"""The in-process Router matches at most the blocks an engine reuses of a request,
``(n_tokens - 1) // block_size`` (:mod:`kvevents.index.reusable`), in its Python path and
its native one alike, while a request's size and the blocks it predicts stay every full
block."""

from __future__ import annotations

from array import array

import pytest

from kvevents import Holder, Router
from kvevents.wire.hashing import content_keys_per_block

BLOCK = 4
A0, A1 = Holder("http://a", 0), Holder("http://a", 1)
PROMPT = list(range(100, 100 + 10 * BLOCK))  # 10 whole blocks, held by A1


def _router(*, native: bool, predicting: bool = False) -> Router:
    router = Router(block_size=BLOCK, prediction_ttl_s=60.0 if predicting else None)
    if not native:
        router.native._module = None
    for holder in (A0, A1):
        router.add_holder(holder)
    router.index.store_keys(A1, content_keys_per_block(PROMPT, BLOCK))
    return router


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_block_aligned_prompts_last_block_is_prefill_on_every_holder(native: bool) -> None:
    """A prompt of 10 whole blocks that A1 holds: A1 matches 9 (the last is computed
    again) and prefills 1, A0 prefills all 10, the request is 10 blocks; one token more
    and A1 matches all 10."""
    router = _router(native=native)
    for top in (None, 1):
        chosen = router.native.chosen
        decision = router.route(array("I", PROMPT), top=top)
        assert router.native.chosen == chosen + (1 if native and top == 1 else 0)
        assert (decision.holder, decision.n_blocks, len(decision.keys)) == (A1, 10, 10)
        best = decision.chosen
        assert (best.matched, best.cached_blocks, best.prefill_blocks) == ((9, 0, 0), 9.0, 1.0)
        assert decision.matched_tokens == 36
        if top is None:
            assert decision.scores[1].holder == A0 and decision.scores[1].prefill_blocks == 10.0
    longer = router.route(array("I", [*PROMPT, 7]), top=1)
    assert (longer.n_blocks, longer.chosen.matched, longer.chosen.prefill_blocks) == (
        10,
        (10, 0, 0),
        0.0,
    )
    assert longer.matched_tokens == 40


def test_a_query_counts_the_reusable_blocks_of_any_length() -> None:
    """Of the held prompt's first n tokens a query matches (n - 1) // 4 blocks: none of
    one whole block or less, one of five tokens, and nothing of no tokens."""
    router = _router(native=False)
    for n, blocks in ((0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (40, 9), (41, 10)):
        assert router.query([*PROMPT, 7][:n])[A1] == (blocks, 0, 0), n


def test_a_routed_prompt_predicts_every_full_block_on_its_holder() -> None:
    """A recorded block-aligned prompt predicts all its 10 blocks on the chosen holder
    (the engine stores them all): a request one token longer counts 10 predicted, the
    same prompt again 9."""
    router = _router(native=False, predicting=True)
    fresh = list(range(900, 900 + 10 * BLOCK))
    decision = router.route(fresh)
    router.record(decision)
    assert router.query_predicted([*fresh, 7])[1] == {decision.holder: 10}
    assert router.query_predicted(fresh)[1] == {decision.holder: 9}


def test_a_batch_matches_each_prompt_to_its_own_reusable_blocks() -> None:
    """A batch of the held prompt and the same prompt one token longer: A1 matches 9 + 10
    blocks of the 20 the batch has, and prefills 1."""
    router = _router(native=False)
    decision = router.route_batch([PROMPT, [*PROMPT, 7]])
    assert (decision.holder, decision.n_blocks) == (A1, 20)
    assert decision.chosen.matched == (19, 0, 0) and decision.chosen.prefill_blocks == 1.0
