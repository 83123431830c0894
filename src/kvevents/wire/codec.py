"""KV-event payloads: a batch as msgpack bytes, in both event encodings, and back.

A payload is the msgpack of a batch, always a positional array ``[ts, events, dp_rank]``
(older publishers send ``[ts, events]``). Events come in two encodings and a decoder
accepts both, even mixed within one batch:

* **map** (SGLang and vLLM since 2026): ``{"type": "BlockStored", field: value, ...}``.
  Optional trailing fields whose value is nil are omitted, exactly as SGLang does, so
  our bytes equal SGLang's for the same batch.
* **array** (older engines): ``["BlockStored", f1, f2, ...]`` in declaration order.
  Trailing fields may be missing (defaults apply) or extra (ignored); a positional array
  longer than six fields is read in declaration order.

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


def _array_twin(cls: type[KVCacheEvent]) -> type[msgspec.Struct]:
    """A positional, tagged decoding twin of ``cls`` in which every field has a default."""
    fields: list[tuple[Any, ...]] = []
    for f in msgspec.structs.fields(cls):
        if f.name in _LIST_FIELDS:
            fields.append((f.name, f.type, msgspec.field(default_factory=list)))
        else:
            default = _LENIENT_DEFAULTS.get(f.name) if f.required else f.default
            fields.append((f.name, f.type, default))
    return msgspec.defstruct(cls.__name__, fields, tag=cls.__name__, array_like=True, gc=False)


def _positional(event: KVCacheEvent) -> list[Any]:
    """``[tag, f1, f2, ...]`` with trailing optional fields left out while they are nil."""
    values = [getattr(event, name) for name in event.__struct_fields__]
    keep = _REQUIRED_COUNT[type(event)]
    while len(values) > keep and values[-1] is None:
        values.pop()
    return [type(event).__name__, *values]


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
        [
            (f.name, f.type, msgspec.field(default_factory=list))
            if f.name in _LIST_FIELDS
            else (f.name, f.type, _LENIENT_DEFAULTS.get(f.name) if f.required else f.default)
            for f in msgspec.structs.fields(cls)
        ],
        tag=cls.__name__,
        tag_field="type",
        gc=False,
    )
    for cls in _EVENT_TYPES
}
_MAP_LENIENT_TO_PUBLIC = {twin: cls for cls, twin in _MAP_LENIENT.items()}

_ArrayEvent = Union[tuple(_ARRAY_DECODE.values())]  # type: ignore[valid-type]  # noqa: UP007
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


def _decode_event(raw: msgspec.Raw) -> Event:
    data = bytes(raw)
    if data and (data[0] & 0xF0 == 0x90 or data[0] in (0xDC, 0xDD)):  # msgpack array
        twin = _ARRAY_EVENT_DECODER.decode(data)
        return _to_public(twin, _ARRAY_TO_PUBLIC[type(twin)])
    twin = _LENIENT_MAP_EVENT_DECODER.decode(data)
    return _to_public(twin, _MAP_LENIENT_TO_PUBLIC[type(twin)])


def decode_batch(payload: bytes | memoryview) -> KVEventBatch:
    """Decode a payload in either encoding into a :class:`KVEventBatch`.

    The common case (complete tagged maps) takes one msgspec call. Anything else
    (positional events, short or long arrays, omitted nil fields, a mix) falls back to
    decoding event by event. Raises :class:`~kvevents.errors.WireError` naming what is
    wrong when the payload is not a batch.
    """
    try:
        return _BATCH_DECODER.decode(payload)
    except msgspec.DecodeError:
        pass
    try:
        raw = _RAW_BATCH_DECODER.decode(payload)
        events = [_decode_event(r) for r in raw.events]
    except msgspec.DecodeError as exc:
        raise WireError(
            f"payload of {len(payload)} bytes is not a KV-event batch [ts, events, dp_rank]: {exc}"
        ) from None
    return KVEventBatch(ts=raw.ts, events=events, data_parallel_rank=raw.data_parallel_rank)
