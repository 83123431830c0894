"""PrefixIndex by example: real wire samples, tiers, counters, namespaces, pruning, snapshots."""

from __future__ import annotations

import msgspec
import pytest

from kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Holder,
    HolderMatch,
    KVEventBatch,
    PrefixIndex,
    Tier,
    TierCredits,
    decode_batch,
    namespace_key,
)
from kvevents.index.snapshot import SNAPSHOT_VERSION
from kvevents.index.types import normalize_medium
from kvevents.wire.frames import parse_live_frames, parse_replay_reply
from kvevents.wire.hashing import sglang_block_hashes
from wire_samples import load_wire_samples

A = Holder("engine-a", 0)
B = Holder("engine-a", 1)


def stored(
    hashes: list[int],
    tokens: list[int],
    *,
    parent: int | None = None,
    size: int = 2,
    medium: str | None = None,
    lora: str | None = None,
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=size,
        lora_id=None,
        medium=medium,
        lora_name=lora,
    )


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))  # type: ignore[arg-type]


def sample_batches(name: str) -> list[tuple[int, KVEventBatch]]:
    """Every distinct seq of a capture, in order, as a subscriber delivers it (replays dedup'd)."""
    seen: dict[int, KVEventBatch] = {}
    for record in load_wire_samples(name):
        if record["kind"] == "live":
            msg = parse_live_frames(record["frames"])
            seq, payload = msg.seq, msg.payload
        else:
            reply = parse_replay_reply(record["frames"])
            if reply.is_end:
                continue
            seq, payload = reply.seq, reply.payload
        batch_ = decode_batch(payload)
        if seq in seen:
            assert seen[seq] == batch_  # a replay repeats the live batch exactly
        seen[seq] = batch_
    return sorted(seen.items())


def replay_as_set(batches: list[KVEventBatch]) -> set[object]:
    """What the engine holds on GPU, by hash: the obvious set replay of the events."""
    held: set[object] = set()
    for b in batches:
        for ev in b.events:
            if isinstance(ev, BlockStored) and ev.token_ids and ev.medium in (None, "GPU"):
                held.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved) and ev.medium in (None, "GPU"):
                held.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                held.clear()
    return held


@pytest.mark.parametrize(
    "name", ["vllm-0.32.0-cpu-int-hashes.jsonl", "vllm-0.32.0-cpu-bytes-hashes.jsonl"]
)
def test_vllm_samples_leave_the_engines_state(name: str) -> None:
    """Every real vLLM message applied in order leaves, after each step, exactly the hashes vLLM held."""
    index = PrefixIndex(block_size=32)
    holder = Holder("vllm", 0)
    index.add_holder(holder, block_size=32)
    applied: list[KVEventBatch] = []
    for _, b in sample_batches(name):
        index.apply(holder, b)
        applied.append(b)
        assert index.holder_hashes(holder) == replay_as_set(applied)
    assert len(index.holder_hashes(holder)) == 1  # one prompt after /reset_prefix_cache
    assert index.stats.unknown_hash == 0
    assert index.stats.unknown_parent == 0
    assert index.stats.block_size_mismatch == 0


def test_vllm_sample_prefix_matches_in_tokens() -> None:
    """The 64-token prefix and its decode block stored by vLLM match a request as 3 blocks."""
    batches = [b for _, b in sample_batches("vllm-0.32.0-cpu-int-hashes.jsonl")]
    index = PrefixIndex(block_size=32)
    holder = Holder("vllm", 0)
    for b in batches[:2]:
        index.apply(holder, b)
    tokens = [t for b in batches[:2] for ev in b.events for t in ev.token_ids]  # type: ignore[union-attr]
    result = index.match([*tokens, 1, 2, 3])
    assert result.by_holder() == {holder: HolderMatch(3, 0, 0)}
    assert index.match(tokens[:40]).by_holder() == {holder: HolderMatch(1, 0, 0)}


def test_sglang_sample_tiers_and_namespaces() -> None:
    """SGLang's capture: chains, a LoRA/salted store, a CPU_PINNED copy and removals by tier."""
    batches = dict(sample_batches("sglang-0.5.23.jsonl"))
    index = PrefixIndex(block_size=2)
    rank3 = Holder("sglang", 3)
    index.add_holder(rank3, block_size=2)
    chain = batches[0].events[0]
    child = batches[1].events[0]
    salted = batches[2].events[0]
    assert isinstance(chain, BlockStored) and isinstance(child, BlockStored)
    assert isinstance(salted, BlockStored)
    for seq in (0, 1, 2):
        index.apply(rank3, batches[seq])
    # each request goes on past the stored pages: an engine recomputes the last page of
    # a page-aligned prompt (kvevents.index.reusable), one more token keeps them all
    prompt = [*chain.token_ids, *child.token_ids, 0]
    assert index.match(prompt).by_holder() == {rank3: HolderMatch(4, 0, 0)}
    # The salted LoRA block matches only under its own namespace.
    assert index.match([*salted.token_ids, 0]).by_holder() == {}
    ns = index.match([*salted.token_ids, 0], lora=salted.lora_name, cache_salt=salted.cache_salt)
    assert ns.by_holder() == {rank3: HolderMatch(1, 0, 0)}

    index.apply(rank3, batches[3])  # first page copied to host
    assert index.holder_hashes(rank3, Tier.CPU) == {chain.block_hashes[0]}
    index.apply(rank3, batches[4])  # pages 2-3 leave GPU, page 1 leaves host
    assert index.holder_hashes(rank3, Tier.CPU) == set()
    assert index.holder_hashes(rank3) == {chain.block_hashes[0], child.block_hashes[0], 42}
    assert index.match(prompt).by_holder() == {rank3: HolderMatch(1, 0, 0)}
    index.apply(rank3, batches[5])  # 42 removed without a medium: every tier
    assert index.holder_hashes(rank3, None) == {chain.block_hashes[0], child.block_hashes[0]}
    index.apply(rank3, batches[6])
    assert len(index) == 0 and index.holder_hashes(rank3, None) == set()
    assert index.stats.unknown_medium == 0 and index.stats.unknown_hash == 0


def test_offloaded_tiers_give_nested_lengths_and_removal_by_medium() -> None:
    """A CPU copy extends a holder's prefix past its GPU part; removing it by medium keeps GPU."""
    index = PrefixIndex(block_size=2)
    index.apply(A, batch(stored([1, 2, 3], [1, 2, 3, 4, 5, 6])))
    index.apply(A, batch(stored([2, 3], [], medium="CPU_PINNED"), stored([3], [], medium="DISK")))
    index.apply(A, batch(BlockRemoved(block_hashes=[2, 3], medium="GPU")))
    request = [1, 2, 3, 4, 5, 6, 0]  # past the 3 blocks: none is recomputed
    assert index.match(request).by_holder() == {A: HolderMatch(1, 2, 0)}
    index.apply(A, batch(BlockRemoved(block_hashes=[3], medium="CPU")))
    assert index.match(request).by_holder() == {A: HolderMatch(1, 1, 1)}
    index.apply(A, batch(BlockRemoved(block_hashes=[3])))
    assert index.match(request).by_holder() == {A: HolderMatch(1, 1, 0)}
    assert len(index) == 2


def test_silent_miss_paths_are_counted() -> None:
    """Unknown parents, unknown hashes, foreign block sizes, unknown media and bad token counts each count."""
    index = PrefixIndex()
    index.add_holder(A, block_size=2)
    index.apply(A, batch(stored([7], [1, 2], parent=999)))
    index.apply(A, batch(BlockRemoved(block_hashes=[12345])))
    index.apply(A, batch(stored([8, 9], [1, 2, 3, 4, 5, 6, 7, 8], size=4)))
    index.apply(A, batch(stored([10], [5, 5], medium="NVME_OVER_FABRIC")))
    index.apply(A, batch(stored([11, 12], [1, 2, 3])))
    s = index.stats
    assert (s.unknown_parent, s.unknown_hash, s.block_size_mismatch) == (1, 1, 1)
    assert (s.unknown_medium, s.malformed) == (1, 1)
    assert s.events["BlockStored:unknown_parent"] == 1
    assert s.events["BlockRemoved:unknown_hash"] == 1
    # The orphan chain is kept (its removal resolves) but no request can reach it.
    assert index.match([1, 2]).by_holder() == {}
    index.apply(A, batch(BlockRemoved(block_hashes=[7])))
    assert index.stats.unknown_hash == 1
    # The unknown medium is kept at the lowest tier.
    assert index.match([5, 5, 0]).by_holder() == {A: HolderMatch(0, 0, 1)}


def test_duplicate_store_needs_two_removals() -> None:
    """A block stored twice by one holder (vLLM duplicates) stays until its second removal."""
    index = PrefixIndex(block_size=2)
    index.apply(A, batch(stored([1], [1, 2]), stored([1], [1, 2])))
    index.apply(A, batch(BlockRemoved(block_hashes=[1])))
    assert index.holder_hashes(A) == {1}
    index.apply(A, batch(BlockRemoved(block_hashes=[1])))
    assert index.holder_hashes(A) == set() and len(index) == 0


def test_one_removal_may_name_a_duplicated_block_twice() -> None:
    """Both copies of a block stored twice removed by one event naming its hash twice:
    the block is gone, and nothing raises (it did, and stopped the router's consumer)."""
    index = PrefixIndex(block_size=2)
    index.apply(A, batch(stored([1], [1, 2]), stored([1], [1, 2])))
    index.apply(A, batch(BlockRemoved(block_hashes=[1, 1])))
    assert index.holder_hashes(A) == set() and len(index) == 0
    assert index.stats.unknown_hash == 0


def test_clear_and_remove_holder_touch_only_that_holder() -> None:
    """clear_holder empties one holder and keeps it registered; remove_holder frees its slot."""
    index = PrefixIndex(block_size=2)
    index.apply(A, batch(stored([1, 2], [1, 2, 3, 4])))
    index.apply(B, batch(stored([1], [1, 2])))
    assert index.clear_holder(A) == 2
    assert index.holders() == [A, B]
    assert index.match([1, 2, 3, 4]).by_holder() == {B: HolderMatch(1, 0, 0)}
    assert index.remove_holder(B) == 1
    assert index.holders() == [A] and len(index) == 0
    c = Holder("engine-b", 0)
    assert index.add_holder(c) == 1  # B's slot reused


def test_more_than_64_holders() -> None:
    """Holders beyond the first 64 (a wider slot mask) match exactly, tiers included."""
    index = PrefixIndex(block_size=1)
    holders = [Holder("w", r) for r in range(130)]
    for r, h in enumerate(holders):
        index.store_keys(h, index.keys_for(list(range(r % 5 + 1))))
    index.store_keys(holders[129], index.keys_for([0, 1, 2, 3, 4, 5])[5:], tier=Tier.CPU)
    result = index.match(list(range(7))).by_holder()  # a 7th token: the 6 blocks count
    assert len(result) == 130
    assert result[holders[3]] == HolderMatch(4, 0, 0)
    assert result[holders[129]] == HolderMatch(5, 1, 0)
    assert len(index) == sum(r % 5 + 1 for r in range(130)) + 1


def test_pruning_drops_least_recently_used_leaves_first() -> None:
    """Over the bound, the oldest block goes first; a matched prefix counts as used, leaves before parents."""
    index = PrefixIndex(block_size=1, max_entries=6)
    old = index.keys_for([1, 2, 3])
    new = index.keys_for([7, 8, 9])
    index.store_keys(A, old)
    index.store_keys(A, new)
    index.match([1, 2, 0])  # touches the first two blocks of the old chain
    index.store_keys(B, index.keys_for([4]))
    assert len(index) <= 6
    assert index.stats.pruned_entries >= 1
    # The old chain's leaf (never matched) went first; its matched prefix stayed.
    assert index.match([1, 2, 3, 0]).by_holder()[A] == HolderMatch(2, 0, 0)


def test_snapshot_round_trip_and_bad_bytes() -> None:
    """A snapshot restores every answer and counter; bytes that are not a snapshot say so."""
    index = PrefixIndex(block_size=2, credits=TierCredits(cpu=0.5))
    index.apply(A, batch(stored([1, 2], [1, 2, 3, 4]), stored([2], [], medium="CPU")))
    index.apply(B, batch(stored([-5], [9, 9])))
    copy = PrefixIndex.from_bytes(index.to_bytes())
    assert copy.match([1, 2, 3, 4]).by_holder() == index.match([1, 2, 3, 4]).by_holder()
    assert copy.holder_hashes(A, None) == {1, 2} and copy.holder_hashes(B) == {-5}
    assert copy.credits == TierCredits(cpu=0.5) and len(copy) == len(index)
    assert copy.stats.stored_blocks == index.stats.stored_blocks
    with pytest.raises(ValueError, match="not an index snapshot"):
        PrefixIndex.from_bytes(b"\x93garbage")


def test_snapshot_carries_applied_seqs_and_refuses_old_versions() -> None:
    """A snapshot carries each holder's last applied seq; a snapshot of an older layout
    (versions 1 to 3) or an unknown version is refused by name, saying what to do."""
    index = PrefixIndex(block_size=2)
    index.apply(A, batch(stored([1, 2], [1, 2, 3, 4])))
    index.applied_seqs[A] = 41
    copy = PrefixIndex.from_bytes(index.to_bytes())
    assert copy.applied_seqs == {A: 41}
    snap = msgspec.msgpack.decode(index.to_bytes())
    assert snap[0] == SNAPSHOT_VERSION == 5
    # version 4 (no per-holder keys of shared hashes) is read as having none
    v4 = PrefixIndex.from_bytes(msgspec.msgpack.encode([4, *snap[1:-1]]))
    assert v4.applied_seqs == {A: 41} and v4._slot_keys == {}
    # version 3's layout: a list of (key, mask) pairs, hashes as (hash, key) pairs
    v3 = [3, *snap[1:7], [[k, b"\x01"] for k in snap[7][0]], [[1, 9]], *snap[10:]]
    for version, raw in ((3, v3), (2, [2, *v3[1:-3]]), (1, [1, *v3[1:-4]])):
        with pytest.raises(ValueError, match=f"snapshot version {version} is not supported") as e:
            PrefixIndex.from_bytes(msgspec.msgpack.encode(raw))
        assert "older kvevents" in str(e.value) and "--peer" in str(e.value)
    with pytest.raises(ValueError, match=r"snapshot version 9 is not supported.*newer"):
        PrefixIndex.from_bytes(msgspec.msgpack.encode([9, *snap[1:]]))
    index.remove_holder(A)
    assert index.applied_seqs == {}


def test_snapshot_restores_internal_state_exactly() -> None:
    """Every derived figure the load recomputes per distinct mask (entries per slot, the
    offloaded count, the live and free slots) and the recency order equal the original's,
    over 64 holders (two-word masks) and three tiers."""
    index = PrefixIndex(block_size=1)
    holders = [Holder("w", r) for r in range(70)]
    for r, h in enumerate(holders):
        keys = index.keys_for(list(range(r % 7 + 2)))
        index.store_keys(h, keys, hashes=[r * 100 + i for i in range(len(keys))])
        index.store_keys(h, keys[:1], tier=Tier(r % 3))
    index.remove_holder(holders[5])
    index.match(list(range(3)))  # a deferred touch: flushed into the snapshot's order
    copy = PrefixIndex.from_bytes(index.to_bytes())
    index._flush_touches()
    assert list(copy._blocks.items()) == list(index._blocks.items())
    assert copy._held == index._held and copy._width == index._width == 128
    assert (copy._entries, copy._offloaded) == (index._entries, index._offloaded)
    assert (copy._live, copy._free, copy._slots) == (index._live, index._free, index._slots)
    assert copy._hashes == index._hashes and copy._refs == index._refs
    assert copy.stats == index.stats
    # equal masks share one int, as stores make them
    masks = {id(v) for v in copy._blocks.values()}
    assert len(masks) == len(set(copy._blocks.values()))


def test_freeze_encodes_the_state_at_the_time_it_was_called() -> None:
    """The encoder freeze() returns reads only its copy: changes made after it (as the
    router applies events while /dump encodes on a thread) are not in that snapshot."""
    index = PrefixIndex(block_size=2)
    index.apply(A, batch(stored([1, 2], [1, 2, 3, 4])))
    index.applied_seqs[A] = 3
    before = index.to_bytes()
    encode = index.freeze()
    index.apply(A, batch(stored([5], [7, 7], parent=2), BlockRemoved(block_hashes=[1])))
    index.apply(B, batch(stored([9], [5, 5])))
    index.applied_seqs[A] = 4
    assert encode() == before
    frozen = PrefixIndex.from_bytes(encode())
    assert frozen.holder_hashes(A) == {1, 2} and frozen.holders() == [A]
    assert frozen.applied_seqs == {A: 3}
    assert frozen.stats.stored_blocks == 2


def test_snapshot_columns_that_disagree_are_refused() -> None:
    """Damaged columns (a mask number out of range, keys without masks, hashes without
    keys, a mask naming a slot that does not exist) are errors, not a wrong index."""
    index = PrefixIndex(block_size=2)
    index.apply(A, batch(stored([1, 2], [1, 2, 3, 4])))
    snap = msgspec.msgpack.decode(index.to_bytes())
    keys, ids, masks = snap[7]
    damaged = {
        "mask number": [keys, [0, 5], masks],
        "negative mask number": [keys, [0, -1], masks],
        "mask numbers": [keys, [0], masks],
        "slot 3 of 1": [keys, ids, [(1 << 3).to_bytes(1, "little")]],
        "empty": [keys, ids, [b""]],
    }
    for columns in damaged.values():  # keyed by the damage each makes
        with pytest.raises(ValueError, match="damaged"):
            PrefixIndex.from_bytes(msgspec.msgpack.encode([*snap[:7], columns, *snap[8:]]))
    with pytest.raises(ValueError, match="engine hashes but 1 keys"):
        PrefixIndex.from_bytes(msgspec.msgpack.encode([*snap[:9], snap[9][:1], *snap[10:]]))


def test_medium_names_and_credit_validation() -> None:
    """Engine medium names map to tiers case-insensitively; credits outside 0..1 are refused."""
    assert normalize_medium(None) == (Tier.GPU, True)
    assert normalize_medium("cpu_pinned") == (Tier.CPU, True)
    assert normalize_medium("STORAGE") == (Tier.DISK, True)
    assert normalize_medium("EXTERNAL") == (Tier.DISK, True)
    assert normalize_medium("QUANTUM") == (Tier.DISK, False)
    with pytest.raises(ValueError, match=r"disk=1\.5"):
        TierCredits(disk=1.5)
    with pytest.raises(ValueError, match="block_size"):
        PrefixIndex().match([1, 2, 3])
    assert namespace_key() == 0 and namespace_key("lora-a") != namespace_key(None, "salt")


@pytest.mark.parametrize("namespace", [{"cache_salt": "tenant-a"}, {"lora_name": "sql"}])
def test_sglang_hashes_shared_by_two_namespaces_resolve_per_holder(
    namespace: dict[str, str],
) -> None:
    """SGLang hashes tokens alone: the same tokens under a salt (or adapter) on A and
    plain on B share engine hashes. A's child chain, its removals and a snapshot of the
    index must still find A's own blocks (B's store took the shared hash map's entry: A's
    child hung from B's namespace, and A's evictions left its blocks in the index)."""
    tokens = [1, 2, 3, 4]
    hashes = sglang_block_hashes(tokens, 2)
    child = sglang_block_hashes([*tokens, 5, 6], 2)[-1:]
    index = PrefixIndex(block_size=2)
    salted = msgspec.structs.replace(stored(hashes, tokens), **namespace)  # type: ignore[arg-type]
    index.apply(A, batch(salted))
    index.apply(B, batch(stored(hashes, tokens)))
    index.apply(A, batch(stored(child, [5, 6], parent=hashes[-1])))
    lora, salt = namespace.get("lora_name"), namespace.get("cache_salt")
    request = [*tokens, 5, 6, 0]  # past the 3 pages: none is recomputed
    assert index.holder_match(index.match(request, lora=lora, cache_salt=salt), A).gpu == 3
    assert index.holder_match(index.match(request), A).gpu == 0
    assert index.stats.unknown_parent == 0
    assert index.holder_hashes(A) == {*hashes, *child} and index.holder_hashes(B) == set(hashes)
    copy = PrefixIndex.from_bytes(index.to_bytes())
    for idx in (index, copy):
        idx.apply(A, batch(BlockRemoved(block_hashes=[*hashes, *child], medium="GPU")))
        assert (idx.holder_size(A), idx.stats.unknown_hash) == (0, 0)
        assert idx.holder_match(idx.match([*tokens, 0]), B).gpu == 2
        idx.apply(B, batch(BlockRemoved(block_hashes=hashes, medium="GPU")))
        assert len(idx) == 0 and not idx._slot_keys and not idx._hashes


def test_sglang_host_store_of_tokens_held_under_a_salt_is_keyed_from_its_own_fields() -> None:
    """SGLang's hashes cover tokens alone: a plain host-tier store of tokens the holder
    has salted on GPU shares their hashes but is another block (it was taken for a copy
    of the salted ones); vLLM's copies (they name a group_idx) are keyed as the blocks."""
    tokens = [1, 2, 3, 4]
    hashes = sglang_block_hashes(tokens, 2)
    index = PrefixIndex(block_size=2)
    salted = msgspec.structs.replace(stored(hashes, tokens, medium="GPU"), cache_salt="tenant-a")
    index.apply(A, batch(salted, stored(hashes, tokens, medium="CPU_PINNED")))
    request = [*tokens, 0]  # past the 2 pages: none is recomputed
    assert index.holder_match(index.match(request), A) == HolderMatch(0, 2, 0)
    assert index.holder_match(index.match(request, cache_salt="tenant-a"), A) == HolderMatch(
        2, 0, 0
    )


def test_a_holders_own_key_goes_with_its_last_copy_though_another_rank_holds_it() -> None:
    """B holds a prompt salted and plain, C plain: B's evictions of both must find both
    (B's own key of the shared hash outlived its block while C held it, so B's salted
    eviction resolved to the plain key and tenant-a's blocks stayed matched on B)."""
    tokens = [1, 2, 3, 4]
    hashes = sglang_block_hashes(tokens, 2)
    c = Holder("engine-a", 2)
    index = PrefixIndex(block_size=2)
    salted = msgspec.structs.replace(stored(hashes, tokens), cache_salt="tenant-a")
    index.apply(B, batch(salted))
    index.apply(c, batch(stored(hashes, tokens)))
    index.apply(B, batch(stored(hashes, tokens)))
    assert index.holder_size(B) == 4
    index.apply(B, batch(BlockRemoved(block_hashes=hashes, medium="GPU")))
    index.apply(B, batch(BlockRemoved(block_hashes=hashes, medium="GPU")))
    assert (index.holder_size(B), index.stats.unknown_hash) == (0, 0)
    assert index.holder_match(index.match([*tokens, 0]), c).gpu == 2
