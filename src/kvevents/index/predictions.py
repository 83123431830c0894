"""Predicted entries: blocks a holder is expected to store because a request was just sent to it.

The router sends a request to a holder long before the holder's engine reports the
request's blocks (the report follows the prefill). Siblings that share the new prefix and
arrive in that window would find nobody holding it and be spread over the ranks. A
*prediction* says "holder ``h`` will soon hold block ``k``": matches may count it, at its
own credit and reported apart from confirmed blocks, until it is **confirmed** (the
holder's ``BlockStored`` stores the block), **expired** (its time-to-live, on an injected
clock), **withdrawn** (the request failed before the engine had it), **cleared** (a
``Reset`` or ``AllBlocksCleared`` of the holder; a ``Loss`` keeps predictions) or
**dropped** (the index's memory bound needs the room; predictions go first).

Invariants: ``masks[key]`` has bit ``slot`` set iff that slot has a live prediction for
the block (never 0; one bit per slot, a prediction is of a GPU copy); ``_until`` holds one
deadline per set bit, the latest given, and ``count`` their total; ``_queue`` holds one
record per prediction in deadline order (one time-to-live), and an entry expires only by
a record whose deadline is at least its own, so a refreshed entry outlives the first. No
prediction is made for a block the slot already holds. ``add``, ``confirm``, ``withdraw``
are O(blocks of the request), ``expire`` amortised O(1) per entry made.

Defaults: the time-to-live (:data:`DEFAULT_PREDICTION_TTL_S`) must cover queueing behind
the prefills a burst puts ahead of the request, not one prefill; longer costs only when a
prediction is never confirmed, and only for that long. The credit
(:data:`DEFAULT_PREDICTION_CREDIT`) is full because a lower one lets the balance term
split a burst's siblings over ranks, while a wrong prediction costs one prefill, the
price of not predicting. ``kvevents bench burst`` measures both.

Why a side table, not a fourth tier of the mask table: a tier bit would widen every mask
and make every match pay for it; predictions are few and short-lived, so a dict consulted
only while non-empty costs nothing when there are none.
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
