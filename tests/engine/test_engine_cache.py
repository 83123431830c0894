"""The paged radix prefix cache: matching, pinning, LRU eviction, flush, and its events."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, sglang_block_hashes
from kvevents.engine.cache import Admission, PrefixCache
from kvevents.wire.hashing import get_hash_scheme


def replay(events: list[KVCacheEvent], held: set[Any] | None = None) -> set[Any]:
    """Apply events to a set of hashes the way a consumer would."""
    held = set() if held is None else held
    for ev in events:
        if isinstance(ev, BlockStored):
            assert ev.parent_block_hash is None or ev.parent_block_hash in held
            assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
            assert ev.medium == "GPU"
            held.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            assert set(ev.block_hashes) <= held
            held.difference_update(ev.block_hashes)
        else:
            assert isinstance(ev, AllBlocksCleared)
            held.clear()
    return held


def test_admit_stores_one_chain_and_matches_prefix() -> None:
    """A first admission stores its full pages as one chain; a second one sharing a prefix hits it."""
    cache = PrefixCache(page_size=2, capacity=100)
    first = cache.admit([1, 2, 3, 4, 5, 6, 7])
    assert (first.prompt_tokens, first.cached_tokens, first.inserted_blocks) == (7, 0, 3)
    (stored,) = cache.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == sglang_block_hashes([1, 2, 3, 4, 5, 6], 2)
    assert stored.parent_block_hash is None
    assert stored.token_ids == [1, 2, 3, 4, 5, 6]
    assert (stored.block_size, stored.medium) == (2, "GPU")

    second = cache.admit([1, 2, 3, 4, 9, 9])
    assert (second.cached_tokens, second.inserted_blocks) == (4, 1)
    (child,) = cache.take_events()
    assert isinstance(child, BlockStored)
    assert child.parent_block_hash == stored.block_hashes[1]
    assert child.token_ids == [9, 9]
    assert cache.match([1, 2, 3, 4, 9, 9, 1]) == 6
    assert cache.stats.hit_rate == pytest.approx(4 / 13)


def test_a_page_aligned_prompt_reuses_every_page_but_its_last() -> None:
    """A prompt ending on a page boundary, cached whole, reuses all its pages but the last
    (an engine computes at least the last token), and stores nothing new; one token more
    reuses every page."""
    cache = PrefixCache(page_size=16, capacity=100)
    prompt = list(range(64))
    assert cache.admit(prompt).inserted_blocks == 4
    cache.take_events()
    again = cache.admit(prompt)
    assert (again.prompt_tokens, again.cached_tokens, again.inserted_blocks) == (64, 48, 0)
    assert cache.take_events() == []
    assert cache.match(prompt) == 48
    longer = cache.admit([*prompt, 7])
    assert (longer.cached_tokens, longer.inserted_blocks) == (64, 0)
    assert cache.match([*prompt, 7]) == 64
    assert cache.match(prompt[:16]) == 0 and cache.match(prompt[:17]) == 16
    assert cache.stats.cached_tokens == 48 + 64


def test_evicts_least_recently_released_unpinned_leaves() -> None:
    """When full, the cache evicts unpinned leaves, least recently released first, in one BlockRemoved."""
    cache = PrefixCache(page_size=1, capacity=4)
    a = cache.admit([1, 2])
    b = cache.admit([3, 4])
    cache.release(b)
    cache.release(a)  # a released last: b is older
    cache.take_events()
    c = cache.admit([5])
    (removed, stored) = cache.take_events()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == sglang_block_hashes([3, 4], 1)[1:]  # b's leaf only
    assert isinstance(stored, BlockStored)
    cache.release(c)
    cache.admit([6, 7, 8])  # needs 3 pages: the oldest released unpinned leaves go first
    removed = cache.take_events()[0]
    assert isinstance(removed, BlockRemoved)
    a_hashes = sglang_block_hashes([1, 2], 1)
    assert removed.block_hashes == [sglang_block_hashes([3], 1)[0], a_hashes[1], a_hashes[0]]
    cache.check_invariants()


def test_pinned_pages_are_never_evicted() -> None:
    """Pages pinned by a running admission survive; a full cache of pins caches nothing new."""
    cache = PrefixCache(page_size=1, capacity=3)
    running = cache.admit([1, 2, 3])
    cache.take_events()
    other = cache.admit([7, 8])
    assert other.inserted_blocks == 0
    assert cache.take_events() == []
    assert sorted(cache.block_hashes()) == sorted(sglang_block_hashes([1, 2, 3], 1))
    cache.release(running)
    cache.release(other)
    cache.admit([7, 8])
    kinds = [type(e).__name__ for e in cache.take_events()]
    assert kinds == ["BlockRemoved", "BlockStored"]


def test_flush_clears_everything_and_old_admissions_release_nothing() -> None:
    """A flush records AllBlocksCleared, empties the cache, and earlier admissions become inert."""
    cache = PrefixCache(page_size=2, capacity=10)
    adm = cache.admit([1, 2, 3, 4])
    cache.flush()
    assert len(cache) == 0
    assert isinstance(cache.take_events()[-1], AllBlocksCleared)
    cache.release(adm)
    cache.release(adm)
    again = cache.admit([1, 2, 3, 4])
    assert again.cached_tokens == 0 and again.inserted_blocks == 2
    cache.check_invariants()


def test_vllm_scheme_produces_vllm_hashes() -> None:
    """With the vLLM scheme selected, stored hashes are vLLM's sha256_cbor int hashes."""
    scheme = get_hash_scheme("vllm", seed="3")
    cache = PrefixCache(page_size=2, capacity=10, scheme=scheme)
    cache.admit([1, 2, 3, 4])
    (stored,) = cache.take_events()
    assert isinstance(stored, BlockStored)
    from kvevents.wire.hashing import vllm_block_hashes

    assert stored.block_hashes == vllm_block_hashes([1, 2, 3, 4], 2, seed="3")


def test_bad_construction_is_named() -> None:
    """A non-positive page size or capacity is refused, naming the parameter."""
    with pytest.raises(ValueError, match="page_size=0"):
        PrefixCache(page_size=0, capacity=1)
    with pytest.raises(ValueError, match="capacity=0"):
        PrefixCache(page_size=1, capacity=0)


# Small token alphabet and short prompts, so prompts share prefixes often.
prompt_st = st.lists(st.integers(0, 3), min_size=0, max_size=12)
op_st = st.one_of(
    st.tuples(st.just("admit"), prompt_st),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("flush"), st.none()),
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(op_st, max_size=60),
    page=st.integers(1, 3),
    capacity=st.integers(1, 8),
    scheme=st.sampled_from(["sglang", "vllm"]),
)
def test_replaying_events_reproduces_cached_blocks(
    ops: list[tuple[str, Any]], page: int, capacity: int, scheme: str
) -> None:
    """After any sequence of admits, releases and flushes, replaying the events gives exactly the cached hashes."""
    cache = PrefixCache(page_size=page, capacity=capacity, scheme=get_hash_scheme(scheme))
    live: list[Admission] = []
    held: set[Any] = set()
    for op, arg in ops:
        if op == "admit":
            live.append(cache.admit(arg))
        elif op == "release" and live:
            cache.release(live.pop(arg % len(live)))
        elif op == "flush":
            cache.flush()
        replay(cache.take_events(), held)
        assert held == set(cache.block_hashes())
        assert len(held) == len(cache) <= capacity
        cache.check_invariants()
