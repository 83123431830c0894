"""The KV-event wire format: event structs, both encodings, live and replay frames.

Payloads
--------
A payload is the msgpack of a batch, always a positional array ``[ts, events, dp_rank]``
(older publishers send ``[ts, events]``). Events come in two encodings and a decoder
accepts both, even mixed within one batch:

* **map** (SGLang and vLLM since 2026): ``{"type": "BlockStored", field: value, ...}``.
  Optional trailing fields whose value is nil are omitted, exactly as SGLang does, so
  our bytes equal SGLang's for the same batch.
* **array** (older engines): ``["BlockStored", f1, f2, ...]`` in declaration order.
  Trailing fields may be missing (defaults apply) or extra (ignored).

Fields beyond the six shared ones of ``BlockStored`` are declared in SGLang's order
(``cache_salt``, ``session_id``, ``lora_name``) followed by vLLM's additions. A map
decoder does not care about order; a positional array longer than six fields is read in
this order.

Hashes
------
Engine block hashes are kept exactly as sent: SGLang sends signed int64, vLLM unsigned
uint64 (often above 2**63) or 32 raw bytes. :func:`hash_to_int` folds any of them into
one unsigned 64-bit integer for callers that want a fixed-width key: an int is taken
modulo 2**64 (so a signed int64 and its unsigned twin agree), and bytes are read as
the big-endian integer of their last eight bytes, which is the value vLLM sends in its
int mode for the same digest.

Frames
------
Live message (PUB -> SUB): ``[topic, seq(8 bytes big-endian), payload]``.
Replay request (DEALER -> ROUTER): ``[b"", start_seq(8 bytes BE)]``; the ROUTER sees the
peer identity in front of it.
Replay reply (ROUTER -> DEALER): ``[b"", topic, seq, payload]`` per buffered batch (older
publishers omit the topic: ``[b"", seq, payload]``), ending with ``seq == 2**64 - 1`` and
an empty payload.

Everything here is a pure function of bytes; sockets live in the publisher and
subscriber.
"""

from __future__ import annotations

import struct
from typing import Any, Literal, Union

import msgspec

from kvevents.errors import WireError

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Hash",
    "KVCacheEvent",
    "KVEventBatch",
    "LiveMessage",
    "ReplayReply",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
    "event_to_dict",
    "hash_to_int",
    "live_frames",
    "parse_live_frames",
    "parse_replay_reply",
    "parse_replay_request",
    "replay_end_frames",
    "replay_reply_frames",
    "replay_request_frames",
]

Hash = int | bytes
"""An engine block hash: int (signed or unsigned 64-bit) or 32 raw bytes."""

END_SEQ = 0xFFFFFFFFFFFFFFFF
"""Sequence number of the replay end marker."""

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
_EVENT_TYPES: tuple[type[KVCacheEvent], ...] = (BlockStored, BlockRemoved, AllBlocksCleared)


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


# --- frames ------------------------------------------------------------------------------

_SEQ = struct.Struct(">Q")


def encode_seq(seq: int) -> bytes:
    """8-byte big-endian sequence number."""
    return _SEQ.pack(seq)


def decode_seq(frame: bytes | memoryview) -> int:
    """Read an 8-byte big-endian sequence number; a frame of another length is a WireError."""
    if len(frame) != 8:
        raise WireError(f"sequence frame has {len(frame)} bytes, expected 8 (big-endian u64)")
    return int(_SEQ.unpack(frame)[0])


class LiveMessage(msgspec.Struct, frozen=True, gc=False):
    """One live message: ``[topic, seq, payload]``."""

    topic: bytes
    seq: int
    payload: bytes


class ReplayReply(msgspec.Struct, frozen=True, gc=False):
    """One replay reply; ``is_end`` marks the end marker. ``topic`` is None in the 3-frame form."""

    topic: bytes | None
    seq: int
    payload: bytes

    @property
    def is_end(self) -> bool:
        return self.seq == END_SEQ


def live_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """Frames of a live message."""
    return [topic, _SEQ.pack(seq), payload]


def parse_live_frames(frames: list[bytes]) -> LiveMessage:
    """Check and unpack ``[topic, seq, payload]``; anything else is a WireError."""
    if len(frames) != 3:
        raise WireError(f"live message has {len(frames)} frames, expected 3 [topic, seq, payload]")
    topic, seq, payload = frames
    return LiveMessage(bytes(topic), decode_seq(seq), bytes(payload))


def replay_request_frames(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch with ``seq >= start_seq``."""
    return [b"", _SEQ.pack(start_seq)]


def parse_replay_request(frames: list[bytes]) -> tuple[bytes, int]:
    """Unpack ``[identity, b"", start_seq]`` as a ROUTER receives it.

    Returns ``(identity, start_seq)``. A request with the wrong shape raises WireError;
    when the identity is present it is still returned via ``WireError.identity`` so the
    publisher can answer with the end marker.
    """
    if not frames:
        raise WireError("replay request has no frames")
    identity = bytes(frames[0])
    if len(frames) != 3 or len(frames[1]) != 0:
        err = WireError(
            f"replay request has {len(frames) - 1} frames after the identity, "
            "expected 2 [b'', start_seq]"
        )
        err.identity = identity  # type: ignore[attr-defined]
        raise err
    try:
        return identity, decode_seq(frames[2])
    except WireError as exc:
        exc.identity = identity  # type: ignore[attr-defined]
        raise


def replay_reply_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One 4-frame replay reply (without the ROUTER identity in front)."""
    return [b"", topic, _SEQ.pack(seq), payload]


def replay_end_frames() -> list[bytes]:
    """The end marker that closes every replay answer."""
    return [b"", b"", _SEQ.pack(END_SEQ), b""]


def parse_replay_reply(frames: list[bytes]) -> ReplayReply:
    """Unpack a reply as a DEALER receives it: ``[b"", topic, seq, payload]`` or ``[b"", seq, payload]``."""
    if len(frames) == 4 and len(frames[0]) == 0:
        return ReplayReply(bytes(frames[1]), decode_seq(frames[2]), bytes(frames[3]))
    if len(frames) == 3 and len(frames[0]) == 0:
        return ReplayReply(None, decode_seq(frames[1]), bytes(frames[2]))
    raise WireError(
        f"replay reply has {len(frames)} frames, expected [b'', topic, seq, payload] "
        "or [b'', seq, payload]"
    )
