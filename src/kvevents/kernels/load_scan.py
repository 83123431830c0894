"""The best holders by load, in one compiled pass over the router's load table.

A relayed request (or a ``/route`` with ``record``) changes the loads it is routed by,
so the next request cannot reuse a ranking: it must look at every holder. In Python
that is about half a microsecond a holder (180 us a request at 256 ranks, 600 at
1,024). The router's loads live in one flat float64 table
(:class:`~kvevents.router.decide.load_board.LoadBoard`, :data:`STRIDE` numbers per holder
slot), so one call here scans the candidates instead.

:func:`best_unmatched` ranks every candidate as if it cached nothing of the request:
by :func:`~kvevents.router.decide.scoring.score`'s sort key (unavailable last, then the cost,
the pending work, the recent work, the requests routed and the candidate's position),
with the same float64 arithmetic in the same order, so the holders it picks are the
ones Python would. The caller scores the holders that matched the request itself and
merges them in (a match only lowers a cost). Not a Python object is made per holder.

Import it through :func:`kvevents.kernels.load` (this module imports numba).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = [
    "AVAILABLE",
    "ENGINE_REQUESTS",
    "INFLIGHT_BLOCKS",
    "INFLIGHT_REQUESTS",
    "RAW_RECENT",
    "ROUTED",
    "STRIDE",
    "best_unmatched",
]

# a holder slot's fields in the table, each a float64 (the counts are exact up to 2**53)
AVAILABLE, ENGINE_REQUESTS, INFLIGHT_REQUESTS, INFLIGHT_BLOCKS, RAW_RECENT, ROUTED = range(6)
STRIDE = 6


@njit(cache=True, inline="always")
def _before(keys, a, b_unavailable, b_cost, b_pending, b_recent, b_routed, b_position):
    """Whether kept key row ``a`` sorts before the key given field by field."""
    if keys[a, 0] != b_unavailable:
        return keys[a, 0] < b_unavailable
    if keys[a, 1] != b_cost:
        return keys[a, 1] < b_cost
    if keys[a, 2] != b_pending:
        return keys[a, 2] < b_pending
    if keys[a, 3] != b_recent:
        return keys[a, 3] < b_recent
    if keys[a, 4] != b_routed:
        return keys[a, 4] < b_routed
    return keys[a, 5] < b_position


@njit(cache=True)
def best_unmatched(slots, table, scale, n_blocks, load_weight, balance_weight, foreign_blocks, out):
    """Write into ``out`` the positions (in ``slots``) of the best ``len(out)``
    candidates as if none cached anything of a request of ``n_blocks`` blocks, best
    first; return how many were written (fewer when there are fewer candidates) and
    the least recent work among the available candidates (0.0 when none is).

    ``slots``: each candidate's slot in ``table`` (int64); ``scale``: the factor the
    raw recent work is multiplied by (the board's decay so far)."""
    n = len(slots)
    least = np.inf
    for i in range(n):
        base = slots[i] * STRIDE
        if table[base + AVAILABLE] != 0.0:
            recent = table[base + RAW_RECENT] * scale
            if recent < least:
                least = recent
    if least == np.inf:
        least = 0.0
    prefill = n_blocks if n_blocks > 0.0 else 0.0
    count = len(out)
    keys = np.empty((count, 6))
    kept = 0
    for i in range(n):
        base = slots[i] * STRIDE
        unavailable = 0.0 if table[base + AVAILABLE] != 0.0 else 1.0
        foreign = table[base + ENGINE_REQUESTS] - table[base + INFLIGHT_REQUESTS]
        pending = table[base + INFLIGHT_BLOCKS] + (
            foreign_blocks * foreign if foreign > 0.0 else 0.0
        )
        recent = table[base + RAW_RECENT] * scale
        balance = recent - least if recent > least else 0.0
        cost = prefill + (load_weight * pending + balance_weight * balance)
        routed = table[base + ROUTED]
        position = float(i)
        if kept == count and _before(
            keys, kept - 1, unavailable, cost, pending, recent, routed, position
        ):
            continue  # not better than the worst kept
        j = kept if kept < count else count - 1
        while j > 0 and not _before(
            keys, j - 1, unavailable, cost, pending, recent, routed, position
        ):
            keys[j] = keys[j - 1]
            out[j] = out[j - 1]
            j -= 1
        keys[j, 0] = unavailable
        keys[j, 1] = cost
        keys[j, 2] = pending
        keys[j, 3] = recent
        keys[j, 4] = routed
        keys[j, 5] = position
        out[j] = i
        if kept < count:
            kept += 1
    return kept, least
