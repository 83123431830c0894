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
* :func:`match` is :meth:`MaskTable._segments` over the mirror: the running AND of the
  masks from ``live``, cut into ``(holders dropped, blocks they hold)`` segments;
* :func:`not_held` picks the keys whose mask lacks a holder's bit (the blocks a
  request sent there will add: its predictions).

Import it through :func:`kvevents.kernels.load` (this module imports numba).
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

__all__ = ["SEGMENTS", "apply", "match", "not_held", "rehash"]

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
