"""One timer for many deadlines: per-request timeouts that almost never fire.

Two timeouts are armed on every request the router relays: the forwarding client's
deadline for the engine's answer (:class:`~kvevents.router.upstream.Upstream`,
``--forward-timeout``) and, once the answer is written, the server's keep-alive timeout
for the client's connection (:mod:`kvevents.http_inline`); nearly every one is
cancelled long before it would fire. A timer each (``loop.call_later``, then
``cancel``) cost about 2 us of the event loop's CPU under uvloop, twice per relayed
request. :class:`Deadlines` keeps the items watched in a dict, each with its deadline,
and one timer, at the earliest deadline it has seen: watching and forgetting an item
are a dict store and a pop. When the timer fires, the items past their deadline are
expired (the callback given) and the timer is set again for the earliest one left, so
each still expires at its own deadline, not later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["Deadlines"]

T = TypeVar("T", bound=Hashable)


class Deadlines(Generic[T]):
    """Calls ``expire(item)`` for an item watched and not forgotten by its deadline
    (loop time); from the running event loop only, which the caller names (asking for
    it, ``asyncio.get_running_loop()``, is a ``getpid`` system call each time)."""

    def __init__(self, expire: Callable[[T], None]) -> None:
        self._expire = expire
        self._due: dict[T, float] = {}
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
        if loop is not self._loop:  # what another loop watched can never be served here
            self._due.clear()
            self._timer = None
            self._loop = loop
        self._due[item] = deadline
        if self._timer is None or deadline < self._at:
            self._arm(deadline)

    def forget(self, item: T) -> None:
        """``item`` ended in time: no longer watched (nothing when it was not)."""
        self._due.pop(item, None)

    def _arm(self, at: float) -> None:
        assert self._loop is not None
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._at = self._loop.call_at(at, self._fire), at

    def _fire(self) -> None:
        self._timer = None
        assert self._loop is not None
        now = self._loop.time()
        overdue = [item for item, at in self._due.items() if at <= now]
        for item in overdue:
            # an expiry may end others (forgetting them): each is expired once, if still due
            if self._due.pop(item, None) is not None:
                self._expire(item)
        if self._due and self._timer is None:  # an expiry may have watched a new item
            self._arm(min(self._due.values()))
