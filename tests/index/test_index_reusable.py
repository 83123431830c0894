"""A prompt's match counts only the blocks an engine reuses: a block-aligned prompt's last block is recomputed.

vLLM (``KVCacheManager.get_computed_blocks``) and SGLang hit at most ``n_tokens - 1``
tokens, in whole blocks (:mod:`kvevents.index.reusable`); for a hybrid model the sliding
window must then be held before that capped end. Also here: a sliding-window store that
names no block (what vLLM sends for a block-aligned prompt's recomputed last block).
"""

from __future__ import annotations

import msgspec
import pytest

from kvevents import BlockStored, Holder, HolderMatch, KVEventBatch, PrefixIndex, Tier
from kvevents.index.reusable import reusable_blocks

BS = 32
H = Holder("vllm", 0)
H2 = Holder("vllm", 1)
PROMPT = list(range(100, 300))  # 200 tokens: 6 full blocks and 8 tokens
ALIGNED = PROMPT[: 6 * BS]  # 192 tokens: 6 full blocks, nothing after


def store(
    kind: str,
    group: int,
    hashed: tuple[int, int],
    tokens: tuple[int, int],
    *,
    window: int | None = 64,
) -> BlockStored:
    """A vLLM store naming PROMPT's blocks ``hashed`` (first, end) with the tokens of blocks ``tokens``.

    The engine hash of block i is a stand-in, 9000 + i (the index never recomputes one);
    the parent is the block before the tokens' first.
    """
    return BlockStored(
        block_hashes=[9_000 + i for i in range(*hashed)],
        parent_block_hash=None if tokens[0] == 0 else 9_000 + tokens[0] - 1,
        token_ids=PROMPT[tokens[0] * BS : tokens[1] * BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window if kind == "sliding_window" else None,
    )


def sliding(hashed: tuple[int, int], tokens: tuple[int, int], **kw: object) -> BlockStored:
    return store("sliding_window", 0, hashed, tokens, **kw)  # type: ignore[arg-type]


def full(first: int, last: int) -> BlockStored:
    return store("full_attention", 1, (first, last), (first, last))


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events), data_parallel_rank=0)  # type: ignore[arg-type]


def gpu(index: PrefixIndex, tokens: list[int]) -> int:
    return index.holder_match(index.match(tokens), H).gpu


def test_reusable_blocks_is_every_block_before_the_last_token() -> None:
    """reusable_blocks is (n_tokens - 1) // block_size, 0 for no tokens, and refuses a bad block size."""
    assert [reusable_blocks(n, 32) for n in (0, 1, 31, 32, 33, 63, 64, 65, 192, 200)] == [
        0, 0, 0, 0, 1, 1, 1, 2, 5, 6,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="block_size=0 must be a positive int"):
        reusable_blocks(10, 0)


def test_a_block_aligned_prompts_last_block_is_not_promised() -> None:
    """With every block held, a block-aligned prompt matches all but its last block; one more token matches them all."""
    index = PrefixIndex(block_size=BS)
    index.apply(H, batch(full(0, 6)))
    assert gpu(index, ALIGNED) == 5
    assert gpu(index, [*ALIGNED, 7]) == 6
    assert gpu(index, PROMPT) == 6
    keys = index.keys_for(ALIGNED)
    assert index.holder_match(index.match_keys(keys), H).gpu == 6  # keys alone: no cap
    capped = index.match_keys(keys, reusable=5)
    assert (index.holder_match(capped, H).gpu, capped.n_blocks) == (5, 5)
    assert index.match_keys(keys, reusable=99).n_blocks == 6


def test_the_cap_applies_to_offloaded_tiers_too() -> None:
    """A holder whose blocks are on CPU only is matched through the tiered path, capped the same."""
    index = PrefixIndex(block_size=BS)
    cpu = msgspec.structs.replace(full(0, 6), medium="CPU")
    index.apply(H, batch(cpu))
    assert index.holder_match(index.match(ALIGNED), H) == HolderMatch(0, 5, 0)
    assert index.holder_match(index.match(PROMPT), H) == HolderMatch(0, 6, 0)
    assert index.holder_keys(H, Tier.CPU) == set(index.keys_for(PROMPT))


def test_a_hybrid_holder_needs_its_window_before_the_capped_end() -> None:
    """A window held over a 200-token prompt's last blocks gives nothing to its block-aligned 192-token prefix, which vLLM hits at most 5 blocks of."""
    index = PrefixIndex(block_size=BS)
    index.apply(H, batch(sliding((4, 6), (0, 6)), full(0, 6)))  # vLLM's for the 200 tokens
    assert gpu(index, PROMPT) == 6
    # 191 tokens at most: 5 blocks, whose window (blocks 3 and 4) lacks block 3
    assert gpu(index, ALIGNED) == 0
    assert index.holder_match(index.match_keys(index.keys_for(ALIGNED)), H).gpu == 6


def test_a_hybrid_holder_with_the_window_before_the_capped_end_reuses_it() -> None:
    """vLLM's store for a block-aligned 192-token prompt (window blocks 3 and 4, all tokens) gives that prompt 5 blocks, as vLLM reported."""
    index = PrefixIndex(block_size=BS)
    index.apply(H, batch(sliding((3, 5), (0, 6)), full(0, 6)))
    assert gpu(index, ALIGNED) == 5
    assert gpu(index, PROMPT) == 5  # 6 would need window blocks 4 and 5: back to 3 and 4


def test_a_sliding_window_store_naming_no_block_is_a_valid_store_of_nothing() -> None:
    """vLLM's store for a recomputed block-aligned last block (no hashes, 32 tokens, a parent) counts ok and changes nothing."""
    index = PrefixIndex(block_size=BS)
    index.apply(H, batch(sliding((3, 5), (0, 6)), full(0, 6)))
    again = sliding((5, 5), (5, 6))
    assert (again.block_hashes, len(again.token_ids), again.parent_block_hash) == ([], BS, 9_004)
    index.apply(H, batch(again, full(5, 6)))
    assert index.stats.malformed == 0 and index.stats.unknown_parent == 0
    assert index.stats.events == {"BlockStored:ok": 4}
    assert index.group_entries() == {"sliding_window:0:64": 2} and len(index) == 6
    assert gpu(index, ALIGNED) == 5


def test_a_window_store_naming_no_block_as_first_event_makes_the_holder_hybrid() -> None:
    """A router that first hears such a store learns the holder has a window group, holding nothing."""
    index = PrefixIndex(block_size=BS)
    index.apply(H2, batch(full(0, 6)))
    index.apply(H, batch(sliding((5, 5), (5, 6))))
    assert index.stats.malformed == 0 and index.group_entries() == {"sliding_window:0:64": 0}
    index = PrefixIndex.from_bytes(index.to_bytes())  # the empty group survives a snapshot
    index.apply(H, batch(full(0, 6)))
    found = index.match(PROMPT)
    assert index.holder_match(found, H).gpu == 0  # its window holds nothing
    assert index.holder_match(found, H2).gpu == 6


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(sliding((5, 5), (5, 6), window=None), id="window-without-width"),
        pytest.param(
            msgspec.structs.replace(sliding((5, 5), (5, 6)), token_ids=PROMPT[160:180]),
            id="part-block",
        ),
        pytest.param(store("full_attention", 2, (5, 5), (5, 6)), id="full-attention-side"),
    ],
)
def test_stores_naming_no_block_stay_malformed_where_vllm_never_sends_them(
    bad: BlockStored,
) -> None:
    """No hashes is valid only for a sliding window that says its width and whose tokens are whole blocks."""
    index = PrefixIndex(block_size=BS)
    index.apply(H, batch(sliding((3, 5), (0, 6)), full(0, 6)))
    index.apply(H, batch(bad))
    assert index.stats.malformed == 1


def test_predictions_do_not_count_a_recomputed_last_block() -> None:
    """Predictions read only the blocks the capped match looked at: a predicted last block of a block-aligned prompt adds nothing."""
    index = PrefixIndex(block_size=BS, prediction_ttl_s=30.0)
    keys = index.keys_for(PROMPT)
    index.store_keys(H, keys[:5])
    index.predict(H, keys)  # the 6th block, predicted
    assert index.predicted(keys, index.match_keys(keys)) == {H: 1}
    assert index.predicted(keys, index.match_keys(keys, reusable=5)) == {}
