"""Snapshot of a :class:`~kvevents.index.PrefixIndex` to bytes and back (msgpack).

The snapshot keeps everything a restored index needs to go on exactly where the old
one stopped: holders and their slots, every block's packed tier mask in recency order
(so pruning order survives), the engine-hash map, extra copies, counters and settings.
Derived figures (entry counts per holder, the live-slot mask) are recomputed on load.

Layout (a positional msgpack array, version 1); masks are little-endian bytes because
they may exceed 64 bits. Restoring costs O(blocks + hashes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from kvevents.index_types import IndexStats, TierCredits
from kvevents.signals import Holder
from kvevents.wire import Hash

if TYPE_CHECKING:
    from kvevents.index import PrefixIndex

__all__ = ["SNAPSHOT_VERSION", "decode_snapshot", "encode_snapshot"]

SNAPSHOT_VERSION = 1


class _Snapshot(msgspec.Struct, array_like=True, gc=False):
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


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Snapshot)


def _mask_bytes(v: int) -> bytes:
    return v.to_bytes((v.bit_length() + 7) // 8, "little")


def encode_snapshot(index: PrefixIndex) -> bytes:
    """The whole index as msgpack bytes."""
    index._flush_touches()
    snap = _Snapshot(
        version=SNAPSHOT_VERSION,
        block_size=index.block_size,
        max_entries=index.max_entries,
        credits=index.credits.as_tuple(),
        width=index._width,
        holders=[None if h is None else (h.worker, h.dp_rank) for h in index._holders],
        slot_block_size=list(index._slot_block_size),
        blocks=[(k, _mask_bytes(v)) for k, v in index._blocks.items()],
        hashes=list(index._hashes.items()),
        refs=[(k, s, t, n) for (k, s, t), n in index._refs.items()],
        stats=index.stats,
    )
    return _ENCODER.encode(snap)


def decode_snapshot(data: bytes) -> PrefixIndex:
    """Rebuild an index from :func:`encode_snapshot` bytes; ValueError names what is wrong."""
    from kvevents.index import PrefixIndex

    try:
        snap = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(
            f"PrefixIndex.from_bytes: {len(data)} bytes are not an index snapshot: {exc}"
        ) from None
    if snap.version != SNAPSHOT_VERSION:
        raise ValueError(
            f"PrefixIndex.from_bytes: snapshot version {snap.version} is not supported "
            f"(this kvevents reads version {SNAPSHOT_VERSION}); rebuild the index from the streams"
        )
    gpu, cpu, disk = snap.credits
    index = PrefixIndex(
        block_size=snap.block_size,
        max_entries=snap.max_entries,
        credits=TierCredits(gpu=gpu, cpu=cpu, disk=disk),
    )
    width = snap.width
    if width < 64 or width % 64 or len(snap.holders) > width:
        raise ValueError(f"PrefixIndex.from_bytes: slot width {width} is inconsistent")
    index._width = width
    for slot, pair in enumerate(snap.holders):
        holder = None if pair is None else Holder(*pair)
        index._holders.append(holder)
        index._slot_block_size.append(snap.slot_block_size[slot])
        index._held.append(0)
        if holder is None:
            index._free.append(slot)
        else:
            index._slots[holder] = slot
            index._live |= 1 << slot
    held = index._held
    entries = offloaded = 0
    for key, raw in snap.blocks:
        v = int.from_bytes(raw, "little")
        index._blocks[key] = v
        entries += v.bit_count()
        offloaded += (v >> width).bit_count()
        while v:
            low = v & -v
            held[(low.bit_length() - 1) % width] += 1
            v ^= low
    index._entries = entries
    index._offloaded = offloaded
    index._hashes = dict(snap.hashes)
    index._refs = {(k, s, t): n for k, s, t, n in snap.refs}
    index.stats = snap.stats
    return index
