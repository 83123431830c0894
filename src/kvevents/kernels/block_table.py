"""A flat hash table of block masks, and a request's match over it, in compiled loops.

The index keeps its blocks in a dict of content key -> holder bitmask
(:mod:`kvevents.index.mask_table`). A match there is one dict lookup per block, each
one a few dependent loads through Python objects (the dict's slot, the key object to
compare, the mask object to AND): about 40 us for a 2,048-token request and 150 us at
8,192 tokens, a quarter of what ``/route`` cost. This module keeps a mirror of the same
masks (their low 64 bits: the GPU tier of up to 64 holders) in two flat uint64 arrays
with open addressing and linear probing, so that a lookup is one or two cache lines and
the whole match one compiled call.

* A slot is empty when its value is 0 (a block nobody holds is never in the dict, so a
  live mask is never 0); keys are any uint64.
* :func:`apply` sets or deletes (value 0) keys; deletion shifts the probe run back, so
  there are no tombstones and a lookup stops at the first empty slot.
* :func:`apply_bits` applies the index's writes as they happened, one holder's bit
  set or cleared per key (or the key deleted), without the masks: how the mirror
  keeps up between two matches (a wide mask made into a row of words cost more than
  the rest of the write).
* :func:`match` is :meth:`MaskTable._segments` over the mirror: the running AND of the
  masks from ``live``, cut into ``(holders dropped, blocks they hold)`` segments;
* :func:`not_held` picks the keys whose mask lacks a holder's bit (the blocks a
  request sent there will add: its predictions).

An index of more than 64 holders has masks of several 64-bit words (its slot width);
the ``_wide`` kernels are the same four over a table whose values are rows of words.
Before them such an index matched over the dict: at 256 ranks ``/route`` spent about
50 us choosing the best four against 16 at 64 ranks (``benchmarks/route_fleet.py``).

Import it through :func:`kvevents.kernels.load` (this module imports numba).
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

__all__ = [
    "SEGMENTS",
    "apply",
    "apply_bits",
    "apply_bits_wide",
    "apply_wide",
    "match",
    "match_wide",
    "not_held",
    "not_held_wide",
    "rehash",
    "rehash_wide",
]

_MIX = uint64(0x9E3779B97F4A7C15)
SEGMENTS = 65  # at most one per holder (64), and the holders holding every block


@njit(cache=True, inline="always")
def _home(key, mask):
    h = key * _MIX
    return (h ^ (h >> uint64(32))) & mask


@njit(cache=True)
def apply(keys, values, table_keys, table_values, count):
    """Set ``keys[j]`` to ``values[j]`` (0: delete it) in order; the new count of keys.

    The table must keep at least one empty slot (the caller grows it well before)."""
    mask = uint64(len(table_keys) - 1)
    for j in range(len(keys)):
        key = keys[j]
        value = values[j]
        i = _home(key, mask)
        while True:
            held = table_values[i]
            if held == 0:
                if value != 0:
                    table_keys[i] = key
                    table_values[i] = value
                    count += 1
                break
            if table_keys[i] == key:
                if value != 0:
                    table_values[i] = value
                else:
                    _delete(table_keys, table_values, i, mask)
                    count -= 1
                break
            i = (i + uint64(1)) & mask
    return count


@njit(cache=True)
def apply_bits(keys, ops, table_keys, table_values, count):
    """Apply ``ops[j]`` to ``keys[j]``, in order; the new count of keys. An op is
    ``slot + 1`` (set that slot's bit), ``-(slot + 1)`` (clear it; a key left with no
    bit is deleted) or 0 (delete the key). Same room rule as :func:`apply`."""
    mask = uint64(len(table_keys) - 1)
    for j in range(len(keys)):
        key = keys[j]
        op = ops[j]
        bit = uint64(0)
        if op != 0:
            bit = uint64(1) << uint64(op - 1 if op > 0 else -op - 1)
        i = _home(key, mask)
        while True:
            held = table_values[i]
            if held == 0:
                if op > 0:
                    table_keys[i] = key
                    table_values[i] = bit
                    count += 1
                break
            if table_keys[i] == key:
                if op > 0:
                    table_values[i] = held | bit
                elif op < 0 and held & ~bit != 0:
                    table_values[i] = held & ~bit
                else:
                    _delete(table_keys, table_values, i, mask)
                    count -= 1
                break
            i = (i + uint64(1)) & mask
    return count


@njit(cache=True)
def rehash(table_keys, table_values, new_keys, new_values):
    """Insert every entry of a table into a larger, empty one (growing without the dict)."""
    mask = uint64(len(new_keys) - 1)
    for j in range(len(table_keys)):
        value = table_values[j]
        if value == 0:
            continue
        key = table_keys[j]
        i = _home(key, mask)
        while new_values[i] != 0:
            i = (i + uint64(1)) & mask
        new_keys[i] = key
        new_values[i] = value


@njit(cache=True, inline="always")
def _delete(table_keys, table_values, i, mask):
    """Empty slot ``i``, moving back each later entry of its probe run that may move."""
    j = i
    while True:
        j = (j + uint64(1)) & mask
        if table_values[j] == 0:
            break
        home = _home(table_keys[j], mask)
        # The entry at j stays when its home lies cyclically in (i, j].
        stays = (i < home and home <= j) if i <= j else (i < home or home <= j)
        if not stays:
            table_keys[i] = table_keys[j]
            table_values[i] = table_values[j]
            i = j
    table_keys[i] = uint64(0)
    table_values[i] = uint64(0)


@njit(cache=True)
def match(keys, table_keys, table_values, live, dropped, lengths):
    """``(found, longest)``: in ``dropped[:found]`` and ``lengths[:found]``, the holders
    whose match ends at each length (as ``MaskTable._segments`` gives them), and the
    longest prefix anyone holds. ``live`` is the mask of registered slots, given as the
    signed int64 of its 64 bits (a Python int is unboxed as int64); ``dropped`` and
    ``lengths`` (uint64, int64) have room for :data:`SEGMENTS` entries. Writing into
    the caller's arrays and answering two ints, a call makes no array."""
    mask = uint64(len(table_keys) - 1)
    found = 0
    held = uint64(live)
    n = len(keys)
    for j in range(n):
        key = keys[j]
        i = _home(key, mask)
        value = uint64(0)
        while True:
            slot = table_values[i]
            if slot == 0:
                break
            if table_keys[i] == key:
                value = slot
                break
            i = (i + uint64(1)) & mask
        still = held & value
        if still != held:
            if j > 0:
                dropped[found] = held ^ still
                lengths[found] = j
                found += 1
            held = still
            if held == 0:
                return found, j
    if n > 0 and held != 0:
        dropped[found] = held
        lengths[found] = n
        return found + 1, n
    return found, 0


@njit(cache=True)
def not_held(keys, table_keys, table_values, slot):
    """The ``keys`` whose mask lacks slot ``slot``'s bit (absent keys included), in order."""
    bit = uint64(1) << uint64(slot)
    mask = uint64(len(table_keys) - 1)
    out = np.empty(len(keys), dtype=np.uint64)
    found = 0
    for j in range(len(keys)):
        key = keys[j]
        # match's probe loop, written out again: the tables passed to an inlined helper
        # would cost numba a reference count in and out per key
        i = _home(key, mask)
        value = uint64(0)
        while True:
            slot = table_values[i]
            if slot == 0:
                break
            if table_keys[i] == key:
                value = slot
                break
            i = (i + uint64(1)) & mask
        if value & bit == 0:
            out[found] = key
            found += 1
    return out[:found]


# --- wide tables: more than 64 holders -------------------------------------------------
#
# The same table for masks of ``words`` uint64 words (64 holders each): ``values`` is a
# (capacity, words) array whose row ``i`` is slot ``i``'s mask, and a slot is empty when
# its row is all 0. Kept apart from the one-word kernels above, which stay as measured.


@njit(cache=True, inline="always")
def _row_empty(values, i):
    for w in range(values.shape[1]):  # noqa: SIM110 (numba compiles no generator into all())
        if values[i, w] != 0:
            return False
    return True


@njit(cache=True, inline="always")
def _find_wide(key, table_keys, table_values, mask):
    """The slot holding ``key``, or -1."""
    i = _home(key, mask)
    while True:
        if _row_empty(table_values, i):
            return -1
        if table_keys[i] == key:
            return np.int64(i)
        i = (i + uint64(1)) & mask


@njit(cache=True)
def apply_wide(keys, values, table_keys, table_values, count):
    """:func:`apply` for wide tables: row ``values[j]`` for ``keys[j]`` (all 0: delete)."""
    mask = uint64(len(table_keys) - 1)
    words = values.shape[1]
    for j in range(len(keys)):
        key = keys[j]
        live = False
        for w in range(words):
            if values[j, w] != 0:
                live = True
        i = _home(key, mask)
        while True:
            if _row_empty(table_values, i):
                if live:
                    table_keys[i] = key
                    table_values[i, :] = values[j, :]
                    count += 1
                break
            if table_keys[i] == key:
                if live:
                    table_values[i, :] = values[j, :]
                else:
                    _delete_wide(table_keys, table_values, i, mask)
                    count -= 1
                break
            i = (i + uint64(1)) & mask
    return count


@njit(cache=True)
def apply_bits_wide(keys, ops, table_keys, table_values, count):
    """:func:`apply_bits` for wide tables (slot ``s`` is bit ``s % 64`` of word ``s // 64``)."""
    mask = uint64(len(table_keys) - 1)
    for j in range(len(keys)):
        key = keys[j]
        op = ops[j]
        slot = op - 1 if op > 0 else -op - 1
        word = slot // 64
        bit = uint64(1) << uint64(slot % 64)
        i = _home(key, mask)
        while True:
            if _row_empty(table_values, i):
                if op > 0:
                    table_keys[i] = key
                    table_values[i, word] = bit
                    count += 1
                break
            if table_keys[i] == key:
                if op > 0:
                    table_values[i, word] |= bit
                else:
                    if op < 0:
                        table_values[i, word] &= ~bit
                    if op == 0 or _row_empty(table_values, i):
                        _delete_wide(table_keys, table_values, i, mask)
                        count -= 1
                break
            i = (i + uint64(1)) & mask
    return count


@njit(cache=True)
def rehash_wide(table_keys, table_values, new_keys, new_values):
    """:func:`rehash` for wide tables."""
    mask = uint64(len(new_keys) - 1)
    for j in range(len(table_keys)):
        if _row_empty(table_values, j):
            continue
        key = table_keys[j]
        i = _home(key, mask)
        while not _row_empty(new_values, i):
            i = (i + uint64(1)) & mask
        new_keys[i] = key
        new_values[i, :] = table_values[j, :]


@njit(cache=True, inline="always")
def _delete_wide(table_keys, table_values, i, mask):
    """:func:`_delete` for wide tables."""
    j = i
    while True:
        j = (j + uint64(1)) & mask
        if _row_empty(table_values, j):
            break
        home = _home(table_keys[j], mask)
        stays = (i < home and home <= j) if i <= j else (i < home or home <= j)
        if not stays:
            table_keys[i] = table_keys[j]
            table_values[i, :] = table_values[j, :]
            i = j
    table_keys[i] = uint64(0)
    table_values[i, :] = uint64(0)


@njit(cache=True)
def match_wide(keys, table_keys, table_values, live, held, dropped, lengths):
    """:func:`match` for wide tables: ``live`` is the registered slots' mask as words,
    ``held`` a scratch row of as many words, and ``dropped`` has a row per segment
    (room for one per holder, plus one)."""
    mask = uint64(len(table_keys) - 1)
    words = len(live)
    held[:] = live[:]
    found = 0
    n = len(keys)
    for j in range(n):
        i = _find_wide(keys[j], table_keys, table_values, mask)
        changed = False
        for w in range(words):
            value = uint64(0) if i < 0 else table_values[i, w]
            if held[w] & value != held[w]:
                changed = True
                break
        if not changed:
            continue
        remaining = False
        for w in range(words):
            still = held[w] & (uint64(0) if i < 0 else table_values[i, w])
            if j > 0:
                dropped[found, w] = held[w] ^ still
            held[w] = still
            if still != 0:
                remaining = True
        if j > 0:
            lengths[found] = j
            found += 1
        if not remaining:
            return found, j
    if n > 0:
        for w in range(words):
            if held[w] != 0:
                dropped[found, :] = held[:]
                lengths[found] = n
                return found + 1, n
    return found, 0


@njit(cache=True)
def not_held_wide(keys, table_keys, table_values, slot):
    """:func:`not_held` for wide tables."""
    word = slot // 64
    bit = uint64(1) << uint64(slot % 64)
    mask = uint64(len(table_keys) - 1)
    out = np.empty(len(keys), dtype=np.uint64)
    found = 0
    for j in range(len(keys)):
        key = keys[j]
        i = _find_wide(key, table_keys, table_values, mask)
        if i < 0 or table_values[i, word] & bit == 0:
            out[found] = key
            found += 1
    return out[:found]
