"""Predicted entries: blocks a holder is expected to store because a request was just sent to it.

The router sends a request to a holder long before the holder's engine reports the
request's blocks (the report follows the prefill, tens to hundreds of milliseconds on
a real GPU). Siblings that share the new prefix and arrive in that window would find
nobody holding it and be spread over the ranks. A *prediction* says "holder ``h`` will
soon hold block ``k``": matches may count it (at its own credit, reported apart from
confirmed blocks) until one of these ends it:

* **confirmed**: the holder's own ``BlockStored`` stores the block; it is then an
  ordinary entry of the mask table, and the prediction is dropped;
* **expired**: its time-to-live passes (measured on an injected clock);
* **withdrawn**: the request failed before the engine had it (only what that request
  added, and only if no later request predicted it again);
* **cleared**: a ``Reset`` or ``AllBlocksCleared`` of the holder (a ``Loss`` clears
  the holder's confirmed blocks but keeps its predictions: see
  :mod:`kvevents.router.decide.router`);
* **dropped**: the index's memory bound needs the room (oldest predictions go first,
  before any confirmed block).

Structure and invariants
------------------------
* ``masks: dict[content_key, int]``: bit ``slot`` set iff that slot has a live
  prediction for the block. No value is 0 (an empty mask is deleted). One bit per
  slot, no tiers: a prediction is of a GPU copy.
* ``_until: dict[slot, dict[content_key, deadline]]``: one entry per set bit of
  ``masks``, with the latest deadline given to it (a newer prediction of the same block
  for the same slot extends it); per slot, so that no (block, slot) pair is made per
  block. ``count``, their total, is the number of predicted entries; the owner keeps
  ``confirmed entries + count <= max_entries``.
* ``_queue``: ``(deadline, slot, keys)`` per prediction made, in deadline order (the
  time-to-live is one value, so insertion order is deadline order). An entry is
  expired by the oldest record whose deadline has passed *and* equals or exceeds its
  own, so a refreshed entry outlives the record that created it.
* A prediction is never made for a block the slot already holds in some tier.

Complexity
----------
``add``, ``confirm``, ``withdraw``: O(blocks of the request). ``expire``: amortised
O(1) per entry ever made (each record is popped once). ``clear_slot``: O(the slot's
predicted entries), which stay few (they live for seconds). The match walk over the
side table (:meth:`PrefixIndex.predicted
<kvevents.index.prefix_index.PrefixIndex.predicted>`) runs only when ``masks`` is not
empty, so the confirmed-only match is unchanged.

Defaults
--------
Measured with ``kvevents bench burst`` (16 groups of 8 siblings, a new 2,048-token
prefix each, dp 4, 100 ms per prefix prefill; 2 shared cores, so noisy):

* time-to-live 2 s: the router's ``prediction_confirm_seconds_max`` was 0.12-0.72 s
  (mean 0.02-0.46 s, the longest with another benchmark sharing the cores) over the
  runs, and a time-to-live of 0.1 s already let predictions expire before their
  confirmation. The simulated engine reports a block
  when it admits the request; a GPU engine reports it after the prefill, which under a
  burst waits behind the prefills queued before it (0.1 s per 2,048 tokens here), so
  the bound must cover queueing, not one prefill. Anything from 0.5 s to 5 s scored the
  same (every sibling on its group's rank). Longer costs only when a prediction is
  never confirmed (the engine evicted or dropped the request without an error the
  router sees), and then only for as long; 2 s is also llm-d's choice.
* credit 1.0: credits 0.75 and 1.0 kept every group on one rank (100% of the ideal
  hit rate); 0.5 already let the balance term split groups (2.0 ranks per group,
  86%), 0.25 more (2.8 ranks, 74%). A prediction that turns out wrong costs one
  prefill, the price of not predicting; the load terms still decide against a busy
  rank, as for a confirmed block.

Why a side table and not a fourth tier of the mask table: a tier bit would widen every
packed mask, make every match of the table pay for it, and leave expiry needing its
own record of what to expire anyway; predictions are few and short-lived, so a small
dict consulted only while non-empty costs nothing when there are none.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat

import msgspec

__all__ = [
    "DEFAULT_PREDICTION_CREDIT",
    "DEFAULT_PREDICTION_TTL_S",
    "PredictionStats",
    "Predictions",
]

DEFAULT_PREDICTION_TTL_S = 2.0
"""Seconds a prediction lives unconfirmed (see "Defaults" in the module docstring)."""
DEFAULT_PREDICTION_CREDIT = 1.0
"""Worth of a predicted block relative to computing it (see "Defaults")."""
_CHANGED_LIMIT = 1 << 16
"""The most changes listed unread: past it, a mirror rebuilding costs less than syncing."""


class PredictionStats(msgspec.Struct, kw_only=True):
    """Predicted entries by fate (each a (block, holder) pair); ``made`` counts them all."""

    made: int = 0
    confirmed: int = 0
    expired: int = 0
    withdrawn: int = 0
    cleared: int = 0
    dropped: int = 0
    """Dropped to keep the index within its memory bound, or refused room when made."""


class Predictions:
    """The side table of predicted entries; see the module docstring."""

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_PREDICTION_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"Predictions: ttl_s={ttl_s!r} must be a positive number of seconds")
        self.ttl_s = ttl_s
        self.clock = clock
        self.stats = PredictionStats()
        self.confirm_age_sum_s = 0.0
        """Seconds from prediction to confirmation, summed over confirmed entries."""
        self.confirm_age_max_s = 0.0
        """The longest of those: what the time-to-live must exceed."""
        self.masks: dict[int, int] = {}
        self._until: dict[int, dict[int, float]] = {}
        self._count = 0
        self._queue: deque[tuple[float, int, Sequence[int]]] = deque()
        self.changed: list[int] | None = []
        """Keys whose mask changed since :meth:`take_changes`, in order (for a flat mirror
        of ``masks``, as :class:`~kvevents.index.mask_table.MaskTable` lists its own);
        None once more than :data:`_CHANGED_LIMIT` went unread: the mirror then rebuilds."""
        self.changed_ops: array[int] = array("q")
        """Per key of ``changed``: ``slot + 1`` where that slot's bit was set, ``-(slot +
        1)`` where it was cleared (the mirror drops a key left with no bit)."""

    @property
    def count(self) -> int:
        """Predicted (block, holder) entries alive (some may be past their deadline)."""
        return self._count

    def add(self, slot: int, keys: Sequence[int], room: int) -> tuple[list[int], float]:
        """Predict ``keys`` (not yet held by ``slot``) on ``slot``, at most ``room`` new entries.

        Keys already predicted for the slot get the new deadline. Returns the keys newly
        predicted and their deadline: what :meth:`withdraw` takes back.
        """
        deadline = self.clock() + self.ttl_s
        until = self._until.get(slot)
        if until is None:
            until = self._until[slot] = {}
        masks = self.masks
        bit = 1 << slot
        added: list[int] = []
        kept: list[int] = []
        for k in keys:
            if k not in until:
                if len(added) >= room:
                    self.stats.dropped += 1
                    continue
                added.append(k)
                masks[k] = masks.get(k, 0) | bit
            until[k] = deadline
            kept.append(k)
        if kept:
            self._queue.append((deadline, slot, kept))
        self._count += len(added)
        changed = self.changed
        if changed is not None and added:
            changed.extend(added)
            self.changed_ops.extend(repeat(slot + 1, len(added)))
            if len(changed) > _CHANGED_LIMIT:
                self.unlist_changes()
        self.stats.made += len(added)
        return added, deadline

    def take_changes(self) -> tuple[list[int], array[int]] | None:
        """The changes listed since the last call (keys and ops, see ``changed``), then
        listed afresh; None when they were not all listed (rebuild from ``masks``)."""
        changed, ops = self.changed, self.changed_ops
        self.changed, self.changed_ops = [], array("q")
        return None if changed is None else (changed, ops)

    def unlist_changes(self) -> None:
        """Stop listing changes until :meth:`take_changes` (a mirror rebuilds instead)."""
        self.changed, self.changed_ops = None, array("q")

    def expire(self) -> int:
        """Drop every prediction past its deadline; returns entries dropped."""
        queue = self._queue
        if not queue:
            return 0
        now = self.clock()
        dropped = 0
        while queue and queue[0][0] <= now:
            deadline, slot, keys = queue.popleft()
            dropped += self._drop(slot, keys, deadline)
        self.stats.expired += dropped
        return dropped

    def shrink(self, n: int) -> int:
        """Drop at least ``n`` entries (or all), oldest first; returns entries dropped."""
        dropped = 0
        queue = self._queue
        while queue and dropped < n:
            deadline, slot, keys = queue.popleft()
            dropped += self._drop(slot, keys, deadline)
        self.stats.dropped += dropped
        return dropped

    def confirm(self, slot: int, keys: Sequence[int]) -> int:
        """The slot stored ``keys``: their predictions become ordinary entries. Returns how many."""
        until = self._until.get(slot)
        if not until:
            return 0
        now = self.clock()
        ttl = self.ttl_s
        age_sum, age_max = self.confirm_age_sum_s, self.confirm_age_max_s
        gone: list[int] = []
        for k in keys:
            d = until.pop(k, None)
            if d is not None:
                gone.append(k)
                age = now - (d - ttl)  # since the latest prediction of this entry
                age_sum += age
                if age > age_max:
                    age_max = age
        if gone:
            self.confirm_age_sum_s, self.confirm_age_max_s = age_sum, age_max
            self._clear(slot, gone)
            self.stats.confirmed += len(gone)
        return len(gone)

    def withdraw(self, slot: int, keys: Sequence[int], deadline: float) -> int:
        """The request behind a prediction failed: drop what it added. Returns entries dropped.

        ``keys`` and ``deadline`` are what :meth:`add` returned; entries another request
        predicted since (a later deadline) stay theirs.
        """
        until = self._until.get(slot)
        if not until:
            return 0
        gone = []
        for k in keys:
            if until.get(k) == deadline:
                del until[k]
                gone.append(k)
        self._clear(slot, gone)
        self.stats.withdrawn += len(gone)
        return len(gone)

    def clear_slot(self, slot: int) -> int:
        """Drop every prediction of a slot (reset, AllBlocksCleared, removal). O(its entries)."""
        gone = list(self._until.pop(slot, ()))
        self._clear(slot, gone)
        self.stats.cleared += len(gone)
        return len(gone)

    def _drop(self, slot: int, keys: Sequence[int], deadline: float) -> int:
        until = self._until.get(slot)
        if not until:
            return 0
        gone = []
        for k in keys:
            d = until.get(k)
            if d is not None and d <= deadline:
                del until[k]
                gone.append(k)
        self._clear(slot, gone)
        return len(gone)

    def _clear(self, slot: int, gone: list[int]) -> None:
        """Clear ``slot``'s bit of ``gone`` (keys whose deadlines were just dropped) in
        ``masks``, count them out and list them (see ``changed``): once per call, not
        per key, as this runs for every block an engine stores."""
        if not gone:
            return
        masks = self.masks
        keep = ~(1 << slot)
        for k in gone:
            v = masks[k] & keep
            if v:
                masks[k] = v
            else:
                del masks[k]
        self._count -= len(gone)
        changed = self.changed
        if changed is not None:
            changed.extend(gone)
            self.changed_ops.extend(repeat(-slot - 1, len(gone)))
            if len(changed) > _CHANGED_LIMIT:
                self.unlist_changes()
