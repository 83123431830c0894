"""Stalled holders: ranks whose requests stop completing, or whose engine stops answering.

A rank can stop without dying (SIGSTOP, a hung device, a stuck scheduler) while its
engine says nothing for a while, and meanwhile a loaded router fills it: its cached
prefixes keep it the cheapest holder for theirs, and its recent work, decaying while it
serves nothing, makes it the cheapest for new ones. The router's own requests tell sooner.

:class:`StallWatch` counts, per holder, the requests this router has in flight there and
when the holder last *progressed* (became busy, or answered a request). A busy holder
that has not progressed for the *stall time* is stalled (cause :data:`REQUESTS`) until a
request there ends answered or none is in flight (then the next request finds out, as a
half-open circuit breaker does). The stall time is ``stall_after_s`` at most and
:data:`STALL_FACTOR` times the typical request duration when requests are fast (never
under :data:`STALL_FLOOR_S`), because a stopped rank fills up within a few request
durations; the typical duration is a running average over answered requests, each
clipped at :data:`_CLIPPED` times it, so a resumed rank's stuck requests barely move it.
A rank busy with one unusually long request may be taken for stalled: it then loses its
share of new requests for that long, never a request.

An engine whose load poll has gone unanswered for :attr:`StallWatch.engine_after_s`
(:mod:`kvevents.router.fleet.engines`) has every rank stalled (cause :data:`ENGINE`): a
whole engine stopped, with no request in flight there to tell. The margin over
``stall_after_s`` is the engine's own wait before it reports a stopped rank down.

A stalled holder ranks with the unavailable ones (:mod:`kvevents.router.decide.load_board`),
and is chosen by cost only when no other candidate is available: a fleet whose requests
are all slow must still route. Per request it costs two clock reads and one comparison
with :attr:`StallWatch.due`; only past it are the busy holders scanned.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any

from kvevents.router.decide.load_board import LoadBoard
from kvevents.types import Holder, PositiveFiniteFloat, check_bound

__all__ = [
    "CAUSES",
    "ENGINE",
    "ENGINE_MARGIN_S",
    "REQUESTS",
    "STALL_AFTER_S",
    "STALL_FACTOR",
    "STALL_FLOOR_S",
    "StallWatch",
]

log = logging.getLogger("kvevents.router")

REQUESTS = 1
"""Stall cause: the holder's requests stopped completing."""
ENGINE = 2
"""Stall cause: the holder's engine stopped answering its load poll."""
CAUSES = {REQUESTS: "requests", ENGINE: "engine"}
"""Each cause's name, as ``/workers`` and the metrics show it."""

STALL_AFTER_S = 1.0
"""``kvevents router``'s default ``--stall-after``: the longest stall time."""
STALL_FACTOR = 4.0
"""The stall time in typical request durations (when that is under ``stall_after_s``)."""
STALL_FLOOR_S = 0.1
"""The shortest stall time, whatever the requests' durations."""
_WEIGHT = 0.01
"""Each answered request's weight in the running average of durations."""
_CLIPPED = 4.0
"""A duration enters the average as at most this many times the average."""
ENGINE_MARGIN_S = 1.0
"""Seconds an engine's load poll may take beyond ``stall_after_s`` before its ranks are
stalled (see the module docstring)."""


class StallWatch:
    """Which holders are stalled, and why; see the module docstring.

    It marks them on ``board`` (:meth:`LoadBoard.set_stalled`). Every method returns
    True when the board changed (the router then counts a change of its loads)."""

    def __init__(self, board: LoadBoard, stall_after_s: float) -> None:
        check_bound(stall_after_s, PositiveFiniteFloat, "--stall-after")
        self.board = board
        self.stall_after_s = stall_after_s
        self.after_s = stall_after_s
        """The stall time now (see the module docstring)."""
        self.typical_s: float | None = None
        """The running average of answered requests' durations (None before the first)."""
        self.engine_after_s = stall_after_s + ENGINE_MARGIN_S
        """Seconds without an answer to a load poll after which an engine's ranks stall."""
        self.due = math.inf
        """The earliest monotonic time a busy holder not yet stalled can become stalled
        (never later than that; :meth:`check` sets it again)."""
        self._busy: dict[Holder, list[float]] = {}
        """Per holder with requests of this router in flight: [their count, progressed at]."""
        self._stalled_at: dict[Holder, float] = {}
        """Holders stalled for :data:`REQUESTS`, and since when."""
        self._silent: dict[str, float] = {}
        """Engines (workers) whose ranks are stalled for :data:`ENGINE`, and since when."""
        self.stalls: Counter[tuple[Holder, str]] = Counter()
        """Times each holder became stalled, per cause name."""

    def began(self, holder: Holder, now: float) -> None:
        """A request went to ``holder`` at ``now``."""
        entry = self._busy.get(holder)
        if entry is None:
            self._busy[holder] = [1.0, now]
            due = now + self.after_s
            if due < self.due:
                self.due = due
        else:
            entry[0] += 1.0

    def ended(self, holder: Holder, now: float, began: float, answered: bool) -> bool:
        """A request on ``holder`` that began at ``began`` ended at ``now``; ``answered``:
        with the engine's answer (else it failed or was given up, which says nothing of
        progress, nor of how long requests take)."""
        entry = self._busy.get(holder)
        if entry is None:
            return False
        if answered:
            took = now - began
            typical = self.typical_s
            if typical is None:
                typical = took
            else:
                limit = _CLIPPED * typical
                typical += _WEIGHT * ((took if took < limit else limit) - typical)
            self.typical_s = typical
            after = STALL_FACTOR * typical
            after = after if after > STALL_FLOOR_S else STALL_FLOOR_S
            self.after_s = after if after < self.stall_after_s else self.stall_after_s
        entry[0] -= 1.0
        idle = entry[0] <= 0.0
        if idle:
            del self._busy[holder]
        elif answered:
            entry[1] = now
        if (answered or idle) and self._stalled_at.pop(holder, None) is not None:
            log.warning(
                "rank %d of %s is routable again: %s",
                holder.dp_rank,
                holder.worker,
                "a request there was answered" if answered else "no request is in flight there",
            )
            return self.board.set_stalled(holder, REQUESTS, False)
        return False

    def check(self, now: float) -> bool:
        """Stall the busy holders that have not progressed for :attr:`after_s` at
        ``now``; call it once ``now`` reaches :attr:`due`. O(busy holders)."""
        after, due, changed = self.after_s, math.inf, False
        for holder, (count, since) in self._busy.items():
            if holder in self._stalled_at:
                continue
            if now - since >= after:
                self._stalled_at[holder] = now
                self.stalls[(holder, CAUSES[REQUESTS])] += 1
                changed |= self.board.set_stalled(holder, REQUESTS, True)
                log.warning(
                    "rank %d of %s is stalled: %d request(s) in flight there, none answered "
                    "for %.1f s; new requests go to other ranks until one is",
                    holder.dp_rank,
                    holder.worker,
                    count,
                    now - since,
                )
            elif since + after < due:
                due = since + after
        self.due = due
        return changed

    def engine_silent(self, worker: str, now: float) -> bool:
        """Engine ``worker``'s load poll has had no answer for :attr:`engine_after_s`."""
        if worker in self._silent:
            return False
        self._silent[worker] = now
        changed = False
        for holder in self.board.holders_of(worker):
            self.stalls[(holder, CAUSES[ENGINE])] += 1
            changed |= self.board.set_stalled(holder, ENGINE, True)
        log.warning(
            "engine %s is stalled: its load poll has had no answer for %.1f s; new requests "
            "go to other engines until it answers",
            worker,
            self.engine_after_s,
        )
        return changed

    def engine_heard(self, worker: str) -> bool:
        """Engine ``worker`` answered a load poll."""
        if self._silent.pop(worker, None) is None:
            return False
        log.warning("engine %s answers again: its ranks are routable", worker)
        changed = False
        for holder in self.board.holders_of(worker):
            changed |= self.board.set_stalled(holder, ENGINE, False)
        return changed

    def forget(self, holder: Holder) -> bool:
        """``holder`` is gone: nothing of it is watched any more."""
        self._busy.pop(holder, None)
        self._stalled_at.pop(holder, None)
        return self.board.set_stalled(holder, REQUESTS | ENGINE, False)

    def describe(self, holder: Holder, now: float) -> dict[str, Any] | None:
        """Why ``holder`` is stalled, for ``/workers``; None when it is not."""
        causes = self.board.stalled_by(holder)
        if not causes:
            return None
        why, since = [], now
        if causes & REQUESTS:
            count, progressed = self._busy.get(holder, (0.0, now))
            since = min(since, self._stalled_at.get(holder, now))
            why.append(
                f"{int(count)} request(s) in flight, none answered for {now - progressed:.2f} s "
                f"(the stall time is {self.after_s:.2f} s)"
            )
        if causes & ENGINE:
            silent = self._silent.get(holder.worker, now)
            since = min(since, silent)
            why.append(
                f"the engine's load poll has had no answer for "
                f"{now - silent + self.engine_after_s:.1f} s"
            )
        return {
            "causes": [name for bit, name in CAUSES.items() if causes & bit],
            "for_s": round(now - since, 3),
            "why": "; ".join(why),
        }
