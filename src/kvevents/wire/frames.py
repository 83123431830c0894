"""ZMQ frame layouts of live and replay messages, built and checked as pure functions.

Live message (PUB -> SUB): ``[topic, seq(8 bytes big-endian), payload]``.
Replay request (DEALER -> ROUTER): ``[b"", start_seq(8 bytes BE)]``; the ROUTER sees the
peer identity in front of it.
Replay reply (ROUTER -> DEALER): ``[b"", topic, seq, payload]`` per buffered batch (older
publishers omit the topic: ``[b"", seq, payload]``), ending with ``seq == 2**64 - 1`` and
an empty payload.

Snapshot (kvevents publishers only, on the same replay socket; docs/architecture.md, The
wire): the request is ``[b"", SNAPSHOT_TAG]``, whose second frame is never 8 bytes long,
so no publisher reads it as a replay request from a seq it holds (an upstream one that
reads any frame as a big-endian number sees a seq beyond its buffer and answers the end
marker alone). It is only ever sent to a publisher that advertises snapshots. Every
answer frame is five frames, ``[b"", SNAPSHOT_TAG, kind, seq, body]``, which no replay
reply has: ``kind`` ``b"part"`` (``body`` a msgpack batch of the rank's state, in order),
then ``b"end"`` (``body`` the 8-byte count of parts sent); or ``b"unavailable"`` alone
(``seq`` the end marker's value, ``body`` the reason in UTF-8). ``seq`` is the seq of the
last batch the state includes: the stream continues live from ``seq + 1``.

Every parser checks the frame count and lengths before unpacking: a bad frame is a
:class:`~kvevents.WireError` naming what was wrong, never a mis-decode.
"""

from __future__ import annotations

import struct

import msgspec

from kvevents.errors import WireError

__all__ = [
    "END_SEQ",
    "SNAPSHOT_TAG",
    "LiveMessage",
    "ReplayReply",
    "SnapshotReply",
    "decode_seq",
    "encode_seq",
    "is_snapshot_reply",
    "is_snapshot_request",
    "live_frames",
    "parse_live_frames",
    "parse_replay_reply",
    "parse_replay_request",
    "parse_snapshot_reply",
    "replay_end_frames",
    "replay_reply_frames",
    "replay_request_frames",
    "snapshot_end_frames",
    "snapshot_part_frames",
    "snapshot_request_frames",
    "snapshot_unavailable_frames",
]

END_SEQ = 0xFFFFFFFFFFFFFFFF
"""Sequence number of the replay end marker."""

SNAPSHOT_TAG = b"kvevents.snapshot.v1"
"""The frame that marks a snapshot request and every frame of its answer."""

_SEQ = struct.Struct(">Q")
_SNAPSHOT_KINDS = (b"part", b"end", b"unavailable")


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


class SnapshotReply(msgspec.Struct, frozen=True, gc=False):
    """One frame of a snapshot answer: ``kind`` is "part", "end" or "unavailable".

    ``seq``: the seq of the last batch the state includes. ``body``: a part's payload
    (a msgpack batch), the end's count of parts, or the reason a snapshot is unavailable.
    """

    kind: str
    seq: int
    body: bytes

    @property
    def parts(self) -> int:
        """The count of parts an ``end`` frame announces."""
        return decode_seq(self.body)

    @property
    def reason(self) -> str:
        """Why an ``unavailable`` answer has no snapshot."""
        return self.body.decode("utf-8", "replace")


def snapshot_request_frames() -> list[bytes]:
    """What a DEALER sends to ask a kvevents publisher for its rank's whole state."""
    return [b"", SNAPSHOT_TAG]


def is_snapshot_request(frames: list[bytes]) -> bool:
    """Whether a request as a ROUTER receives it (identity first) asks for a snapshot."""
    return len(frames) == 3 and len(frames[1]) == 0 and frames[2] == SNAPSHOT_TAG


def snapshot_part_frames(seq: int, payload: bytes) -> list[bytes]:
    """One part of a snapshot answer (without the ROUTER identity in front)."""
    return [b"", SNAPSHOT_TAG, b"part", _SEQ.pack(seq), payload]


def snapshot_end_frames(seq: int, parts: int) -> list[bytes]:
    """The frame that closes a complete snapshot answer of ``parts`` parts."""
    return [b"", SNAPSHOT_TAG, b"end", _SEQ.pack(seq), _SEQ.pack(parts)]


def snapshot_unavailable_frames(reason: str) -> list[bytes]:
    """The whole answer of a publisher that cannot give a snapshot now, saying why."""
    return [b"", SNAPSHOT_TAG, b"unavailable", _SEQ.pack(END_SEQ), reason.encode()]


def is_snapshot_reply(frames: list[bytes]) -> bool:
    """Whether frames a DEALER received belong to a snapshot answer (five, tagged)."""
    return len(frames) == 5 and bytes(frames[1]) == SNAPSHOT_TAG


def parse_snapshot_reply(frames: list[bytes]) -> SnapshotReply:
    """Check and unpack ``[b"", SNAPSHOT_TAG, kind, seq, body]``; anything else is a WireError."""
    if len(frames) != 5 or len(frames[0]) != 0 or bytes(frames[1]) != SNAPSHOT_TAG:
        raise WireError(
            f"snapshot reply has {len(frames)} frames, expected 5 "
            "[b'', SNAPSHOT_TAG, kind, seq, body]"
        )
    kind = bytes(frames[2])
    if kind not in _SNAPSHOT_KINDS:
        raise WireError(f"snapshot reply kind {kind[:20]!r} is not one of part, end, unavailable")
    seq = decode_seq(frames[3])
    body = bytes(frames[4])
    if kind == b"end" and len(body) != 8:
        raise WireError(f"snapshot end frame's count has {len(body)} bytes, expected 8")
    return SnapshotReply(kind.decode(), seq, body)
