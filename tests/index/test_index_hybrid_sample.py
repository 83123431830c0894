"""A real vLLM 0.32 hybrid Gemma3's captured stream, applied to the index: nothing malformed, the state the events describe, and vLLM's own cached counts.

The capture (``tests/data/wire-samples/vllm-0.32.0-cpu-hybrid-gemma3.jsonl``, see its
README): group 0 is a sliding window of 64 tokens, group 1 full attention, block size
32; twelve prompts, each sent twice, under eviction; a replay from seq 0 at the end.
Every record's ``after`` names the prompt, its length and the ``cached_tokens`` vLLM
reported for that send.
"""

from __future__ import annotations

import re
from collections import Counter

from kvevents import BlockRemoved, BlockStored, Holder, KVEventBatch, PrefixIndex
from kvevents.wire import decode_batch, parse_live_frames, parse_replay_reply
from kvevents.wire.hashing import ROOT_KEY, content_keys
from wire_samples import load_wire_samples

NAME = "vllm-0.32.0-cpu-hybrid-gemma3.jsonl"
BS = 32
SLIDING, FULL = 0, 1
H = Holder("vllm", 0)
AFTER = re.compile(r"prompt (\d+) \((\d+) tokens, cached (\d+)\), send (\d)")


def decoded() -> list[tuple[str, KVEventBatch]]:
    """Every distinct batch of the capture in seq order, live and replayed, decoded from its frames."""
    seen: dict[int, tuple[str, KVEventBatch]] = {}
    for record in load_wire_samples(NAME):
        if record["kind"] == "live":
            msg = parse_live_frames(record["frames"])
            seq, payload = msg.seq, msg.payload
        else:
            reply = parse_replay_reply(record["frames"])
            if reply.is_end:
                continue
            seq, payload = reply.seq, reply.payload
        batch = decode_batch(payload)
        if seq in seen:
            assert seen[seq][1] == batch, seq  # a replay repeats the live batch exactly
        else:
            seen[seq] = (record["after"], batch)
    return [seen[s] for s in sorted(seen)]


class Reference:
    """The plain reading of the events: per group, how many copies of each hash the engine holds.

    vLLM names a block by one hash in every group and may hold two physical copies of it
    (a recomputed block is stored again): a store adds a copy, a removal takes one.
    Blocks are named by content key from the full-attention stores' tokens, chained
    through their parents, as a request for the same tokens is keyed.
    """

    def __init__(self, batches: list[tuple[str, KVEventBatch]]) -> None:
        self.copies: dict[int, Counter[int]] = {SLIDING: Counter(), FULL: Counter()}
        self.key: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}  # hash -> the token prefix it ends
        for _, batch in batches:  # the names first: a batch lists the window before its parent
            for ev in batch.events:
                if isinstance(ev, BlockStored) and ev.group_idx == FULL:
                    parent = ev.parent_block_hash
                    root = ROOT_KEY if parent is None else self.key[parent]
                    before = [] if parent is None else self.tokens[parent]
                    keys = content_keys(ev.token_ids, BS, root)
                    for i, (h, k) in enumerate(zip(ev.block_hashes, keys, strict=True)):
                        self.key[h] = k
                        self.tokens[h] = before + list(ev.token_ids[: (i + 1) * BS])

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            assert ev.medium == "GPU"  # type: ignore[union-attr]
            held = self.copies[ev.group_idx]  # type: ignore[union-attr,index]
            if isinstance(ev, BlockStored):
                held.update(ev.block_hashes)
            else:
                assert isinstance(ev, BlockRemoved)
                for h in ev.block_hashes:
                    assert held[h] > 0, h  # the capture never removes what it does not hold
                    held[h] -= 1

    def held(self, group: int) -> set[int]:
        return {h for h, n in self.copies[group].items() if n > 0}


def test_every_message_applies_with_nothing_malformed_and_leaves_what_the_events_describe() -> None:
    """Each captured batch, decoded and applied, counts nothing malformed and leaves per group exactly the blocks the events hold."""
    batches = decoded()
    assert len(batches) == 16
    ref = Reference(batches)
    universe = sorted(set(ref.key.values()))
    index = PrefixIndex(block_size=BS)
    index.add_holder(H, block_size=BS)
    for after, batch in batches:
        index.apply(H, batch)
        ref.apply(batch)
        full, window = ref.held(FULL), ref.held(SLIDING)
        assert index.holder_hashes(H) == full, after
        assert index.held_by_group(H, universe) == {
            "main": [k in {ref.key[h] for h in full} for k in universe],
            "sliding_window:0:64": [k in {ref.key[h] for h in window} for k in universe],
        }, after
        assert len(index) == len(full), after
        assert index.group_entries() == {"sliding_window:0:64": len(window)}, after
    stats = index.stats
    assert (stats.malformed, stats.unknown_hash, stats.unknown_parent) == (0, 0, 0)
    assert (stats.block_size_mismatch, stats.unsupported_group, stats.unknown_medium) == (0, 0, 0)
    assert set(stats.events) == {"BlockStored:ok", "BlockRemoved:ok"}
    # the four stores that name no block: a block-aligned prompt's second send
    empty = [
        ev
        for _, b in batches
        for ev in b.events
        if isinstance(ev, BlockStored) and not ev.block_hashes
    ]
    assert len(empty) == 4 and all(
        len(ev.token_ids) == BS and ev.group_idx == SLIDING for ev in empty
    )


def test_each_sends_match_before_it_ran_is_what_vllm_reported_as_cached() -> None:
    """Before each captured send, the index's match of that prompt, in tokens, equals the cached_tokens vLLM reported for it, block-aligned prompts included."""
    batches = decoded()
    ref = Reference(batches)
    index = PrefixIndex(block_size=BS)
    index.add_holder(H, block_size=BS)
    checked = aligned = 0
    for after, batch in batches:
        found = AFTER.match(after)
        assert found is not None, after
        length, cached = int(found[2]), int(found[3])
        last = [ev for ev in batch.events if isinstance(ev, BlockStored) and ev.group_idx == FULL]
        full_blocks = ref.tokens[last[-1].block_hashes[-1]]
        assert len(full_blocks) == length // BS * BS, after
        prompt = full_blocks + [0] * (length - len(full_blocks))  # the tail is keyed by no block
        assert index.holder_match(index.match(prompt), H).gpu * BS == cached, after
        checked += 1
        aligned += length % BS == 0
        index.apply(H, batch)
    assert (checked, aligned) == (16, 8)


def test_a_captured_prompts_block_aligned_prefix_needs_the_window_before_its_capped_end() -> None:
    """After the first capture step, the 200-token prompt matches 6 blocks but its block-aligned 192-token prefix none: vLLM hits at most 5 blocks of it, whose window blocks 3 and 4 group 0 never cached."""
    batches = decoded()
    ref = Reference(batches)
    index = PrefixIndex(block_size=BS)
    index.add_holder(H, block_size=BS)
    after, first = batches[0]
    assert after.startswith("prompt 0 (200 tokens")
    index.apply(H, first)
    stored = [ev for ev in first.events if isinstance(ev, BlockStored) and ev.group_idx == FULL]
    blocks = ref.tokens[stored[0].block_hashes[-1]]
    assert len(blocks) == 6 * BS
    assert index.holder_match(index.match([*blocks, *[0] * 8]), H).gpu == 6
    assert index.holder_match(index.match(blocks), H).gpu == 0
