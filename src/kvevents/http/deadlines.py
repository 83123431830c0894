"""One timer for many deadlines: per-request timeouts that almost never fire.

Two timeouts are armed on every request the router relays, the forwarding client's
deadline for the engine's answer (:class:`~kvevents.http.upstream.Upstream`) and the
keep-alive timeout of the client's connection (:mod:`kvevents.http.inline`), and nearly
every one is cancelled long before it would fire; a ``loop.call_later`` and ``cancel``
each cost more of the event loop than the rest of the bookkeeping. :class:`Deadlines`
keeps the watched items in a dict, each with its deadline, and one timer at the earliest
deadline it has seen: watching and forgetting are a dict store and a pop. When the timer
fires, the items past their deadline expire (the callback given) and the timer is set
again for the earliest one left, so each expires at its own deadline, not later.

Items watched with one timeout come in deadline order, so a firing reads only the items
it expires and the next one; a deadline earlier than one watched before makes a firing
look at every item until the dict empties again. A deadline counts as due within the
loop clock's resolution (uvloop's timers may fire that much early), so a timer never
fires again and again just before one.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["Deadlines"]

T = TypeVar("T", bound=Hashable)

_RESOLUTION_S = 0.001
"""A deadline this close ahead counts as due (the coarsest loop clock: uvloop's)."""


class Deadlines(Generic[T]):
    """Calls ``expire(item)`` for an item watched and not forgotten by its deadline
    (loop time). From one event loop at a time, which the caller names (asking for it,
    ``asyncio.get_running_loop()``, is a ``getpid`` system call each time): a watch from
    another loop drops what the previous one watched (its items, connections of that
    loop, cannot be served from this one), and that loop's timer, should it still fire,
    does nothing. An expiry that raises is reported to the loop's exception handler;
    the others go on."""

    def __init__(self, expire: Callable[[T], None]) -> None:
        self._expire = expire
        self._due: dict[T, float] = {}
        self._latest = -math.inf
        self._in_order = True
        """The dict's order is its deadlines' order (each watch no earlier than the last)."""
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0
        """When the timer fires (valid while ``_timer`` is set)."""
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        """Items watched now."""
        return len(self._due)

    def watch(self, item: T, deadline: float, loop: asyncio.AbstractEventLoop) -> None:
        """Expire ``item`` at ``deadline`` (``loop``'s time; the running loop) unless it
        is forgotten first (a later call for the same item moves its deadline)."""
        due = self._due
        if loop is not self._loop:
            due = self._due = {}
            self._latest, self._in_order = -math.inf, True
            self._timer, self._loop = None, loop
        elif item in due:
            del due[item]  # to the end, where its new deadline belongs
        due[item] = deadline
        if deadline >= self._latest:
            self._latest = deadline
        else:
            self._in_order = False
        if self._timer is None or deadline < self._at:
            self._arm(loop, deadline)

    def oldest(self) -> T | None:
        """The item watched longest (the first of the dict: its order is the watches'), or
        None when none is."""
        return next(iter(self._due), None)

    def forget(self, item: T) -> None:
        """``item`` ended in time: no longer watched (nothing when it was not)."""
        due = self._due
        if due.pop(item, None) is not None and not due:
            self._latest, self._in_order = -math.inf, True

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._at = loop.call_at(at, self._fire, loop), at

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:
            return  # the timer of a loop left behind: its items were dropped
        self._timer = None
        due = self._due
        horizon = loop.time() + _RESOLUTION_S
        overdue: list[tuple[T, float]] = []
        if self._in_order:
            for item, at in due.items():
                if at > horizon:
                    break
                overdue.append((item, at))
        else:
            overdue = [(item, at) for item, at in due.items() if at <= horizon]
        try:
            for item, at in overdue:
                # an expiry may end others (forgetting them) or watch them again: each
                # is expired once, and only at the deadline it still has
                if due.get(item) != at:
                    continue
                del due[item]
                try:
                    self._expire(item)
                except Exception as exc:
                    loop.call_exception_handler(
                        {"message": "a deadline's expiry failed", "exception": exc}
                    )
        finally:
            self._arm_for_the_rest(loop)

    def _arm_for_the_rest(self, loop: asyncio.AbstractEventLoop) -> None:
        """After a firing: the timer at the earliest deadline left, unless an expiry
        that watched an item has set it earlier already."""
        due = self._due
        if not due:
            self._latest, self._in_order = -math.inf, True
            return
        earliest = next(iter(due.values())) if self._in_order else min(due.values())
        if self._timer is None or earliest < self._at:
            self._arm(loop, earliest)
