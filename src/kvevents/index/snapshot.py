"""Snapshot of a :class:`~kvevents.index.prefix_index.PrefixIndex` to bytes and back (msgpack).

The snapshot keeps everything a restored index needs to go on exactly where the old
one stopped: holders and their slots, every block's packed tier mask in recency order
(so pruning order survives), the engine-hash map, extra copies, counters and settings.
Derived figures (entry counts per holder, the live-slot mask) are recomputed on load.

Layout: a positional msgpack array; masks are little-endian bytes because they may
exceed 64 bits. Restoring costs O(blocks + hashes). Version 2 appends ``seqs``: per
holder, the seq of the last batch applied (``PrefixIndex.applied_seqs``), so that a
router restored from a peer's snapshot follows each stream from there (``kvevents router
--peer``). Version 3 appends the KV-cache groups of hybrid holders
(:mod:`kvevents.index.groups`): each side group's key and blocks (masks in recency order,
extra copies), each slot's main ``group_idx`` and its side groups. Versions 1 and 2 are
still read (no seqs in 1: every stream is followed from its start; no groups in either:
they predate them); other versions are refused. This module knows only the layout; the index
builds and reads it, so the index imports this module and never the reverse.
"""

from __future__ import annotations

import msgspec

from kvevents.index.types import IndexStats
from kvevents.types import Hash

__all__ = [
    "READABLE_VERSIONS",
    "SNAPSHOT_VERSION",
    "GroupSnapshot",
    "IndexSnapshot",
    "decode_snapshot",
    "encode_snapshot",
    "mask_bytes",
]

SNAPSHOT_VERSION = 3

READABLE_VERSIONS = (1, 2, 3)
"""Snapshot versions :func:`decode_snapshot` reads (a version 1 snapshot has no seqs)."""


class GroupSnapshot(msgspec.Struct, array_like=True, gc=False):
    """One side KV-cache group: ``(kind, group_idx, sliding_window)``, its blocks and copies."""

    kind: str
    group_idx: int | None
    sliding_window: int | None
    blocks: list[tuple[int, bytes]]
    refs: list[tuple[int, int, int, int]]


class IndexSnapshot(msgspec.Struct, array_like=True, gc=False):
    """Everything a restored index needs; built and read by :class:`PrefixIndex` itself."""

    version: int
    block_size: int | None
    max_entries: int
    credits: tuple[float, float, float]
    width: int
    holders: list[tuple[str, int] | None]
    slot_block_size: list[int | None]
    blocks: list[tuple[int, bytes]]
    hashes: list[tuple[Hash, int]]
    refs: list[tuple[int, int, int, int]]
    stats: IndexStats
    seqs: list[tuple[str, int, int]] = []
    """``(worker, dp_rank, seq)``: the last batch applied per holder (version 2)."""
    groups: list[GroupSnapshot] = []
    """Side KV-cache groups (version 3)."""
    main_groups: list[tuple[int, int | None]] = []
    """``(slot, group_idx)``: each slot's main group (version 3)."""
    slot_groups: list[tuple[int, int]] = []
    """``(slot, index into groups)``: each slot's side groups (version 3)."""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(IndexSnapshot)


def mask_bytes(v: int) -> bytes:
    """A packed mask as little-endian bytes (masks may exceed 64 bits)."""
    return v.to_bytes((v.bit_length() + 7) // 8, "little")


def encode_snapshot(snapshot: IndexSnapshot) -> bytes:
    """The snapshot as msgpack bytes."""
    return _ENCODER.encode(snapshot)


def decode_snapshot(data: bytes) -> IndexSnapshot:
    """Read :func:`encode_snapshot` bytes; ValueError names what is wrong."""
    try:
        snap = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(
            f"PrefixIndex.from_bytes: {len(data)} bytes are not an index snapshot: {exc}"
        ) from None
    if snap.version not in READABLE_VERSIONS:
        raise ValueError(
            f"PrefixIndex.from_bytes: snapshot version {snap.version} is not supported "
            f"(this kvevents reads versions {', '.join(map(str, READABLE_VERSIONS))}); "
            "rebuild the index from the streams"
        )
    width = snap.width
    if width < 64 or width % 64 or len(snap.holders) > width:
        raise ValueError(f"PrefixIndex.from_bytes: slot width {width} is inconsistent")
    return snap
