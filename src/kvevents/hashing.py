"""Block hashes: our own chained content key, and the engines' hash schemes.

The content key is what the index and the router key blocks by. It is computed from
token ids alone, so a router and a request agree on it without sharing any seed with
an engine: ``key(block i) = xxh3_64(tokens of block i as little-endian uint32, seed=key(block i-1))``
with ``ROOT_KEY`` as the seed of the first block. Chaining by seed costs no
concatenation, and xxh3 runs at memory speed, so keying a request is one C call per
block after a single conversion of the whole token list to bytes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

__all__ = ["ROOT_KEY", "content_keys", "tokens_to_bytes"]

ROOT_KEY = 0
"""Seed of the first block's content key (the parent of a chain with no parent)."""

_xxh3 = xxhash.xxh3_64_intdigest


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes, converted in C (no Python loop per token)."""
    arr = token_ids if isinstance(token_ids, array) else array("I", token_ids)
    if arr.itemsize != 4:
        arr = array("I", arr)
    data = arr.tobytes()
    if array("I", [1]).tobytes()[0] != 1:  # big-endian host
        swapped = array("I", data)
        swapped.byteswap()
        data = swapped.tobytes()
    return data


def content_keys(
    token_ids: Sequence[int], block_size: int, parent_key: int = ROOT_KEY
) -> list[int]:
    """Chained content keys of every *full* block of ``token_ids``.

    A trailing partial block gets no key (engines cache and publish only full blocks).
    ``parent_key`` continues a chain whose earlier blocks were keyed already.
    """
    if block_size <= 0:
        raise ValueError(f"content_keys: block_size={block_size} must be a positive int")
    data = memoryview(tokens_to_bytes(token_ids))
    step = 4 * block_size
    keys = []
    key = parent_key
    for start in range(0, len(data) - step + 1, step):
        key = _xxh3(data[start : start + step], seed=key)
        keys.append(key)
    return keys
