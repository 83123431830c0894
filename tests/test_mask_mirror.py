"""The native match over the mask mirror answers exactly as the dict match does.

``MaskMirror`` (the native core's, :mod:`kvevents.kernels`) copies the index's block
masks into a flat table lazily, from the keys each writer lists. Most tests here drive a
real :class:`~kvevents.index.prefix_index.PrefixIndex` through random writes (stores,
removals, holders cleared and removed, pruning past ``max_entries``, offloaded tiers,
more than 64 holders, whose masks take rows of several words, a snapshot round trip)
and after each one compare the native match of many requests with the plain one over
the dict; the rest drive a mirror alone against its statement in Python
(:class:`~kvevents.kernels.spec.MirrorModel`), bad arguments included.
"""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents import kernels
from kvevents.index.prefix_index import PrefixIndex
from kvevents.index.types import Tier
from kvevents.kernels.spec import MirrorModel
from kvevents.types import Holder
from kvevents.wire.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.wire.hashing import content_key_array
from native_support import native_core

BLOCK = 4
HOLDERS = [Holder(f"http://e{i // 4}", i % 4) for i in range(8)]
WIDE = [Holder(f"http://w{i // 8}", i % 8) for i in range(150)]
"""Three words of 64 holders: masks in the wide mirror (:class:`WideMaskMirror`)."""


@pytest.fixture(scope="module", autouse=True)
def compiled() -> kernels.Kernels:
    return native_core()


def _keys(tokens: list[int]) -> array[int]:
    keys = content_key_array(array("I", tokens), BLOCK)
    assert isinstance(keys, array), "requests are keyed by the native core"
    assert keys.typecode == "Q"
    return keys


def _plain(index: PrefixIndex, keys: array[int]) -> object:
    """The dict match of the same keys (a plain list is not read by the native match)."""
    return index.match_keys(keys.tolist())


def _check(index: PrefixIndex, requests: list[array[int]]) -> None:
    index.sync_mirror()
    mirror = index._mirror
    assert mirror is not None
    gpu = (1 << index._width) - 1
    held = sum(1 for v in index._blocks.values() if v & gpu)
    assert mirror.count == held, "the mirror holds the keys with a GPU bit, no more"
    for keys in requests:
        fast = index.match_keys(keys)
        assert fast == _plain(index, keys), "the native match disagrees with the dict"
        # the keys a request would predict on each holder: native, in C, and one by one
        slots = len(index._holders) + 1  # and one slot nobody holds
        edges = {0, 1, 62, 63, 64, 65, 127, 128, 129, slots - 2, slots - 1}
        for slot in range(slots) if slots <= 16 else sorted(s for s in edges if s < slots):
            one_by_one = [k for k in keys if not index._held_any(k, slot)]
            assert index._not_held(keys, slot) == one_by_one, "native, for the predictions"
            assert index._not_held(keys.tolist(), slot) == one_by_one, "from the dict"


def _index(holders: list[Holder] = HOLDERS, **options: int) -> PrefixIndex:
    """An index of block size ``BLOCK`` with every one of ``holders`` added."""
    index = PrefixIndex(block_size=BLOCK, **options)
    for h in holders:
        index.add_holder(h)
    return index


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts sharing prefixes, so that matches end at many different lengths."""
    roots = [[rng.randrange(1000) for _ in range(BLOCK * 4)] for _ in range(3)]
    out = []
    for _ in range(n):
        tail = [rng.randrange(1000) for _ in range(BLOCK * rng.randrange(4, 20))]
        out.append(rng.choice(roots) + tail)
    return out


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    max_entries=st.sampled_from([60, 400, 100_000]),
    wide=st.booleans(),
)
def test_random_writes_keep_the_native_match_equal_to_the_dict(
    seed: int, max_entries: int, wide: bool
) -> None:
    rng = random.Random(seed)
    holders = WIDE if wide else HOLDERS
    index = _index(holders, max_entries=max_entries)
    prompts = _prompts(rng, 12)
    requests = [_keys(p) for p in prompts]
    # on the wide index, writes go mostly to the slots around each word's edges
    pick = [h for i, h in enumerate(holders) if i % 64 in (0, 1, 62, 63) or i >= 140]
    for _ in range(40):
        op = rng.random()
        holder = rng.choice(pick if wide and rng.random() < 0.8 else holders)
        keys = rng.choice(requests)
        if op < 0.5:
            index.store_keys(holder, keys[: rng.randrange(1, len(keys) + 1)])
        elif op < 0.75:
            start = rng.randrange(len(keys))
            index.remove_keys(holder, keys[start : start + rng.randrange(1, 6)])
        elif op < 0.8:
            index.clear_holder(holder)
        elif op < 0.85:
            index.remove_holder(holder)
            index.add_holder(holder)
        elif op < 0.92:
            index.store_keys(holder, keys[:3], tier=Tier.CPU)  # offloaded: the tiered match
        else:
            index.remove_keys(holder, keys, tier=Tier.CPU)
        _check(index, requests)


def test_a_request_no_holder_has_and_an_index_without_holders() -> None:
    index = PrefixIndex(block_size=BLOCK)
    keys = _keys(list(range(BLOCK * 10)))
    _check(index, [keys])
    index.add_holder(HOLDERS[0])
    _check(index, [keys])
    index.store_keys(HOLDERS[0], keys)
    match = index.match_keys(keys)
    assert match.for_slot(0).gpu == 10
    _check(index, [keys, _keys(list(range(1, BLOCK * 10 + 1)))])


@pytest.mark.slow
def test_the_mirror_grows_and_rebuilds_and_stays_exact() -> None:
    rng = random.Random(7)
    index = _index()
    requests = [_keys(p) for p in _prompts(rng, 40)]
    _check(index, requests)
    stored: list[array[int]] = []
    for i in range(400):  # new blocks, a match after each few: the table grows
        stored.append(_keys(_prompts(rng, 1)[0]))
        index.store_keys(rng.choice(HOLDERS), stored[-1])
        if i % 10 == 0:
            _check(index, stored)
    assert index._mirror is not None and index._mirror.grown >= 1
    _check(index, stored + requests)
    for _ in range(3000):  # past the listed-changes limit between two matches: a rebuild
        index.store_keys(rng.choice(HOLDERS), rng.choice(requests))
        index.store_keys(rng.choice(HOLDERS), _keys(_prompts(rng, 1)[0]))
    _check(index, requests)
    mirror = index._mirror
    assert mirror is not None and mirror.grown >= 2 and mirror.rebuilds >= 2


def test_more_than_64_holders_widen_the_mirror_and_match_exactly() -> None:
    """Holders join one by one past 64 and 128 (the slots widen twice, every mask moves):
    the mirror follows, as wide as the slots, and its match stays the dict's."""
    index = PrefixIndex(block_size=BLOCK)
    holders = [Holder(f"http://w{i}", 0) for i in range(150)]
    keys = _keys(list(range(BLOCK * 12)))
    other = _keys(list(range(1, BLOCK * 12 + 1)))
    for i, h in enumerate(holders):
        index.add_holder(h)
        index.store_keys(h, keys[: 1 + i % 12])
        if i % 3 == 0:
            index.store_keys(h, other[: 1 + i % 7])
        if i in (10, 63, 64, 65, 100, 127, 128, 149):
            _check(index, [keys, other])
    mirror = index._mirror
    assert mirror is not None and mirror.words == 3, "the mirror is as wide as the slots"
    match = index.match_keys(keys)
    assert match.for_slot(149).gpu == 1 + 149 % 12
    assert match.for_slot(64).gpu == 1 + 64 % 12
    assert match == _plain(index, keys)
    index.remove_holder(holders[130])  # a slot of the third word freed
    index.clear_holder(holders[70])
    _check(index, [keys, other])
    assert index.match_keys(keys).for_slot(70).gpu == 0


@pytest.mark.parametrize("holders", [HOLDERS, WIDE], ids=["8 holders", "150 holders"])
def test_an_index_loaded_from_a_snapshot_matches_exactly(holders: list[Holder]) -> None:
    rng = random.Random(3)
    index = _index(holders)
    requests = [_keys(p) for p in _prompts(rng, 20)]
    for keys in requests:
        index.store_keys(rng.choice(holders), keys)
    _check(index, requests)
    loaded = PrefixIndex.from_bytes(index.to_bytes())
    _check(loaded, requests)
    for a, b in zip(requests, requests, strict=True):
        assert loaded.match_keys(a) == index.match_keys(b)


def test_a_large_batch_of_events_syncs_the_mirror_before_the_next_match() -> None:
    """Events from the wire reach the mirror too, and a large batch syncs it at once."""
    rng = random.Random(11)
    index = PrefixIndex(block_size=BLOCK)
    holder = HOLDERS[0]
    index.add_holder(holder)
    prompts = _prompts(rng, 40)
    requests = [_keys(p) for p in prompts]
    _check(index, requests)  # the mirror exists from here on
    events = []
    for n, tokens in enumerate(prompts):
        blocks = len(tokens) // BLOCK
        hashes = [n * 1000 + i for i in range(blocks)]
        events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=tokens[: blocks * BLOCK],
                block_size=BLOCK,
                lora_id=None,
                medium=None,
            )
        )
    index.apply(holder, KVEventBatch(ts=0.0, events=events))
    assert index._changed == [], "a batch of this size synced the mirror as it ended"
    assert all(index.match_keys(k).for_slot(0).gpu == len(k) for k in requests)
    _check(index, requests)
    index.apply(holder, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[5, 6])]))
    _check(index, requests)


@pytest.mark.parametrize("holders", [HOLDERS, WIDE], ids=["8 holders", "150 holders"])
def test_a_crowded_table_keeps_its_probe_runs_through_cleared_bits(
    holders: list[Holder],
) -> None:
    """Enough keys that many share a probe run, then bits cleared and keys dropped one
    by one through the sync: a row left empty in a run would hide the keys after it."""
    rng = random.Random(7)
    index = _index(holders)
    index.sync_mirror()
    requests = [_keys([rng.randrange(10**6) for _ in range(BLOCK * 10)]) for _ in range(150)]
    for i, keys in enumerate(requests):
        index.store_keys(holders[i % len(holders)], keys)
        index.store_keys(holders[(i * 7 + 3) % len(holders)], keys[:4])
    _check(index, requests)
    mirror = index._mirror
    assert mirror is not None and mirror.count > mirror.capacity / 8, "crowded enough"
    for i, keys in enumerate(requests):
        if i % 3:
            index.remove_keys(holders[i % len(holders)], keys[rng.randrange(10) :])
        if i % 5 == 0:
            index.remove_keys(holders[(i * 7 + 3) % len(holders)], keys[:2])
    index.clear_holder(holders[2])
    _check(index, requests)


def test_sync_mirror_builds_it_before_any_match() -> None:
    """What a router calls once it serves, so a warm-started index's first request does
    not copy every block."""
    index = _index()
    keys = _keys(list(range(BLOCK * 9)))
    index.store_keys(HOLDERS[1], keys)
    assert index._mirror is None
    index.sync_mirror()
    assert index._mirror is not None and index._mirror.count == len(keys)
    assert index.match_keys(keys).for_slot(1).gpu == 9


@settings(max_examples=200, deadline=None)
@given(
    words=st.integers(1, 3),
    writes=st.lists(
        st.tuples(st.integers(0, 40), st.integers(-192, 192)), min_size=1, max_size=300
    ),
    cuts=st.lists(st.integers(1, 60), min_size=1, max_size=8),
)
def test_a_mirror_alone_is_its_python_statement(
    compiled: kernels.Kernels, words: int, writes: list[tuple[int, int]], cuts: list[int]
) -> None:
    """Random writes (bits set and cleared past each word's edge, keys dropped, synced in
    batches that grow the table), then rebuilds: the mirror holds, matches and lists
    exactly what :class:`~kvevents.kernels.spec.MirrorModel` does."""
    mirror, model = compiled.MaskMirror(words), MirrorModel(words)
    limit = 64 * words
    keys_of = [(k * 0x9E3779B97F4A7C15 + k) % 2**64 for k in range(41)]  # some share a home
    at = 0
    for cut in cuts:
        batch = writes[at : at + cut]
        at += cut
        keys = [keys_of[k] for k, _ in batch]
        ops = array("q", [max(-limit, min(limit, op)) for _, op in batch])
        mirror.sync(keys, ops)
        model.sync(keys, ops)
        assert sorted(mirror.items()) == sorted(model.masks.items())
        assert mirror.count == len(model.masks)
        request = array("Q", keys_of[: 1 + cut % 41])
        live = (1 << limit) - 1 if cut % 3 else (1 << limit) - 1 - (1 << (cut % limit))
        assert mirror.match(request, live) == model.match(request, live)
        for slot in (0, 63, limit - 1, cut % limit):
            assert mirror.not_held(request, slot) == model.not_held(request, slot)
    blocks = {k: v | (5 << (64 * words)) for k, v in model.masks.items()}  # offloaded bits
    mirror.rebuild(blocks)
    model.rebuild(blocks)
    assert sorted(mirror.items()) == sorted(model.masks.items())
    assert mirror.rebuilds == 1


def test_rows_keep_the_gpu_tier_of_masks_with_offloaded_bits(compiled: kernels.Kernels) -> None:
    """A rebuilt mask may carry offloaded tiers past the GPU tier's words: the rows hold
    its GPU tier alone, and a mask with nothing on the GPU is no key at all."""
    mirror = compiled.MaskMirror(3)
    gpu = [1, (1 << 191) | 5, (1 << 130) | (1 << 64)]
    offloaded = {1: gpu[0] | (1 << 192), 2: gpu[1], 3: gpu[2] | (7 << 300), 4: 1 << 200}
    mirror.rebuild(offloaded)
    assert sorted(mirror.items()) == [(1, gpu[0]), (2, gpu[1]), (3, gpu[2])]
    assert mirror.count == 3


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda m: m.sync([1], array("q", [65])), ValueError, "names no slot of 64"),
        (lambda m: m.sync([1], array("q", [-(2**63)])), ValueError, "names no slot"),
        (lambda m: m.sync([1, 2], array("q", [1])), ValueError, "2 keys but 1 ops"),
        (lambda m: m.sync([-1], array("q", [1])), OverflowError, None),
        (lambda m: m.sync([2**64], array("q", [1])), OverflowError, None),
        (lambda m: m.sync(["a"], array("q", [1])), TypeError, None),
        (lambda m: m.sync([1], array("i", [1])), TypeError, "8-byte items"),
        (lambda m: m.sync(5, array("q", [1])), TypeError, "sequence of ints"),
        (lambda m: m.rebuild([(1, 2)]), TypeError, "a dict of masks"),
        (lambda m: m.rebuild({1: -2}), ValueError, "must not be negative"),
        (lambda m: m.rebuild({1: "x"}), TypeError, "must be an int"),
        (lambda m: m.rebuild({-1: 1}), OverflowError, None),
        (lambda m: m.match(array("Q", [1]), 2**64), OverflowError, None),
        (lambda m: m.match(array("Q", [1]), -1), OverflowError, None),
        (lambda m: m.match(array("I", [1]), 1), TypeError, "8-byte items"),
        (lambda m: m.match(memoryview(bytes(17))[1:].cast("Q"), 1), TypeError, "aligned"),
        (lambda m: m.not_held(array("Q", [1]), 64), ValueError, "slot 64 is not one of 0..63"),
        (lambda m: m.not_held(array("Q", [1]), -1), ValueError, "slot -1"),
        (lambda m: type(m)(0), ValueError, "give 1 to"),
        (lambda m: type(m)(10**6), ValueError, "give 1 to"),
    ],
)
def test_a_mirror_refuses_bad_arguments_and_stays_as_it_was(
    compiled: kernels.Kernels, call: object, error: type[Exception], words: str | None
) -> None:
    """Each bad argument is refused with a Python error naming it, and the mirror is left
    as it was: no key written, none dropped."""
    mirror = compiled.MaskMirror(1)
    mirror.sync([7, 8], array("q", [1, 3]))
    with pytest.raises(error, match=words):
        call(mirror)  # type: ignore[operator]
    assert sorted(mirror.items()) == [(7, 1), (8, 4)]
