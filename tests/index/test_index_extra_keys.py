"""Extra keys in content keys: vLLM's per-block ``extra_keys`` (salt, adapter, images), SGLang's fields.

The shapes are vLLM 0.32's: ``extra_keys`` has one entry per hash, nil or an array; a
salted request's first block carries ``[salt]`` (captured from a real vLLM: ``[['salty'],
None, None, None, None, None]``), an adapter request's every block starts with the
adapter's name, an image adds ``[identifier, offset]`` to each block it overlaps.
"""

from __future__ import annotations

import msgspec
import pytest

from kvevents import Holder, PrefixIndex, namespace_key
from kvevents.index.extra_keys import keys_with_extras, split_extra_keys
from kvevents.wire.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.wire.hashing import content_keys

BS = 4
H = Holder("vllm", 0)
TOKENS = list(range(10, 10 + 3 * BS))
REQUEST = [*TOKENS, 0]
"""A request for the stored blocks and one token more (an engine recomputes a block-aligned
prompt's last block, :mod:`kvevents.index.reusable`: with one more token all 3 count)."""


def store(extra: list[object] | None, *, lora_name: str | None = None, **kw: object) -> BlockStored:
    return BlockStored(
        block_hashes=[101, 102, 103],
        parent_block_hash=None,
        token_ids=TOKENS,
        block_size=BS,
        lora_id=7 if lora_name else None,
        medium="GPU",
        lora_name=lora_name,
        extra_keys=extra,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        **kw,  # type: ignore[arg-type]
    )


def indexed(event: BlockStored) -> PrefixIndex:
    index = PrefixIndex(block_size=BS)
    index.apply(H, KVEventBatch(ts=0.0, events=[event], data_parallel_rank=0))
    assert index.stats.malformed == 0
    return index


def blocks(index: PrefixIndex, **kw: object) -> int:
    return index.holder_match(index.match(REQUEST, **kw), H).gpu  # type: ignore[arg-type]


def test_vllm_salt_on_the_first_block_keys_the_chain_under_the_salt() -> None:
    index = indexed(store([["salty"], None, None]))
    assert blocks(index) == 0
    assert blocks(index, cache_salt="other") == 0
    assert blocks(index, cache_salt="salty") == 3
    assert index.holder_keys(H) == set(content_keys(TOKENS, BS, namespace_key(None, "salty")))


def test_plain_nil_extra_keys_are_the_plain_chain() -> None:
    index = indexed(store([None, None, None]))
    assert blocks(index) == 3 and blocks(index, cache_salt="salty") == 0


def test_vllm_adapter_name_in_every_block_keys_under_the_adapter_namespace() -> None:
    index = indexed(store([["sql-lora"], ["sql-lora"], ["sql-lora"]], lora_name="sql-lora"))
    # the contract the request side relies on: namespace_key(lora_name, salt) is the root
    assert index.holder_keys(H) == set(content_keys(TOKENS, BS, namespace_key("sql-lora")))
    assert blocks(index) == 0 and blocks(index, lora="sql-lora") == 3
    salted = indexed(store([["sql-lora", "s"], ["sql-lora"], ["sql-lora"]], lora_name="sql-lora"))
    assert blocks(salted, lora="sql-lora") == 0
    assert blocks(salted, lora="sql-lora", cache_salt="s") == 3


def sglang_store(**fields: object) -> BlockStored:
    """A store in SGLang's shape: salt and adapter as fields of the event."""
    return BlockStored(
        block_hashes=[101, 102, 103],
        parent_block_hash=None,
        token_ids=TOKENS,
        block_size=BS,
        lora_id=None,
        medium=None,
        **fields,  # type: ignore[arg-type]
    )


def test_sglang_salt_and_adapter_fields_key_the_same_roots() -> None:
    index = indexed(sglang_store(cache_salt="s", lora_name="a"))
    assert blocks(index, lora="a", cache_salt="s") == 3 and blocks(index) == 0


def test_an_empty_salt_is_no_salt_on_both_sides() -> None:
    # vLLM adds the salt to the first block's keys only when it is non-empty, so a store
    # it made for a request with "" carries no salt: a request with "" must match it
    index = indexed(store(None))
    assert blocks(index, cache_salt="") == 3
    assert blocks(index, cache_salt="", extra_keys=[["salty"]]) == 0  # no contradiction
    assert (
        namespace_key("a", "") == namespace_key("a") and namespace_key(None, "") == namespace_key()
    )
    assert blocks(indexed(sglang_store(cache_salt=""))) == 3
    salted_in_keys = store([["salty"], None, None], cache_salt="")
    assert blocks(indexed(salted_in_keys), cache_salt="salty") == 3


def test_image_keys_keep_text_only_requests_off_the_image_blocks() -> None:
    image = [None, [["img-hash", 1]], [["img-hash", -3]]]
    index = indexed(store(image))
    # block 0 has no image: shared with text; blocks 1 and 2 (and after) are not
    assert blocks(index) == 1
    assert blocks(index, extra_keys=image) == 3
    assert blocks(index, extra_keys=[None, [["other-image", 1]], [["other-image", -3]]]) == 1


def test_request_extra_keys_may_carry_vllm_salt_and_must_agree_with_cache_salt() -> None:
    index = indexed(store([["salty"], None, None]))
    assert blocks(index, extra_keys=[["salty"]]) == 3
    assert blocks(index, extra_keys=[["salty"]], cache_salt="salty") == 3
    with pytest.raises(ValueError, match="give the salt once"):
        index.keys_for(TOKENS, extra_keys=[["salty"]], cache_salt="other")
    with pytest.raises(ValueError, match="cannot be keyed"):
        index.keys_for(TOKENS, extra_keys=[None, [object()]])


def test_split_and_fold_helpers() -> None:
    assert split_extra_keys(None, lora=None, first_block=True) == (None, None)
    assert split_extra_keys([["a", ["i", 0], "s", b"e"]], lora="a", first_block=True) == (
        "s",
        [[["i", 0], b"e"]],
    )
    # off the first block a string stays a key (older vLLM's bare image hashes)
    assert split_extra_keys([["h"]], lora=None, first_block=False) == (None, [["h"]])
    assert keys_with_extras(TOKENS, BS, 0, [None, None, None]) == content_keys(TOKENS, BS)
    assert keys_with_extras(TOKENS, BS, 0, [None, ["x"]])[0] == content_keys(TOKENS, BS)[0]
    assert keys_with_extras(TOKENS, BS, 0, [None, ["x"]])[1:] != content_keys(TOKENS, BS)[1:]


def test_an_offload_copy_with_tokens_but_no_extra_keys_is_keyed_as_the_blocks_it_copies() -> None:
    """vLLM's offloading connector reports a CPU copy with its tokens but without the
    chain's extra keys: the copy is of the salted blocks the holder has (it was filed under
    the plain namespace, matched unsalted requests, and took the engine hashes along, so
    the GPU copies' eviction no longer resolved)."""
    index = indexed(store([["salty"], None, None]))
    copy = msgspec.structs.replace(store(None), medium="CPU")
    index.apply(H, KVEventBatch(ts=0.0, events=[copy], data_parallel_rank=0))
    assert blocks(index) == 0 and index.holder_match(index.match(REQUEST), H).cpu == 0
    evicted = BlockRemoved(block_hashes=[101, 102, 103], medium="GPU")
    index.apply(H, KVEventBatch(ts=0.0, events=[evicted], data_parallel_rank=0))
    salted = index.holder_match(index.match(REQUEST, cache_salt="salty"), H)
    assert (salted.gpu, salted.cpu, index.stats.unknown_hash) == (0, 3, 0)
    # a store into another tier of blocks the holder does not have is keyed from its tokens
    other = indexed(msgspec.structs.replace(store(None), medium="CPU"))
    assert other.holder_match(other.match(REQUEST), H).cpu == 3
