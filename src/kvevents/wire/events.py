"""The KV-event structs: three event types and the batch of one scheduler step.

Fields beyond the six shared ones of ``BlockStored`` are declared in SGLang's order
(``cache_salt``, ``session_id``, ``lora_name``) followed by vLLM's additions; new fields
are only ever appended, with defaults, so publishers and subscribers upgrade
independently. How the structs travel as bytes is :mod:`kvevents.wire.codec` (whose
positional ``BlockStored`` follows each engine's own field order, not this one).

Engine block hashes are kept exactly as sent: SGLang sends signed int64, vLLM unsigned
uint64 (often above 2**63) or 32 raw bytes. :func:`hash_to_int` folds any of them into
one unsigned 64-bit integer for callers that want a fixed-width key: an int is taken
modulo 2**64 (so a signed int64 and its unsigned twin agree), and bytes are read as
the big-endian integer of their last eight bytes, which is the value vLLM sends in its
int mode for the same digest.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvevents.types import Hash

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "KVCacheEvent",
    "KVEventBatch",
    "event_to_dict",
    "hash_to_int",
]

_U64 = 1 << 64


class KVCacheEvent(
    msgspec.Struct, tag=True, tag_field="type", omit_defaults=True, gc=False, frozen=False
):
    """Base of the three event types; encodes as a map tagged by ``"type"``."""


class BlockStored(KVCacheEvent):
    """Blocks entered a cache tier.

    One event may carry a chain of N blocks: ``token_ids`` then has ``N * block_size``
    tokens and each hash's parent is the previous hash (the first one's parent is
    ``parent_block_hash``). Empty ``token_ids`` with a non-GPU ``medium`` is an offload
    copy of blocks already known by hash. ``medium=None`` means GPU.
    """

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left a cache tier (``medium``), or every tier when ``medium`` is nil."""

    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole cache was flushed."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _BatchMeta(msgspec.StructMeta):
    """Accepts SGLang's ``attn_dp_rank=`` keyword as well as vLLM's ``data_parallel_rank=``."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "attn_dp_rank" in kwargs:
            if "data_parallel_rank" in kwargs:
                raise TypeError(
                    "KVEventBatch: give the rank once, as attn_dp_rank= (SGLang) "
                    "or data_parallel_rank= (vLLM), not both"
                )
            kwargs["data_parallel_rank"] = kwargs.pop("attn_dp_rank")
        return super().__call__(*args, **kwargs)


class KVEventBatch(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, metaclass=_BatchMeta
):
    """The events of one scheduler step: ``[ts, events, data_parallel_rank]`` on the wire.

    ``ts`` is wall-clock seconds. The rank is SGLang's ``attn_dp_rank`` and vLLM's
    ``data_parallel_rank``; both keywords construct it and both names read it.
    """

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None

    @property
    def attn_dp_rank(self) -> int | None:
        """SGLang's name for :attr:`data_parallel_rank`."""
        return self.data_parallel_rank

    @attn_dp_rank.setter
    def attn_dp_rank(self, value: int | None) -> None:
        self.data_parallel_rank = value


def hash_to_int(block_hash: Hash) -> int:
    """Fold an engine hash into an unsigned 64-bit int (see the module docstring)."""
    if isinstance(block_hash, int):
        return block_hash % _U64
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(block_hash)[-8:], "big")
    raise TypeError(f"hash_to_int: {block_hash!r} is neither int nor bytes")


def event_to_dict(event: KVCacheEvent) -> dict[str, Any]:
    """A plain dict of an event with its ``"type"``; bytes hashes become hex strings."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if name in ("block_hashes",):
            value = [h.hex() if isinstance(h, bytes) else h for h in value]
        elif name == "parent_block_hash" and isinstance(value, bytes):
            value = value.hex()
        out[name] = value
    return out
