"""KV-event payloads: a batch as msgpack bytes, in both event encodings, and back.

A payload is the msgpack of a batch, always a positional array ``[ts, events, dp_rank]``
(some publishers send ``[ts, events]``). Events come in two encodings and a decoder
accepts both, even mixed within one batch:

* **map** (what current SGLang and vLLM send): ``{"type": "BlockStored", field: value,
  ...}``. Optional trailing fields whose value is nil are omitted, exactly as SGLang
  does, so our bytes equal SGLang's for the same batch.
* **array** (older engines): ``["BlockStored", f1, f2, ...]`` in declaration order up to
  ``medium``; after it, each engine's own order (:func:`_stored_layout` tells them
  apart). Trailing fields may be missing (defaults apply) or extra (ignored).

Encoders and decoders are built once, at import. Everything here is a pure function of
bytes; sockets live in the publisher and subscriber.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from kvevents.errors import WireError
from kvevents.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVCacheEvent,
    KVEventBatch,
)

__all__ = ["decode_batch", "encode_batch"]

_EVENT_TYPES: tuple[type[KVCacheEvent], ...] = (BlockStored, BlockRemoved, AllBlocksCleared)

# --- array (positional) encoding -------------------------------------------------------
# Generated from the map structs so the two layouts can never drift apart. Every field
# gets a default so that short arrays from older publishers decode.


def _lenient_field(f: msgspec.structs.FieldInfo) -> tuple[Any, ...]:
    """``f`` as a ``defstruct`` field with a default, so that short events decode."""
    if f.name in _LIST_FIELDS:
        return (f.name, f.type, msgspec.field(default_factory=list))
    return (f.name, f.type, _LENIENT_DEFAULTS.get(f.name) if f.required else f.default)


def _array_twin(cls: type[KVCacheEvent]) -> type[msgspec.Struct]:
    """A positional, tagged decoding twin of ``cls`` in which every field has a default."""
    fields = [_lenient_field(f) for f in msgspec.structs.fields(cls)]
    return msgspec.defstruct(cls.__name__, fields, tag=cls.__name__, array_like=True, gc=False)


def _positional(event: KVCacheEvent) -> list[Any] | KVCacheEvent:
    """``[tag, f1, f2, ...]`` with trailing optional fields left out while they are nil;
    a ``BlockStored`` in its engine's layout (see :func:`_stored_layout`), or the event
    itself (a tagged map) when no positional layout holds it unambiguously."""
    if type(event) is BlockStored:
        return _positional_stored(event)
    values = [getattr(event, name) for name in event.__struct_fields__]
    keep = _REQUIRED_COUNT[type(event)]
    while len(values) > keep and values[-1] is None:
        values.pop()
    return [type(event).__name__, *values]


# --- BlockStored: two positional layouts ------------------------------------------------
# After the six shared fields, SGLang's positional BlockStored goes on with cache_salt,
# session_id, lora_name; vLLM's with lora_name, extra_keys, group_idx, kv_cache_spec_kind,
# kv_cache_spec_sliding_window. The types of the fields that follow tell them apart.

_SHARED_STORED = 6
_SGLANG_TAIL: tuple[str, ...] = ("cache_salt", "session_id", "lora_name")
_VLLM_TAIL: tuple[str, ...] = (
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)


def _stored_layout(tail: list[Any]) -> tuple[str, ...]:
    """Which engine's fields follow ``medium`` in a positional ``BlockStored``.

    vLLM's when there are more than three, or the second is a list (``extra_keys``) or
    the third an int (``group_idx``); SGLang's when the second or third is a string
    (``session_id``, ``lora_name``). A lone string (with nils) is ambiguous: it is read
    as SGLang's ``cache_salt``, as it always was here, though vLLM's ``lora_name`` alone
    looks the same (our own encoder never writes that: such an event goes as a map).
    """
    n = len(tail)
    if n > 3 or (n > 1 and isinstance(tail[1], list)) or (n > 2 and type(tail[2]) is int):
        return _VLLM_TAIL
    if (n > 1 and isinstance(tail[1], str)) or (n > 2 and isinstance(tail[2], str)):
        return _SGLANG_TAIL
    return _SGLANG_TAIL if n and isinstance(tail[0], str) else _VLLM_TAIL


def _positional_stored(event: BlockStored) -> list[Any] | BlockStored:
    sglang_only = event.cache_salt is not None or event.session_id is not None
    vllm_only = (
        event.extra_keys is not None
        or event.group_idx is not None
        or event.kv_cache_spec_kind is not None
        or event.kv_cache_spec_sliding_window is not None
    )
    if sglang_only and vllm_only:
        return event  # no engine's layout holds both
    layout = _SGLANG_TAIL if sglang_only else _VLLM_TAIL
    tail = [getattr(event, name) for name in layout]
    while tail and tail[-1] is None:
        tail.pop()
    if _stored_layout(tail) is not layout:
        return event  # vLLM's lora_name alone would read as SGLang's cache_salt
    shared = [getattr(event, name) for name in event.__struct_fields__[:_SHARED_STORED]]
    return ["BlockStored", *shared, *tail]


def _stored_twin(tail: tuple[str, ...]) -> type[msgspec.Struct]:
    """A positional decoding twin of BlockStored with the shared fields and ``tail``."""
    by_name = {f.name: f for f in msgspec.structs.fields(BlockStored)}
    names = [*BlockStored.__struct_fields__[:_SHARED_STORED], *tail]
    fields = [_lenient_field(by_name[name]) for name in names]
    return msgspec.defstruct("BlockStored", fields, tag="BlockStored", array_like=True, gc=False)


_LIST_FIELDS = ("block_hashes", "token_ids")
_LENIENT_DEFAULTS: dict[str, Any] = {"block_size": 0}

_REQUIRED_COUNT = {
    cls: sum(f.required for f in msgspec.structs.fields(cls)) for cls in _EVENT_TYPES
}
_ARRAY_DECODE = {cls: _array_twin(cls) for cls in _EVENT_TYPES}
_ARRAY_TO_PUBLIC = {twin: cls for cls, twin in _ARRAY_DECODE.items()}
_MAP_LENIENT = {
    cls: msgspec.defstruct(
        cls.__name__,
        [_lenient_field(f) for f in msgspec.structs.fields(cls)],
        tag=cls.__name__,
        tag_field="type",
        gc=False,
    )
    for cls in _EVENT_TYPES
}
_MAP_LENIENT_TO_PUBLIC = {twin: cls for cls, twin in _MAP_LENIENT.items()}

_ArrayEvent = Union[tuple(_ARRAY_DECODE.values())]  # type: ignore[valid-type]  # noqa: UP007
_STORED_DECODERS = {
    layout: msgspec.msgpack.Decoder(_stored_twin(layout)) for layout in (_SGLANG_TAIL, _VLLM_TAIL)
}
_GENERIC_DECODER = msgspec.msgpack.Decoder()
_LenientMapEvent = Union[tuple(_MAP_LENIENT.values())]  # type: ignore[valid-type]  # noqa: UP007


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_BATCH_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_RAW_BATCH_DECODER = msgspec.msgpack.Decoder(_RawBatch)
_ARRAY_EVENT_DECODER = msgspec.msgpack.Decoder(_ArrayEvent)
_LENIENT_MAP_EVENT_DECODER = msgspec.msgpack.Decoder(_LenientMapEvent)


def _to_public(obj: msgspec.Struct, cls: type[KVCacheEvent]) -> Event:
    event: Event = cls(**{f: getattr(obj, f) for f in obj.__struct_fields__})  # type: ignore[assignment]
    return event


def encode_batch(batch: KVEventBatch, encoding: Literal["map", "array"] = "map") -> bytes:
    """Encode a batch to its msgpack payload.

    ``encoding="map"`` gives tagged maps (current SGLang and vLLM, byte for byte);
    ``"array"`` gives positional events as older engines sent them.
    """
    if encoding == "map":
        return _ENCODER.encode(batch)
    if encoding == "array":
        events = [_positional(ev) for ev in batch.events]
        return _ENCODER.encode((batch.ts, events, batch.data_parallel_rank))
    raise ValueError(f"encode_batch: encoding={encoding!r} is not one of 'map', 'array'")


_KNOWN_TAGS = frozenset(cls.__name__ for cls in _EVENT_TYPES)


def _decode_event(raw: msgspec.Raw, unknown: list[str] | None) -> Event | None:
    """One event; None for an event type this decoder does not know (named in
    ``unknown`` when given), which a newer engine may send beside the known ones."""
    data = bytes(raw)
    if data and (data[0] & 0xF0 == 0x90 or data[0] in (0xDC, 0xDD)):  # msgpack array
        items = _GENERIC_DECODER.decode(data)
        tag = items[0] if items else None
        if tag == "BlockStored":
            layout = _stored_layout(items[1 + _SHARED_STORED :])
            return _to_public(_STORED_DECODERS[layout].decode(data), BlockStored)
        if isinstance(tag, str) and tag not in _KNOWN_TAGS:
            if unknown is not None:
                unknown.append(tag)
            return None
        twin = _ARRAY_EVENT_DECODER.decode(data)
        return _to_public(twin, _ARRAY_TO_PUBLIC[type(twin)])
    try:
        twin = _LENIENT_MAP_EVENT_DECODER.decode(data)
    except msgspec.DecodeError:
        whole = _GENERIC_DECODER.decode(data)
        tag = whole.get("type") if isinstance(whole, dict) else None
        if not isinstance(tag, str) or tag in _KNOWN_TAGS:
            raise
        if unknown is not None:
            unknown.append(tag)
        return None
    return _to_public(twin, _MAP_LENIENT_TO_PUBLIC[type(twin)])


def decode_batch(payload: bytes | memoryview, unknown: list[str] | None = None) -> KVEventBatch:
    """Decode a payload in either encoding into a :class:`KVEventBatch`.

    The common case (complete tagged maps) takes one msgspec call. Anything else
    (positional events, short or long arrays, omitted nil fields, a mix) falls back to
    decoding event by event. An event of a type not known here (a newer engine's) is
    left out of the batch, its type appended to ``unknown`` when given: the batch's
    other events stand. Raises :class:`~kvevents.errors.WireError` naming what is wrong
    when the payload is not a batch, or a known event in it is malformed.
    """
    try:
        return _BATCH_DECODER.decode(payload)
    except msgspec.DecodeError:
        pass
    try:
        raw = _RAW_BATCH_DECODER.decode(payload)
        events = [e for r in raw.events if (e := _decode_event(r, unknown)) is not None]
    except msgspec.DecodeError as exc:
        raise WireError(
            f"payload of {len(payload)} bytes is not a KV-event batch [ts, events, dp_rank]: {exc}"
        ) from None
    return KVEventBatch(ts=raw.ts, events=events, data_parallel_rank=raw.data_parallel_rank)
