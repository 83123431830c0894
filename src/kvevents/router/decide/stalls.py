"""Stalled holders: ranks whose requests stop completing, or whose engine stops answering.

A rank can stop without dying: its process stopped (SIGSTOP), a device hung, a
scheduler stuck behind one step. Its engine may say nothing of it for a while (the
simulated engine's ``/load`` waits a second for the rank before it reports it down; a
vLLM's ``/health`` answers for the whole engine), and meanwhile a loaded router fills
the rank with requests: its cached prefixes keep it the cheapest holder for theirs, and
its share of recent work, which only decays while it serves nothing, makes it the
cheapest for new ones. The router's own requests tell sooner.

:class:`StallWatch` counts, per holder, the requests this router sent there and has not
seen end (:meth:`Router.begin <kvevents.router.decide.router.Router.begin>` to
:meth:`~kvevents.router.decide.router.Router.finish`), and when the holder last
*progressed*: when it became busy (a first request in flight) or a request there ended
with the engine's answer. A holder with requests in flight that has not progressed for
the *stall time* is stalled, cause :data:`REQUESTS`: the oldest of its requests is
older than that, and none ended since. It is routable again as soon as a
request there ends answered, or once none is in flight there any more (they failed or
were given up: nothing then says it is still stuck, and the next request sent there
finds out, as a half-open circuit breaker does).

The stall time (:attr:`StallWatch.after_s`) is ``stall_after_s`` at most, and less when
requests are fast: :data:`STALL_FACTOR` times their typical duration, at least
:data:`STALL_FLOOR_S`. Under load a stopped rank fills up within a few request
durations, not within a fixed second, so the time to notice it must shrink with them
(``benchmarks/rank_stall.py`` stops one rank of four under 32 clients). The typical
duration is a running average of the durations of answered requests, over every holder
(a stalled holder has none to add), each taken at most :data:`_CLIPPED` times the
average, so that the stuck requests a rank answers at once when it resumes barely move
it. A rank busy with one request much longer than the others may be taken for stalled:
it is then passed over until that request ends, which costs it its share of new
requests for that long, never a request failed.

An engine whose load poll has had no answer for :attr:`StallWatch.engine_after_s`
seconds (:mod:`kvevents.router.fleet.engines`) has every rank stalled, cause
:data:`ENGINE`, until it answers again: a whole engine stopped, with no request of this
router in flight there to tell. The margin over ``stall_after_s`` is the engine's own
wait: the simulated engine's ``/load`` takes up to a second to report a stopped rank
down, which is the engine answering, not the engine stalled.

A stalled holder ranks with the unavailable ones (:mod:`kvevents.router.decide.load_board`):
never chosen while a candidate is available and not stalled, and chosen among the
stalled ones, by cost, when none is: a fleet whose requests are all slower than
``stall_after_s`` is stalled everywhere by this rule, and must still route.

What it costs a request: a clock read at begin and at finish, and one comparison of the
clock with :attr:`StallWatch.due` (the earliest moment a busy holder can become
stalled) per decision. Only past it are the busy holders scanned, O(busy holders), and
a stall changes one row of the board, which the routing scans read anyway.
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
