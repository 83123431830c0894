"""Property tests: PrefixIndex against a brute-force model under random event sequences."""

from __future__ import annotations

from collections import Counter

import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Holder,
    HolderMatch,
    KVEventBatch,
    PrefixIndex,
    Tier,
    decode_batch,
    encode_batch,
)

BLOCK = 2
HOLDERS = [Holder("w0", 0), Holder("w0", 1), Holder("w1", 0)]
MEDIUM = {Tier.GPU: "GPU", Tier.CPU: "CPU_PINNED", Tier.DISK: "DISK"}

paths = st.lists(st.integers(0, 2), min_size=1, max_size=5).map(tuple)
holders = st.sampled_from(HOLDERS)
tiers = st.sampled_from([Tier.CPU, Tier.DISK])


def tokens_of(path: tuple[int, ...]) -> list[int]:
    out: list[int] = []
    for x in path:
        out += [x, x + 10]
    return out


def engine_hash(prefix: tuple[int, ...]) -> int:
    """A content hash like SGLang's: signed 64-bit, the same for every holder."""
    h = xxhash.xxh3_64_intdigest(repr(prefix).encode())
    return h - (1 << 64) if h >= 1 << 63 else h


class Model:
    """Brute force: per holder and tier, a multiset of block prefixes."""

    def __init__(self) -> None:
        self.held: dict[Holder, dict[Tier, Counter[tuple[int, ...]]]] = {}

    def tiers(self, h: Holder) -> dict[Tier, Counter[tuple[int, ...]]]:
        return self.held.setdefault(h, {t: Counter() for t in Tier})

    def holds(self, h: Holder, block: tuple[int, ...], allowed: tuple[Tier, ...]) -> bool:
        return any(self.tiers(h)[t][block] > 0 for t in allowed)

    def match(self, h: Holder, path: tuple[int, ...]) -> HolderMatch:
        lengths = []
        for allowed in ((Tier.GPU,), (Tier.GPU, Tier.CPU), tuple(Tier)):
            n = 0
            while n < len(path) and self.holds(h, path[: n + 1], allowed):
                n += 1
            lengths.append(n)
        g, c, a = lengths
        return HolderMatch(g, c - g, a - c)

    def entries(self) -> int:
        return sum(1 for ts in self.held.values() for c in ts.values() for v in c.values() if v)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(block_size=BLOCK)
        self.model = Model()
        self.encoding = "map"

    def send(self, holder: Holder, *events: object) -> None:
        batch = KVEventBatch(ts=1.0, events=list(events), data_parallel_rank=holder.dp_rank)
        self.encoding = "array" if self.encoding == "map" else "map"
        self.index.apply(holder, decode_batch(encode_batch(batch, self.encoding)))  # type: ignore[arg-type]

    @rule(holder=holders, path=paths, data=st.data())
    def store_chain(self, holder: Holder, path: tuple[int, ...], data: st.DataObject) -> None:
        """An engine stores a chain whose parent it holds (possibly re-storing held blocks)."""
        held = 0
        while held < len(path) and self.model.holds(holder, path[: held + 1], (Tier.GPU,)):
            held += 1
        start = data.draw(st.integers(0, min(held, len(path) - 1)), label="start")
        end = data.draw(st.integers(start + 1, len(path)), label="end")
        blocks = [path[: i + 1] for i in range(start, end)]
        self.send(
            holder,
            BlockStored(
                block_hashes=[engine_hash(b) for b in blocks],
                parent_block_hash=engine_hash(path[:start]) if start else None,
                token_ids=tokens_of(path[start:end]),
                block_size=BLOCK,
                lora_id=None,
                medium=data.draw(st.sampled_from([None, "GPU"]), label="medium"),
            ),
        )
        for b in blocks:
            self.model.tiers(holder)[Tier.GPU][b] += 1

    @rule(holder=holders, tier=tiers, data=st.data())
    def offload(self, holder: Holder, tier: Tier, data: st.DataObject) -> None:
        """Blocks the holder has are copied to a slower tier (empty tokens, by hash)."""
        known = sorted(
            {b for c in self.model.tiers(holder).values() for b, n in c.items() if n > 0}
        )
        if not known:
            return
        blocks = data.draw(st.lists(st.sampled_from(known), min_size=1, max_size=3))
        self.send(
            holder,
            BlockStored(
                block_hashes=[engine_hash(b) for b in blocks],
                parent_block_hash=None,
                token_ids=[],
                block_size=BLOCK,
                lora_id=None,
                medium=MEDIUM[tier],
            ),
        )
        for b in blocks:
            self.model.tiers(holder)[tier][b] += 1

    @rule(holder=holders, data=st.data())
    def remove(self, holder: Holder, data: st.DataObject) -> None:
        """Blocks leave one tier, or every tier when the medium is nil (also unknown ones)."""
        tier = data.draw(st.sampled_from([None, *Tier]), label="tier")
        pool = sorted({b for c in self.model.tiers(holder).values() for b in c} | {(9,)})
        blocks = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
        self.send(
            holder,
            BlockRemoved(
                block_hashes=[engine_hash(b) for b in blocks],
                medium=None if tier is None else MEDIUM[tier],
            ),
        )
        before = self.index.stats.unknown_hash
        unknown = 0
        for b in blocks:
            affected = list(Tier) if tier is None else [tier]
            counters = self.model.tiers(holder)
            if not any(counters[t][b] > 0 for t in affected):
                unknown += 1
            for t in affected:
                if counters[t][b] > 0:
                    counters[t][b] -= 1
        assert self.index.stats.unknown_hash - before <= unknown

    @rule(holder=holders)
    def clear(self, holder: Holder) -> None:
        """AllBlocksCleared empties only that holder."""
        self.send(holder, AllBlocksCleared())
        self.model.held.pop(holder, None)

    @rule(holder=holders)
    def remove_holder(self, holder: Holder) -> None:
        """remove_holder drops the holder and everything it held."""
        self.index.remove_holder(holder)
        self.model.held.pop(holder, None)

    @precondition(lambda self: self.model.entries() > 0)
    @rule()
    def snapshot_round_trip(self) -> None:
        """An index rebuilt from its snapshot answers exactly as the original."""
        self.index = PrefixIndex.from_bytes(self.index.to_bytes())

    @rule(path=paths)
    def match(self, path: tuple[int, ...]) -> None:
        """match() gives every holder its exact nested per-tier prefix length."""
        result = self.index.match([*tokens_of(path), 7])
        got = result.by_holder()
        for h in HOLDERS:
            expected = self.model.match(h, path)
            assert got.get(h, HolderMatch(0, 0, 0)) == expected, (h, path)

    @invariant()
    def entry_count(self) -> None:
        """len(index) counts exactly the (block, holder, tier) entries held."""
        assert len(self.index) == self.model.entries()

    @invariant()
    def gpu_hashes(self) -> None:
        """holder_hashes() equals the engine hashes each holder holds on GPU."""
        for h in HOLDERS:
            expected = {engine_hash(b) for b, n in self.model.tiers(h)[Tier.GPU].items() if n > 0}
            assert self.index.holder_hashes(h) == expected


IndexMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexAgainstModel = IndexMachine.TestCase


key_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove"]),
        st.integers(0, 3),
        st.lists(st.integers(1, 6), min_size=1, max_size=6),
    ),
    max_size=40,
)


def _chain_keys(ids: list[int]) -> list[int]:
    """Chained keys: key i names the whole prefix 0..i (as content keys do)."""
    return [hash(tuple(ids[: i + 1])) & 0xFFFFFFFFFFFF for i in range(len(ids))]


@settings(max_examples=200, deadline=None)
@given(ops=key_ops, probe=st.lists(st.integers(1, 6), min_size=1, max_size=6))
def test_key_api_matches_set_model(ops: list[tuple[str, int, list[int]]], probe: list[int]) -> None:
    """store_keys/remove_keys/match_keys agree with per-holder multisets of keys."""
    index = PrefixIndex()
    model: dict[int, Counter[int]] = {r: Counter() for r in range(4)}
    holders_ = [Holder("k", r) for r in range(4)]
    for op, rank, ids in ops:
        keys = _chain_keys(ids)
        if op == "store":
            index.store_keys(holders_[rank], keys)
            model[rank].update(keys)
        elif model[rank][keys[-1]] > 0:
            assert index.remove_keys(holders_[rank], keys[-1:]) == 1
            model[rank][keys[-1]] -= 1
        else:
            assert index.remove_keys(holders_[rank], keys[-1:]) == 0
    keys = _chain_keys(probe)
    got = index.match_keys(keys)
    for rank in range(4):
        n = 0
        while n < len(keys) and model[rank][keys[n]] > 0:
            n += 1
        assert index.holder_match(got, holders_[rank]).gpu == n
    assert len(index) == sum(1 for c in model.values() for v in c.values() if v > 0)


@settings(max_examples=150, deadline=None)
@given(ops=key_ops, bound=st.integers(1, 12))
def test_memory_bound_holds_and_counts_pruning(
    ops: list[tuple[str, int, list[int]]], bound: int
) -> None:
    """The index never holds more than max_entries entries, and every pruned entry is counted."""
    index = PrefixIndex(max_entries=bound)
    model: dict[int, Counter[int]] = {r: Counter() for r in range(4)}
    for op, rank, ids in ops:
        keys = _chain_keys(ids)
        if op == "store":
            index.store_keys(Holder("k", rank), keys)
            model[rank].update(keys)
        else:
            index.remove_keys(Holder("k", rank), keys[-1:])
            model[rank][keys[-1]] = max(0, model[rank][keys[-1]] - 1)
        assert len(index) <= bound
        for r in range(4):
            held = {k for k, n in model[r].items() if n > 0}
            assert index.holder_keys(Holder("k", r)) <= held
    live = sum(1 for c in model.values() for n in c.values() if n > 0)
    assert index.stats.pruned_entries >= live - len(index)
