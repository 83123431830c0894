"""Hybrid-attention holders: per-group indexing and vLLM's reuse rule, on batches shaped like vLLM 0.32's.

The shapes are those issue 14 captured from vLLM 0.32 serving a Gemma3 model with one
sliding-window layer (window 64) and one full-attention layer, block size 32: a
200-token prompt stores, in one batch, group 0 (``sliding_window``, window 64) with the
2 hashes of blocks 4 and 5 but all 192 tokens and no parent, then group 1
(``full_attention``) with 6 hashes and the same 192 tokens; the same hashes in both
groups. A window of 64 tokens at block size 32 needs ceil(63 / 32) = 2 held blocks
before a hit's end.
"""

from __future__ import annotations

import msgspec

from kvevents import Holder, PrefixIndex
from kvevents.index.groups import reuse_length, window_blocks
from kvevents.index.snapshot import decode_snapshot
from kvevents.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 32
H = Holder("vllm", 0)
H2 = Holder("vllm", 1)


def fake_hash(tokens: list[int], upto_block: int, salt: str = "") -> int:
    """A stand-in engine hash naming the prefix up to a block (the index never recomputes it)."""
    return hash((salt, tuple(tokens[: (upto_block + 1) * BS]))) % (1 << 64)


def sw_store(
    tokens: list[int], first: int, last: int, parent: int | None, salt: str = ""
) -> BlockStored:
    """vLLM's sliding-window store: hashes of blocks first..last-1, tokens from ``first_token``."""
    start = 0 if parent is None else first * BS
    return BlockStored(
        block_hashes=[fake_hash(tokens, i, salt) for i in range(first, last)],
        parent_block_hash=parent,
        token_ids=tokens[start : last * BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        extra_keys=[None] * (last - first),
        group_idx=0,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=64,
    )


def fa_store(
    tokens: list[int], first: int, last: int, parent: int | None, salt: str = ""
) -> BlockStored:
    extra: list[object] = [None] * (last - first)
    if salt and first == 0:
        extra[0] = [salt]
    return BlockStored(
        block_hashes=[fake_hash(tokens, i, salt) for i in range(first, last)],
        parent_block_hash=parent,
        token_ids=tokens[first * BS : last * BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        extra_keys=extra,
        group_idx=1,
        kv_cache_spec_kind="full_attention",
    )


def sliding_copy_to_cpu(block: int) -> BlockStored:
    """vLLM's offloading connector's copy of a sliding-window block: group_idx alone."""
    return BlockStored(
        block_hashes=[fake_hash(PROMPT, block)],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium="CPU",
        group_idx=0,
    )


def removed(tokens: list[int], blocks: list[int], group: int) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=[fake_hash(tokens, i) for i in blocks], medium="GPU", group_idx=group
    )


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events), data_parallel_rank=0)  # type: ignore[arg-type]


PROMPT = list(range(100, 300))  # 200 tokens: 6 full blocks
LONGER = PROMPT + list(range(300, 340))  # 240 tokens: 7 full blocks


def stored_200() -> PrefixIndex:
    index = PrefixIndex(block_size=BS)
    index.apply(H, batch(sw_store(PROMPT, 4, 6, None), fa_store(PROMPT, 0, 6, None)))
    return index


def gpu(index: PrefixIndex, tokens: list[int], holder: Holder = H, **kw: object) -> int:
    return index.holder_match(index.match(tokens, **kw), holder).gpu  # type: ignore[arg-type]


def test_window_blocks_is_ceil_of_window_minus_one_over_block_size() -> None:
    assert window_blocks(64, 32) == 2
    assert window_blocks(65, 32) == 2
    assert window_blocks(66, 32) == 3
    assert window_blocks(64, 16) == 4
    assert window_blocks(1, 32) == 1


def test_first_sliding_window_store_with_two_hashes_and_192_tokens_is_understood() -> None:
    index = stored_200()
    assert index.stats.malformed == 0
    assert index.stats.unknown_parent == 0
    assert index.stats.events == {"BlockStored:ok": 2}
    assert gpu(index, PROMPT) == 6
    assert index.group_entries() == {"sliding_window:0:64": 2}
    assert len(index) == 6  # the main (full-attention) group


def test_sliding_window_keys_are_the_full_attention_keys_of_the_last_blocks() -> None:
    index = stored_200()
    keys = index.keys_for(PROMPT)
    table = index._groups[("sliding_window", 0, 64)]
    assert list(table._blocks) == [keys[4], keys[5]] or set(table._blocks) == {keys[4], keys[5]}


def test_sliding_window_store_alone_keys_its_last_blocks_from_the_tokens() -> None:
    index = PrefixIndex(block_size=BS)
    index.apply(H, batch(sw_store(PROMPT, 4, 6, None)))
    keys = index.keys_for(PROMPT)
    assert set(index._groups[("sliding_window", 0, 64)]._blocks) == {keys[4], keys[5]}
    assert index.stats.malformed == 0
    # no full-attention group (yet): a model whose every layer is a sliding window, which
    # its window alone decides (the two blocks a 64-token window needs end the prompt)
    assert gpu(index, PROMPT) == 6
    assert gpu(index, LONGER) == 6
    index.apply(H, batch(removed(PROMPT, [5], group=0)))
    assert gpu(index, PROMPT) == 0  # block 4 alone: not the two the window needs
    # once the holder has a full-attention group, the hybrid rule applies
    index.apply(H, batch(fa_store(PROMPT, 0, 3, None)))
    assert gpu(index, PROMPT) == 0


def test_extension_stores_one_block_per_group_with_parents() -> None:
    index = stored_200()
    parent = fake_hash(PROMPT, 5)
    index.apply(H, batch(sw_store(LONGER, 6, 7, parent), fa_store(LONGER, 6, 7, parent)))
    assert index.stats.unknown_parent == 0 and index.stats.malformed == 0
    assert gpu(index, LONGER) == 7
    assert index.group_entries() == {"sliding_window:0:64": 3}


def test_full_attention_copies_evicted_while_sliding_copies_remain_are_not_reusable() -> None:
    index = stored_200()
    index.apply(H, batch(removed(PROMPT, [5, 4, 3, 2, 1, 0], group=1)))
    assert gpu(index, PROMPT) == 0
    assert index.holder_match(index.match(PROMPT), H).blocks == 0
    assert index.group_entries() == {"sliding_window:0:64": 2}
    assert index.stats.unknown_hash == 0


def test_full_attention_tail_evicted_shortens_to_where_the_window_still_holds() -> None:
    index = stored_200()
    # FA loses block 5 only: the candidate is 5 blocks; the window before 5 needs
    # blocks 3 and 4, and block 3 is not in the sliding-window group: scanning back,
    # 4 is held, 3 is not, 2..0 are not -> no run of 2 -> nothing.
    index.apply(H, batch(removed(PROMPT, [5], group=1)))
    assert gpu(index, PROMPT) == 0


def test_sliding_copies_evicted_while_full_copies_remain_leave_only_a_short_prefix() -> None:
    index = stored_200()
    index.apply(H, batch(removed(PROMPT, [5, 4], group=0)))
    assert gpu(index, PROMPT) == 0
    assert len(index) == 6  # the full-attention copies are still indexed


def test_one_sliding_block_missing_breaks_the_run_and_the_scan_goes_on_back() -> None:
    index = PrefixIndex(block_size=BS)
    # sliding group holds blocks 0..5 (a store with every hash), full attention 0..5
    index.apply(H, batch(sw_store(PROMPT, 0, 6, None), fa_store(PROMPT, 0, 6, None)))
    assert gpu(index, PROMPT) == 6
    index.apply(H, batch(removed(PROMPT, [4], group=0)))
    # window before 6 needs 4 and 5: 4 missing; before 4 needs 2 and 3: held -> 4 blocks
    assert gpu(index, PROMPT) == 4
    index.apply(H, batch(removed(PROMPT, [2], group=0)))
    # before 4: 3 held, 2 missing; a run reaching block 0 counts however short: 0, 1 -> 2
    assert gpu(index, PROMPT) == 2


def test_a_short_prompt_inside_the_window_needs_every_block_from_the_start() -> None:
    index = PrefixIndex(block_size=BS)
    short = PROMPT[:40]  # one full block
    index.apply(H, batch(sw_store(short, 0, 1, None), fa_store(short, 0, 1, None)))
    assert gpu(index, short) == 1


def test_hybrid_and_full_attention_only_holders_side_by_side() -> None:
    index = stored_200()
    plain = BlockStored(
        block_hashes=[fake_hash(PROMPT, i) for i in range(6)],
        parent_block_hash=None,
        token_ids=PROMPT[: 6 * BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        extra_keys=[None] * 6,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    index.apply(H2, batch(plain))
    index.apply(H, batch(removed(PROMPT, [5, 4], group=0)))
    result = index.match(PROMPT)
    assert index.holder_match(result, H2).gpu == 6
    assert index.holder_match(result, H).gpu == 0
    assert set(result.by_holder()) == {H2}


def test_all_blocks_cleared_clears_every_group_of_the_holder() -> None:
    index = stored_200()
    index.apply(H, batch(AllBlocksCleared()))
    assert gpu(index, PROMPT) == 0
    assert index.group_entries() == {"sliding_window:0:64": 0}
    index.apply(H, batch(sw_store(PROMPT, 4, 6, None), fa_store(PROMPT, 0, 6, None)))
    assert gpu(index, PROMPT) == 6


def test_removing_a_holder_drops_its_groups_and_its_slot_is_reused_plain() -> None:
    index = stored_200()
    index.remove_holder(H)
    assert index.group_entries() == {"sliding_window:0:64": 0}
    assert index._hybrid == 0
    index.store_keys(H2, index.keys_for(PROMPT))
    assert gpu(index, PROMPT, holder=H2) == 6


def test_hash_map_keeps_a_hash_while_a_sliding_copy_still_holds_it() -> None:
    index = stored_200()
    index.apply(H, batch(removed(PROMPT, [5, 4], group=1)))
    index.apply(H, batch(removed(PROMPT, [5, 4], group=0)))
    assert index.stats.unknown_hash == 0
    assert index.group_entries() == {"sliding_window:0:64": 0}


def test_a_removal_for_a_group_the_holder_never_stored_counts_unknown_hash() -> None:
    index = stored_200()
    index.apply(H, batch(removed(PROMPT, [5], group=7)))
    assert index.stats.unknown_hash == 1
    assert gpu(index, PROMPT) == 6


def test_unsupported_group_kinds_are_counted_not_indexed() -> None:
    index = stored_200()
    mamba = BlockStored(
        block_hashes=[fake_hash(PROMPT, 5)],
        parent_block_hash=None,
        token_ids=PROMPT[: 6 * BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        group_idx=2,
        kv_cache_spec_kind="mamba",
    )
    index.apply(H, batch(mamba))
    assert index.stats.unsupported_group == 1
    assert index.stats.malformed == 0
    assert gpu(index, PROMPT) == 6


def test_sliding_store_with_fewer_tokens_than_hashes_is_malformed() -> None:
    index = PrefixIndex(block_size=BS)
    bad = sw_store(PROMPT, 4, 6, None)
    bad.token_ids = PROMPT[:BS]
    index.apply(H, batch(bad))
    assert index.stats.malformed == 1


def test_snapshot_carries_the_groups() -> None:
    index = stored_200()
    index.apply(H, batch(removed(PROMPT, [4], group=0)))
    restored = PrefixIndex.from_bytes(index.to_bytes())
    assert restored.group_entries() == index.group_entries()
    assert gpu(restored, PROMPT) == gpu(index, PROMPT) == 0
    # and the restored index goes on applying the stream
    restored.apply(H, batch(sw_store(PROMPT, 4, 5, fake_hash(PROMPT, 3))))
    assert gpu(restored, PROMPT) == 6
    assert restored.stats.malformed == 0
    # the main group's group_idx survived too: a full-attention removal reaches it
    restored.apply(H, batch(removed(PROMPT, [5], group=1)))
    assert len(restored) == 5 and restored.stats.unknown_hash == 0


def test_reuse_length_with_no_side_table_is_the_main_length() -> None:
    assert reuse_length([], [1, 2, 3], 0, 1, 3, BS) == 3


def test_more_than_64_holders_widen_the_side_tables_too() -> None:
    index = stored_200()
    for r in range(1, 70):
        index.add_holder(Holder("vllm", r))
    assert index._groups[("sliding_window", 0, 64)]._width == index._width == 128
    assert gpu(index, PROMPT) == 6
    index.apply(H, batch(removed(PROMPT, [5], group=0)))
    assert gpu(index, PROMPT) == 0


def test_side_group_events_pause_between_them_and_end_as_one_apply() -> None:
    """A batch of many hybrid prompts applied in steps: the loop also gets turns between
    the side group's events, each pause leaves whole events (a hybrid match never
    longer than the finished batch gives), and the index ends as one apply makes it."""
    prompts = [[p * 1000 + t for t in range(8 * BS)] for p in range(40)]
    events: list[object] = []
    for tokens in prompts:  # as vLLM orders them: the sliding window first, then full
        events += [sw_store(tokens, 6, 8, None), fa_store(tokens, 0, 8, None)]
    events += [removed(prompts[0], [6, 7], 0), removed(prompts[0], list(range(8)), 1)]
    whole, stepped = PrefixIndex(block_size=BS), PrefixIndex(block_size=BS)
    whole.apply(H, batch(*events))
    one_apply = whole.to_bytes()  # before any match moves a block (recency)
    keys = [whole.keys_for(tokens) for tokens in prompts]
    final = [whole.match_keys(k).by_holder().get(H) for k in keys]
    pauses = 0
    for _ in stepped.apply_steps(H, batch(*events), 16):  # no main chain is that long
        pauses += 1
        for k, done in zip(keys, final, strict=True):
            now = stepped.match_keys(k).by_holder().get(H)
            assert now is None or done is None or now.gpu <= done.gpu or k is keys[0]
    assert pauses == 5, "the side group's 82 blocks paused after each 16"
    assert [stepped.match_keys(k).by_holder().get(H) for k in keys] == final
    untouched = PrefixIndex(block_size=BS)  # no match between steps: none moved a block
    for _ in untouched.apply_steps(H, batch(*events), 16):
        pass
    one, steps = decode_snapshot(one_apply), decode_snapshot(untouched.to_bytes())
    # the engine-hash map is the same map, filled in another order (its order is unused)
    assert dict(zip(steps.hashes, steps.hash_keys, strict=True)) == dict(
        zip(one.hashes, one.hash_keys, strict=True)
    )
    assert msgspec.structs.replace(steps, hashes=one.hashes, hash_keys=one.hash_keys) == one


def test_one_side_group_removal_may_name_a_duplicated_block_twice() -> None:
    """Sliding-window blocks stored twice, removed by one event naming each hash twice
    once their full-attention copies are gone: nothing left, nothing raises."""
    index = stored_200()
    index.apply(H, batch(sw_store(PROMPT, 4, 6, None)))  # the same blocks again
    index.apply(H, batch(removed(PROMPT, [5, 4, 3, 2, 1, 0], group=1)))
    index.apply(H, batch(removed(PROMPT, [5, 5, 4, 4], group=0)))
    assert index.group_entries() == {"sliding_window:0:64": 0} and len(index) == 0
    assert index.stats.unknown_hash == 0


def test_mla_and_sink_attention_are_full_attention_and_sliding_mla_a_window() -> None:
    """vLLM names an MLA model's group (DeepSeek, Kimi) ``mla_attention`` and a sink
    model's ``sink_full_attention``: both reuse the whole prefix, as full attention (they
    were side groups of an unsupported kind: such an engine's stream was never indexed)."""
    for kind in ("mla_attention", "sink_full_attention"):
        index = PrefixIndex(block_size=BS)
        only = msgspec.structs.replace(
            fa_store(PROMPT, 0, 6, None), group_idx=0, kv_cache_spec_kind=kind
        )
        index.apply(H, batch(only))
        assert (gpu(index, PROMPT), index.stats.unsupported_group) == (6, 0), kind
    index = PrefixIndex(block_size=BS)
    sw_mla = msgspec.structs.replace(
        sw_store(PROMPT, 4, 6, None), kv_cache_spec_kind="sliding_window_mla"
    )
    main = msgspec.structs.replace(fa_store(PROMPT, 0, 6, None), kv_cache_spec_kind="mla_attention")
    index.apply(H, batch(sw_mla, main))
    assert gpu(index, PROMPT) == 6 and index.group_entries() == {"sliding_window:0:64": 2}
    index.apply(H, batch(removed(PROMPT, [5], group=0)))  # the window's last block gone
    assert gpu(index, PROMPT) < 6


def test_a_side_groups_offload_copy_without_a_kind_goes_to_that_groups_table() -> None:
    """vLLM's offloading connector copies a sliding-window group's blocks to CPU with
    ``group_idx`` alone (no kind, no tokens): the copy joins the group's table (it was
    read as a new full-attention group that took the window's place: the GPU match fell
    to 0 and the window's later removals went astray)."""
    index = stored_200()
    copy = sliding_copy_to_cpu(5)
    index.apply(H, batch(copy))
    assert gpu(index, PROMPT) == 6
    assert index.group_entries() == {"sliding_window:0:64": 3}  # two GPU blocks, one CPU copy
    index.apply(H, batch(removed(PROMPT, [4, 5], group=0)))
    assert index.group_entries() == {"sliding_window:0:64": 1} and index.stats.unknown_hash == 0


def test_predictions_add_to_a_hybrid_holder_only_past_its_main_group() -> None:
    """A hybrid holder's confirmed match is shortened by its sliding-window group; an
    unrelated prediction on another holder reported that shortfall as predicted blocks."""
    index = PrefixIndex(block_size=BS, prediction_ttl_s=30.0)
    index.add_holder(H2)
    index.apply(H, batch(sw_store(PROMPT, 4, 6, None), fa_store(PROMPT, 0, 6, None)))
    index.apply(H, batch(removed(PROMPT, [5], group=0)))  # the window's last block gone
    keys = index.keys_for(LONGER)
    confirmed = index.match_keys(keys)
    assert index.holder_match(confirmed, H).gpu < 6
    index.predict(H2, index.keys_for(list(range(900, 900 + 2 * BS))))
    assert index.predicted(keys, confirmed) == {}
    index.predict(H, keys)  # the longer request sent to H: its 7th block is predicted
    assert index.predicted(keys, confirmed) == {H: 1}


def test_a_sliding_only_holders_offload_copy_and_predictions_stay_with_its_window() -> None:
    """A holder with only a sliding-window group: the offloading connector's CPU copy
    (group_idx alone) stays in that group (it made the group the main one: the GPU match
    fell to 0 and later removals missed), and predictions add only past its window."""
    index = PrefixIndex(block_size=BS, prediction_ttl_s=30.0)
    index.apply(H, batch(sw_store(PROMPT, 4, 6, None)))
    copy = sliding_copy_to_cpu(5)
    index.apply(H, batch(copy))
    assert gpu(index, PROMPT) == 6 and index._main_group == {}
    keys = index.keys_for(LONGER)
    confirmed = index.match_keys(keys)
    index.predict(H, keys)
    assert index.predicted(keys, confirmed) == {H: 1}
    index.apply(H, batch(removed(PROMPT, [4, 5], group=0)))
    assert index.group_entries() == {"sliding_window:0:64": 1} and index.stats.unknown_hash == 0


def test_a_kindless_copy_heard_first_does_not_make_its_group_the_main_one() -> None:
    """A router that joins late may first hear a side group's offload copy, which names
    its group_idx and no kind: it must not take that group for the holder's main group
    (the full-attention group's stores then went to a side table, for good)."""
    index = PrefixIndex(block_size=BS)
    copy = sliding_copy_to_cpu(5)
    index.apply(H, batch(copy))
    assert index._main_group == {}
    index.apply(H, batch(sw_store(PROMPT, 4, 6, None), fa_store(PROMPT, 0, 6, None)))
    assert index._main_group == {0: 1} and gpu(index, PROMPT) == 6
    assert len(index) == 6 and index.group_entries() == {"sliding_window:0:64": 2}


def test_a_new_memory_bound_reaches_the_side_groups_and_prunes_them_now() -> None:
    """A router restoring a peer's snapshot puts its own --max-entries on it: every side
    group's table too, each pruned to it at once (they kept the peer's bound before)."""
    index = PrefixIndex(block_size=BS, max_entries=100_000)
    for n in range(6):  # six prompts, each 2 sliding-window blocks and 6 full-attention ones
        tokens = [n * 1000 + t for t in range(200)]
        index.apply(H, batch(sw_store(tokens, 4, 6, None), fa_store(tokens, 0, 6, None)))
    assert index.group_entries() == {"sliding_window:0:64": 12} and len(index) == 36
    restored = PrefixIndex.from_bytes(index.to_bytes())
    restored.set_max_entries(10)
    assert len(restored) <= 10
    assert 0 < restored.group_entries()["sliding_window:0:64"] <= 10
    assert all(t.max_entries == 10 for t in restored._groups.values())
