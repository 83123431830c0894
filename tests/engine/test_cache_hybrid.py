"""The simulated cache's salted, image-keyed and hybrid (sliding-window) events, read by the index.

Whatever the cache reports as ``cached_tokens`` for a request, the index fed its events
must predict before the request is admitted: the same reuse rule on both sides, vLLM's
event shapes in between.
"""

from __future__ import annotations

import random

import pytest

from kvevents import Holder, KVEventBatch, PrefixIndex
from kvevents.engine.cache import PrefixCache
from kvevents.wire.events import BlockStored
from kvevents.wire.hashing import VLLMSha256CborHash

PAGE = 4
H = Holder("sim", 0)


def feed(cache: PrefixCache, index: PrefixIndex) -> None:
    index.apply(H, KVEventBatch(ts=0.0, events=cache.take_events(), data_parallel_rank=0))


def predicted(index: PrefixIndex, tokens: list[int], **kw: object) -> int:
    return index.holder_match(index.match(tokens, **kw), H).gpu * PAGE  # type: ignore[arg-type]


@pytest.mark.parametrize("window", [None, 8, 12])
def test_index_predicts_every_cached_tokens_of_the_simulated_cache(window: int | None) -> None:
    rng = random.Random(window or 0)
    cache = PrefixCache(PAGE, 24, VLLMSha256CborHash(seed="0"), sliding_window=window)
    index = PrefixIndex(block_size=PAGE)
    bases = [[rng.randrange(1000) for _ in range(4 * PAGE + 2)] for _ in range(8)]
    pool = bases + [b + [rng.randrange(1000) for _ in range(2 * PAGE)] for b in bases]
    pool += [b[: 3 * PAGE + 1] for b in bases]  # prefixes whose window the cache never held
    cut = 0
    for _ in range(300):
        prompt = rng.choice(pool)
        salt = rng.choice([None, None, "a"])
        expect = predicted(index, prompt, cache_salt=salt)
        if window is not None:
            main = index.held_by_group(H, index.keys_for(prompt, cache_salt=salt)).get("main", [])
            full_run = next((i for i, held in enumerate(main) if not held), len(main))
            cut += full_run * PAGE > expect
        admission = cache.admit(prompt, cache_salt=salt)
        assert admission.cached_tokens == expect
        cache.release(admission)
        cache.check_invariants()
        feed(cache, index)
    assert index.stats.malformed == 0 and index.stats.unknown_parent == 0
    assert index.stats.unknown_hash == 0
    if window is not None:
        assert cut > 0  # the window rule decided some of the answers


def test_hybrid_events_have_vllm_shapes() -> None:
    cache = PrefixCache(PAGE, 64, VLLMSha256CborHash(seed="0"), sliding_window=8)
    prompt = list(range(6 * PAGE + 1))
    cache.admit(prompt)
    full, sliding = cache.take_events()
    assert isinstance(full, BlockStored) and isinstance(sliding, BlockStored)
    assert (full.group_idx, full.kv_cache_spec_kind) == (1, "full_attention")
    assert len(full.block_hashes) == 6 and len(full.token_ids) == 6 * PAGE
    assert (sliding.group_idx, sliding.kv_cache_spec_kind) == (0, "sliding_window")
    assert sliding.kv_cache_spec_sliding_window == 8
    # window 8 at page 4: ceil(7 / 4) = 2 pages, with the tokens of all 6
    assert sliding.block_hashes == full.block_hashes[-2:]
    assert sliding.parent_block_hash is None and len(sliding.token_ids) == 6 * PAGE


def test_salt_and_image_keys_keep_requests_apart() -> None:
    cache = PrefixCache(PAGE, 64, VLLMSha256CborHash(seed="0"))
    index = PrefixIndex(block_size=PAGE)
    # one token past 3 pages: a real engine (and the index) recomputes a page-aligned
    # prompt's last page, which this cache does not model (kvevents.index.reusable)
    prompt = list(range(3 * PAGE + 1))
    image = [None, [["img-1", 2]], None]
    cache.admit(prompt, cache_salt="s")
    cache.admit(prompt, extra_keys=image)
    feed(cache, index)
    # a text-only request shares the image request's first page only (the image starts
    # in page 1), and none of the salted pages
    assert predicted(index, prompt) == PAGE == cache.match(prompt)
    assert predicted(index, prompt, cache_salt="s") == 3 * PAGE
    assert predicted(index, prompt, extra_keys=image) == 3 * PAGE
    assert cache.match(prompt, extra_keys=image) == 3 * PAGE
    assert predicted(index, prompt, cache_salt="t") == 0 == cache.match(prompt, cache_salt="t")
