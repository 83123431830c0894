"""Value types of the prefix index: tiers, media, credits, counters, match results.

Tiers
-----
A holder may keep a block in three tiers, fastest first: ``gpu`` (device memory),
``cpu`` (host memory) and ``disk`` (local or remote storage). Engines name the medium
in ``BlockStored`` / ``BlockRemoved``; :func:`normalize_medium` maps their names:

==================================  ======  ===========================================
medium as sent                      tier    why
==================================  ======  ===========================================
nil, ``GPU``, ``CUDA``, ``DEVICE``   gpu     nil means GPU on the wire (architecture.md §3)
``CPU``, ``CPU_PINNED``, ``HOST``   cpu     vLLM says CPU, SGLang CPU_PINNED
``DISK``, ``STORAGE``, ``SSD``      disk    local storage tiers
``EXTERNAL``                        disk    an external KV store (LMCache, Mooncake
                                            store) is reached over the network or
                                            storage; its reload cost is that of disk
anything else                       disk    counted as ``unknown_medium``: the block
                                            is kept, at the lowest credit
==================================  ======  ===========================================

Names are compared case-insensitively.

Match lengths per tier
----------------------
A match reports, per holder, three *nested* prefix lengths in blocks: ``gpu`` blocks
all held on GPU, then ``cpu`` more blocks each held on GPU or CPU, then ``disk`` more
blocks each held in some tier. This is how an engine with a tiered cache serves a
prompt: the device prefix first, then the host continuation, then storage. A block
inside the CPU part may also be on GPU; it is still loaded after a GPU miss, so it
counts at CPU credit.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import IntEnum
from typing import Any, NamedTuple

import msgspec

from kvevents.types import Holder

__all__ = [
    "DEFAULT_CREDITS",
    "HolderMatch",
    "IndexStats",
    "PrefixMatch",
    "Tier",
    "TierCredits",
    "iter_bits",
    "normalize_medium",
]


class Tier(IntEnum):
    """Cache tiers, fastest first."""

    GPU = 0
    CPU = 1
    DISK = 2


_MEDIA: dict[str, Tier] = {
    "GPU": Tier.GPU,
    "CUDA": Tier.GPU,
    "DEVICE": Tier.GPU,
    "CPU": Tier.CPU,
    "CPU_PINNED": Tier.CPU,
    "HOST": Tier.CPU,
    "DISK": Tier.DISK,
    "STORAGE": Tier.DISK,
    "SSD": Tier.DISK,
    "EXTERNAL": Tier.DISK,
}


def normalize_medium(medium: str | None) -> tuple[Tier, bool]:
    """The tier of an engine's medium name, and whether the name was known.

    Unknown names map to :attr:`Tier.DISK` with ``known=False`` (the caller counts them).
    """
    if medium is None:
        return Tier.GPU, True
    tier = _MEDIA.get(medium) or _MEDIA.get(medium.upper())
    if tier is None:
        return Tier.DISK, False
    return tier, True


class TierCredits(msgspec.Struct, frozen=True, kw_only=True):
    """How much one cached block is worth per tier, relative to computing it (1.0 = free).

    Defaults: GPU 1.0, CPU 0.75 (a host-to-device copy), disk 0.25 (a storage read).
    Each credit must be within ``0..1``.
    """

    gpu: float = 1.0
    cpu: float = 0.75
    disk: float = 0.25

    def __post_init__(self) -> None:
        for name in ("gpu", "cpu", "disk"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"TierCredits: {name}={value!r} must be between 0 and 1 "
                    "(the fraction of a block's prefill a cached copy saves)"
                )
            if value == 0.0 and isinstance(value, float):
                # -0.0 passes the bound but would make "nothing cached" -0.0, a figure
                # the router's answers would carry and its kept rankings tell apart
                msgspec.structs.force_setattr(self, name, 0.0)

    def as_tuple(self) -> tuple[float, float, float]:
        return (self.gpu, self.cpu, self.disk)


DEFAULT_CREDITS = TierCredits()


class IndexStats(msgspec.Struct, kw_only=True):
    """Counters of a :class:`~kvevents.index.prefix_index.PrefixIndex`; every silent-miss path has one.

    ``events`` counts applied events by ``(type, outcome)``; an event's outcome is
    ``"ok"`` or the first problem met while applying it (one of the counter names below).
    """

    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    unknown_parent: int = 0
    """Stored chains whose parent hash this holder did not hold (events were missed)."""
    unknown_hash: int = 0
    """Removals or tier copies of a hash this holder did not hold."""
    block_size_mismatch: int = 0
    """Stored chains whose block size differs from the advertised one."""
    unknown_medium: int = 0
    """Events naming a medium :func:`normalize_medium` does not know."""
    malformed: int = 0
    """Stored chains whose token count is not ``len(block_hashes) * block_size`` (a
    sliding-window group's chain may name fewer blocks than its tokens cover, even none,
    but not more; it must say its window)."""
    pruned_entries: int = 0
    """(block, holder, tier) entries dropped by the memory bound."""
    unsupported_group: int = 0
    """Stored chains of a KV-cache group kind the index does not model (Mamba, ...)."""
    lookups: int = 0
    events: dict[str, int] = msgspec.field(default_factory=dict)

    def count_event(self, kind: str, outcome: str) -> None:
        key = f"{kind}:{outcome}"
        self.events[key] = self.events.get(key, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


class HolderMatch(NamedTuple):
    """One holder's longest cached prefix of a request, in blocks per tier (nested, see module doc)."""

    gpu: int
    cpu: int
    disk: int

    @property
    def blocks(self) -> int:
        """Blocks of the prefix cached in some tier."""
        return self.gpu + self.cpu + self.disk


class PrefixMatch(msgspec.Struct, gc=False):
    """The result of :meth:`PrefixIndex.match`: every holder's longest cached prefix.

    Stored compactly as *segments*: per tier a list of ``(slot_mask, length)`` pairs,
    meaning the holders in ``slot_mask`` have a prefix of exactly ``length`` blocks in
    that tier (cumulatively, see the module docstring). Building it costs O(number of
    distinct lengths); expanding to per-holder values costs O(holders).
    """

    holders: list[Holder | None]
    """The index's slot table (slot -> holder), shared, not copied."""
    segments: tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]
    n_blocks: int
    """Blocks of the request the match looked at: its full blocks, or as many as an engine
    reuses of it when the caller said (``match_keys(..., reusable=)``)."""
    block_size: int | None

    def _cumulative(self, tier: int, slot: int) -> int:
        bit = 1 << slot
        for mask, length in self.segments[tier]:
            if mask & bit:
                return length
        return 0

    def for_slot(self, slot: int) -> HolderMatch:
        g = self._cumulative(0, slot)
        c = self._cumulative(1, slot)
        a = self._cumulative(2, slot)
        return HolderMatch(g, c - g, a - c)

    def by_holder(self) -> dict[Holder, HolderMatch]:
        """Every holder with a non-empty match, mapped to its per-tier lengths."""
        out: dict[Holder, HolderMatch] = {}
        gpu, cpu, every = self.segments
        if gpu is cpu is every:  # nothing offloaded: one list, GPU lengths only
            holders, known = self.holders, len(self.holders)
            for mask, length in gpu:
                for slot in iter_bits(mask):
                    holder = holders[slot] if slot < known else None
                    if holder is not None:
                        out[holder] = HolderMatch(length, 0, 0)
            return out
        slots = 0
        for mask, _ in every:
            slots |= mask
        for slot in iter_bits(slots):
            holder = self.holders[slot] if slot < len(self.holders) else None
            if holder is not None:
                out[holder] = self.for_slot(slot)
        return out

    def longest(self) -> int:
        """The longest prefix (in blocks) any holder has, in any tier."""
        return max((length for _, length in self.segments[2]), default=0)


def iter_bits(mask: int) -> Iterator[int]:
    """Positions of the set bits of ``mask``, lowest first; O(set bits)."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
