"""Per-block extra keys: what besides tokens names a block (salts, adapters, images).

What vLLM sends
---------------
vLLM hashes each block over ``(parent, tokens, extra_keys)`` and publishes the
``extra_keys`` of every stored block in ``BlockStored.extra_keys``: a list with one entry
per hash, each nil or an array. For one block the array holds, in this order:

* the LoRA adapter's name (every block of an adapter request);
* one entry per multimodal input overlapping the block: ``[identifier, offset]``, the
  offset of the input's first placeholder token relative to the block's start (older
  vLLM sent the identifier alone);
* the request's ``cache_salt``, on the sequence's *first* block only;
* a hash of the block's prompt embeddings (bytes), when the prompt came as embeddings.

SGLang instead sends ``cache_salt`` and ``lora_name`` as fields of the event.

How kvevents keys them
----------------------
An adapter and a salt apply to a whole sequence, so they choose the chain's root
(:func:`kvevents.index.prefix_index.namespace_key`), exactly as for SGLang's fields: a
request that names its adapter and salt is keyed under the same root, and a request
that names neither never reaches those blocks. Everything else (images, embeddings) is
local to a block: :func:`keys_with_extras` folds it into that block's content key, so
every later block of the chain differs too, as in the engine's own hash. A text-only
request therefore never matches blocks stored with image keys, even though their
placeholder tokens are the same; a gateway that knows an image's identifier passes the
same per-block keys to ``/query`` or ``/route`` and matches them.

:func:`split_extra_keys` takes the adapter name (equal to the event's ``lora_name``, or
``lora_id`` for older vLLM) off the front of each block's keys, and the salt (the last
string of the first block's keys, after any adapter name) off the first block; what
remains is folded. Requests go through the same function, so a gateway can pass vLLM's
own per-block keys verbatim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

from kvevents.wire.hashing import tokens_to_bytes

__all__ = ["keys_with_extras", "split_extra_keys"]

_xxh3 = xxhash.xxh3_64_intdigest
_encode = msgspec.msgpack.Encoder().encode
_EXTRA_TAG = b"kvevents-extra\x00"


def split_extra_keys(
    extra_keys: Sequence[Any] | None,
    *,
    lora: str | int | None,
    first_block: bool,
) -> tuple[str | None, list[Any] | None]:
    """``(salt, per_block)``: the sequence's salt and each block's remaining keys.

    ``extra_keys`` is aligned with the blocks (one entry per block, nil or a list).
    ``first_block``: whether the first entry is the sequence's first block (only that
    block carries the salt). ``per_block`` is None when no block has a key left.
    """
    if not extra_keys:
        return None, None
    salt: str | None = None
    out: list[Any] = []
    left = False
    for i, entry in enumerate(extra_keys):
        if entry is None:
            out.append(None)
            continue
        items = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        while items and lora is not None and items[0] == lora:
            items.pop(0)
        if i == 0 and first_block:
            for j in range(len(items) - 1, -1, -1):
                if isinstance(items[j], str):
                    salt = items.pop(j)
                    break
                if not isinstance(items[j], (bytes, bytearray)):
                    break
        if items:
            out.append(items)
            left = True
        else:
            out.append(None)
    return salt, (out if left else None)


def keys_with_extras(
    token_ids: Sequence[int], block_size: int, parent_key: int, per_block: Sequence[Any]
) -> list[int]:
    """Chained content keys of the full blocks, each block's extra keys folded into its key.

    ``per_block[i]`` (nil or a list) belongs to block ``i``; blocks past its end have none.
    Equal to :func:`kvevents.wire.hashing.content_keys` when every entry is nil.
    Raises ``TypeError`` for keys msgpack cannot encode.
    """
    data = tokens_to_bytes(token_ids)
    step = 4 * block_size
    keys: list[int] = []
    key = parent_key
    n = len(per_block)
    for i, start in enumerate(range(0, len(data) - step + 1, step)):
        key = _xxh3(data[start : start + step], key)
        if i < n and per_block[i]:
            try:
                encoded = _encode(per_block[i])
            except (TypeError, OverflowError) as exc:  # an int past 64 bits: overflow
                raise TypeError(f"block {i}'s extra keys {per_block[i]!r:.80}: {exc}") from None
            key = _xxh3(_EXTRA_TAG + encoded, key)
        keys.append(key)
    return keys
