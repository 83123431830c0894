"""Snapshot of a :class:`~kvevents.index.prefix_index.PrefixIndex` to bytes and back (msgpack).

The snapshot keeps everything a restored index needs to go on exactly where the old
one stopped: holders and their slots, every block's packed tier mask in recency order
(so pruning order survives), the engine-hash map, extra copies, counters, settings, per
holder the seq of the last batch applied (``PrefixIndex.applied_seqs``, so that a router
restored from a peer's snapshot follows each stream from there: ``kvevents router
--peer``), and the KV-cache groups of hybrid holders (:mod:`kvevents.index.groups`).

Layout (version 5): a positional msgpack array whose large parts are *columns*, flat
arrays of ints that msgpack encodes and decodes in C, so that a restart from a few
hundred thousand blocks costs a few C-level passes, not a Python loop per block:

* blocks (:class:`MaskColumns`): the content keys in recency order, and per key the
  number of its mask in a table of the distinct masks. Masks repeat (a block's mask
  says which holders hold it in which tier, and there are few such combinations), so
  the table is short; its masks are little-endian bytes because they may exceed 64 bits.
  Loading builds the dict with ``dict(zip(...))`` and counts each holder's entries per
  distinct mask (``Counter`` of the mask numbers) instead of per block.
* engine hashes: the hashes and their content keys, as two parallel columns.

Version 5 adds the per-holder keys of engine hashes two namespaces share (SGLang's
token-only hashes); version 4, without them, is read as having none. Versions 1 to 3
(a list of ``(key, mask)`` pairs per block) are refused with an error naming the
version and the fix: restart the peer with this kvevents, or start without ``--peer``
(the index is then rebuilt from the streams).
This module knows only the layout; the index builds and reads it, so the index imports
this module and never the reverse.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import msgspec

from kvevents.index.types import IndexStats
from kvevents.types import Hash

__all__ = [
    "READABLE_VERSIONS",
    "SNAPSHOT_VERSION",
    "GroupSnapshot",
    "IndexSnapshot",
    "MaskColumns",
    "decode_snapshot",
    "encode_snapshot",
]

SNAPSHOT_VERSION = 5

READABLE_VERSIONS = (4, 5)
"""Snapshot versions :func:`decode_snapshot` reads."""


class MaskColumns(msgspec.Struct, array_like=True, gc=False):
    """A mask table's blocks as columns: ``keys[i]`` has mask ``masks[mask_ids[i]]``."""

    keys: list[int]
    """Content keys, oldest first (the dict's recency order)."""
    mask_ids: list[int]
    """Per key, the position of its mask in ``masks``."""
    masks: list[bytes]
    """The distinct masks, little-endian."""

    @classmethod
    def pack(cls, blocks: Mapping[int, int]) -> MaskColumns:
        """Columns of ``blocks`` (content key -> mask), in its order. O(blocks), in C."""
        values = list(blocks.values())
        distinct = list(dict.fromkeys(values))
        number = {v: i for i, v in enumerate(distinct)}
        return cls(
            keys=list(blocks),
            mask_ids=list(map(number.__getitem__, values)),
            masks=[v.to_bytes((v.bit_length() + 7) // 8, "little") for v in distinct],
        )

    def unpack(self, width: int) -> tuple[dict[int, int], list[int], dict[int, int]]:
        """The blocks dict (equal masks share one int), the distinct masks as ints, and how
        many blocks have each (by position); ValueError when the columns disagree."""
        masks = [int.from_bytes(raw, "little") for raw in self.masks]
        if len(self.keys) != len(self.mask_ids):
            raise ValueError(
                f"PrefixIndex.from_bytes: {len(self.keys)} block keys but "
                f"{len(self.mask_ids)} mask numbers; the snapshot is damaged"
            )
        try:
            if self.mask_ids and min(self.mask_ids) < 0:
                raise IndexError
            blocks = dict(zip(self.keys, map(masks.__getitem__, self.mask_ids), strict=True))
        except IndexError:
            raise ValueError(
                f"PrefixIndex.from_bytes: a mask number is not below {len(masks)}; "
                "the snapshot is damaged"
            ) from None
        if len(blocks) != len(self.keys):
            raise ValueError(
                "PrefixIndex.from_bytes: a block key appears twice; the snapshot is damaged"
            )
        if any(not v or v >> (3 * width) for v in masks):
            raise ValueError(
                f"PrefixIndex.from_bytes: a mask is empty or wider than 3 x {width} bits; "
                "the snapshot is damaged"
            )
        return blocks, masks, dict(Counter(self.mask_ids))


class GroupSnapshot(msgspec.Struct, array_like=True, gc=False):
    """One side KV-cache group: ``(kind, group_idx, sliding_window)``, its blocks and copies."""

    kind: str
    group_idx: int | None
    sliding_window: int | None
    blocks: MaskColumns
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
    blocks: MaskColumns
    hashes: list[Hash]
    """Engine hashes; ``hash_keys[i]`` is the content key of ``hashes[i]``."""
    hash_keys: list[int]
    refs: list[tuple[int, int, int, int]]
    stats: IndexStats
    seqs: list[tuple[str, int, int]]
    """``(worker, dp_rank, seq)``: the last batch applied per holder."""
    groups: list[GroupSnapshot]
    """Side KV-cache groups."""
    main_groups: list[tuple[int, int | None]]
    """``(slot, group_idx)``: each slot's main group."""
    slot_groups: list[tuple[int, int]]
    """``(slot, index into groups)``: each slot's side groups."""
    slot_keys: list[tuple[int, Hash, int]] = []
    """``(slot, engine hash, content key)``: a holder's keys under hashes another
    namespace's block holds in ``hashes`` (SGLang's token-only hashes); none in
    snapshots written before it was added."""


class _Version(msgspec.Struct, array_like=True):
    """The first field of any version's snapshot (the rest is skipped)."""

    version: int


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(IndexSnapshot)
_VERSION = msgspec.msgpack.Decoder(_Version)


def encode_snapshot(snapshot: IndexSnapshot) -> bytes:
    """The snapshot as msgpack bytes."""
    return _ENCODER.encode(snapshot)


def _refuse_version(version: int) -> ValueError:
    if 0 < version < SNAPSHOT_VERSION:
        how = (
            "it was written by an older kvevents: run the peer on this kvevents version "
            "(or start this router without --peer: the index is then rebuilt from the "
            "engines' streams)"
        )
    else:
        how = "it was written by a newer kvevents: run this router on that version"
    return ValueError(
        f"PrefixIndex.from_bytes: snapshot version {version} is not supported (this "
        f"kvevents reads version {', '.join(map(str, READABLE_VERSIONS))}); {how}"
    )


def decode_snapshot(data: bytes) -> IndexSnapshot:
    """Read :func:`encode_snapshot` bytes; ValueError names what is wrong."""
    try:
        snap = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        try:
            version = _VERSION.decode(data).version
        except msgspec.DecodeError:
            version = SNAPSHOT_VERSION
        if version != SNAPSHOT_VERSION:
            raise _refuse_version(version) from None
        raise ValueError(
            f"PrefixIndex.from_bytes: {len(data)} bytes are not an index snapshot: {exc}"
        ) from None
    if snap.version not in READABLE_VERSIONS:
        raise _refuse_version(snap.version)
    width = snap.width
    if width < 64 or width % 64 or len(snap.holders) > width:
        raise ValueError(f"PrefixIndex.from_bytes: slot width {width} is inconsistent")
    if len(snap.hashes) != len(snap.hash_keys):
        raise ValueError(
            f"PrefixIndex.from_bytes: {len(snap.hashes)} engine hashes but "
            f"{len(snap.hash_keys)} keys for them; the snapshot is damaged"
        )
    return snap
