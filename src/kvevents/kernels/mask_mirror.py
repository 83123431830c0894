"""The index's block masks mirrored into a flat table, kept up to date lazily.

:class:`MaskMirror` holds the low 64 bits of every block's mask (the GPU tier of up to
64 holders) in the flat table of :mod:`kvevents.kernels.block_table`. The index does
not write into it: its writers only list the keys they changed and what they did to
each, one holder's GPU bit set or cleared or the key dropped (``MaskTable._changed``
and ``_changed_ops``), and the next match first applies those
(:meth:`MaskMirror.sync`), so the mirror never disagrees with the dict when it is read,
and a store costs the index two ``extend`` calls. Listing the bit rather than the mask
keeps the sync the same few instructions a key at any width: the masks of an index of
more than 64 holders are Python ints of several words, and turning each changed one
into a row cost a wide index more than the rest of its write. The table grows by
rehashing itself, in compiled code; it is rebuilt
from the whole dict (:meth:`MaskMirror.rebuild`) only when the index says its changes
were not listed (a change of slot width, a snapshot loaded, too many changes between
two matches).

Import it through :func:`kvevents.kernels.load` (this module imports numpy and numba).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import repeat

import numpy as np

from kvevents.kernels import block_table

__all__ = ["MaskMirror", "WideMaskMirror", "signed64"]

_LOW = (1 << 64) - 1
_MIN_CAPACITY = 1 << 12


class MaskMirror:
    """See the module docstring; ``match`` answers as ``MaskTable._segments`` does."""

    words = 1
    """Words of 64 holders per mask (:class:`WideMaskMirror` has more)."""
    # the table's kernels (a subclass with another table layout names its own)
    _apply = staticmethod(block_table.apply)
    _apply_bits = staticmethod(block_table.apply_bits)
    _rehash = staticmethod(block_table.rehash)
    _not_held = staticmethod(block_table.not_held)

    def __init__(self) -> None:
        self._keys, self._values = self._table(_MIN_CAPACITY)
        self.count = 0
        self.rebuilds = 0
        """Rebuilds from the whole dict (the changes were not listed)."""
        self.grown = 0
        """Times the table grew (rehashed from itself)."""
        # Where a match writes its segments: reused, so that a match makes no array.
        self._dropped = array("Q", bytes(8 * block_table.SEGMENTS))
        self._lengths = array("q", bytes(8 * block_table.SEGMENTS))

    def _table(self, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        """An empty table: keys and masks, ``capacity`` slots each (0: an empty slot)."""
        return np.zeros(capacity, dtype=np.uint64), np.zeros(capacity, dtype=np.uint64)

    def _table_values(self, masks: Sequence[int]) -> np.ndarray:
        """``masks`` (their GPU tier) as the table holds them; always of one array type,
        so that no kernel is compiled again for another."""
        try:
            values = array("Q", masks)
        except OverflowError:  # masks with offloaded tiers: their GPU bits only
            values = array("Q", [m & _LOW for m in masks])
        return np.frombuffer(values, dtype=np.uint64)

    def sync(self, keys: Sequence[int], ops: array[int]) -> None:
        """Apply the writes listed since the last sync, in order: ``ops`` (an
        ``array("q")``, one per key) holds ``slot + 1`` where that holder's GPU bit was
        set, ``-(slot + 1)`` where it was cleared, 0 where the key was dropped."""
        if not keys:
            return
        if 2 * (self.count + len(keys)) > len(self._keys):
            self._grow(self.count + len(keys))
        words = np.frombuffer(array("Q", keys), dtype=np.uint64)
        done = np.frombuffer(ops, dtype=np.int64)
        self.count = self._apply_bits(words, done, self._keys, self._values, self.count)

    def match(self, keys: array[int], live: int) -> tuple[list[tuple[int, int]], int]:
        """``(segments, longest)`` of a request's keys (an ``array("Q")``) from ``live``."""
        dropped, lengths = self._dropped, self._lengths
        found, longest = block_table.match(
            keys, self._keys, self._values, signed64(live), dropped, lengths
        )
        if found == 1:  # the usual request: every holder that has some of it, one length
            return [(dropped[0], lengths[0])], longest
        return list(zip(dropped[:found], lengths[:found], strict=True)), longest

    def not_held(self, keys: array[int], slot: int) -> list[int]:
        """The keys of ``keys`` (an ``array("Q")``) whose mask lacks ``slot``'s bit, in order."""
        return self._not_held(keys, self._keys, self._values, slot).tolist()  # type: ignore[no-any-return]

    def _grow(self, n: int) -> None:
        """A larger table for ``n`` keys, filled from this one (not from the dict)."""
        keys, values = self._table(_capacity(n))
        self._rehash(self._keys, self._values, keys, values)
        self._keys, self._values = keys, values
        self.grown += 1

    def rebuild(self, blocks: dict[int, int]) -> None:
        """Copy every mask of ``blocks`` afresh (when the changes were not listed)."""
        n = len(blocks)
        keys = np.fromiter(blocks, dtype=np.uint64, count=n)
        values = self._table_values(list(blocks.values()))
        self._keys, self._values = self._table(_capacity(n))
        self.count = self._apply(keys, values, self._keys, self._values, 0)
        self.rebuilds += 1


class WideMaskMirror(MaskMirror):
    """:class:`MaskMirror` for an index of slot width ``64 * words`` (``words`` > 1): the
    same methods, answering alike, over the wide table (a row of words per key). Whole
    masks (a rebuild's, a match's ``live``) go in as Python ints (their GPU tier, the low
    ``64 * words`` bits), turned into rows of words here; a sync sets and clears bits."""

    _apply = staticmethod(block_table.apply_wide)
    _apply_bits = staticmethod(block_table.apply_bits_wide)
    _rehash = staticmethod(block_table.rehash_wide)
    _not_held = staticmethod(block_table.not_held_wide)

    def __init__(self, words: int) -> None:
        if words < 2:
            raise ValueError(f"WideMaskMirror(words={words}): one word is MaskMirror's")
        self.words = words
        self._low = (1 << (64 * words)) - 1
        super().__init__()
        segments = 64 * words + 1  # at most one per holder, and those holding every block
        self._dropped_rows = np.zeros((segments, words), dtype=np.uint64)
        self._lengths_of = np.zeros(segments, dtype=np.int64)
        self._held = np.zeros(words, dtype=np.uint64)
        self._live: tuple[int, np.ndarray] = (0, np.zeros(words, dtype=np.uint64))
        """The last ``live`` mask a match was given, and its words."""

    def _table(self, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        """An empty table with a row of ``words`` per slot (all 0: an empty slot)."""
        keys = np.zeros(capacity, dtype=np.uint64)
        return keys, np.zeros((capacity, self.words), dtype=np.uint64)

    def _table_values(self, masks: Sequence[int]) -> np.ndarray:
        """``masks`` (their GPU tier) as a (len, words) array of uint64 rows, read-only.

        Each mask is turned into bytes in C (``map``); a mask with offloaded tiers (bits
        past the GPU tier) does not fit, and then every mask is cut to its GPU tier first."""
        size = 8 * self.words
        try:
            little = repeat("little")  # mypy reads it as str, not the literal to_bytes wants
            raw = b"".join(map(int.to_bytes, masks, repeat(size), little))  # type: ignore[arg-type]
        except OverflowError:
            low = self._low
            raw = b"".join([(m & low).to_bytes(size, "little") for m in masks])
        return np.frombuffer(raw, dtype="<u8").reshape(len(masks), self.words)

    def match(self, keys: array[int], live: int) -> tuple[list[tuple[int, int]], int]:
        """``(segments, longest)`` of a request's keys (an ``array("Q")``) from ``live``."""
        if self._live[0] != live:
            self._live = (live, self._table_values([live])[0].copy())
        dropped, lengths = self._dropped_rows, self._lengths_of
        found, longest = block_table.match_wide(
            keys, self._keys, self._values, self._live[1], self._held, dropped, lengths
        )
        rows = dropped[:found].tobytes()
        size = 8 * self.words
        segments = [
            (int.from_bytes(rows[k * size : (k + 1) * size], "little"), int(lengths[k]))
            for k in range(found)
        ]
        return segments, longest


def signed64(value: int) -> int:
    """The int64 with the same 64 bits as ``value`` (0 .. 2**64 - 1): how a uint64 goes
    into a kernel as a plain Python int, which numba unboxes as int64 (a ``np.uint64``
    costs more to make than the rest of a small call)."""
    return value - _WRAP if value > _MAX_SIGNED else value


_MAX_SIGNED = (1 << 63) - 1
_WRAP = 1 << 64


def _capacity(n: int) -> int:
    """A power of two at least 3n: a third full when made, grown past half full."""
    capacity = _MIN_CAPACITY
    while capacity < 3 * n:
        capacity *= 2
    return capacity
