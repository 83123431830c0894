"""Hand items from the subscriber's socket thread to its consumer, sync or asyncio.

The producer puts *chunks* (lists of items, everything one poll produced), so the lock
and the wake-up are paid once per chunk, not once per item. The consumer takes items
one at a time.

Invariants
----------
* Items come out in the order they were put.
* At most ``max_items`` items wait; a producer putting into a full handoff waits (the
  socket thread then stops reading, ZMQ's high-water marks drop live messages, and the
  subscriber sees those drops as gaps and replays them). ``close`` releases it.
* An asyncio consumer never loses an item to cancellation: items are popped in the
  consumer's own coroutine, only the wake-up crosses threads.
* After ``close(error)``, consumers raise :class:`HandoffClosed` carrying ``error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import Generic, TypeVar

from kvevents.errors import KVEventsError

__all__ = ["Handoff", "HandoffClosed"]

T = TypeVar("T")


class HandoffClosed(KVEventsError):
    """The handoff was closed; ``error`` is what closed it, if it failed."""

    def __init__(self, error: BaseException | None = None) -> None:
        super().__init__("handoff closed" if error is None else f"handoff closed: {error!r}")
        self.error = error


class Handoff(Generic[T]):
    """A bounded, chunked, one-producer queue readable by threads and by asyncio."""

    def __init__(self, max_items: int = 100_000) -> None:
        if max_items < 1:
            raise ValueError(f"Handoff: max_items={max_items} must be at least 1")
        self.max_items = max_items
        self._cond = threading.Condition(threading.Lock())
        self._chunks: deque[list[T]] = deque()
        self._current: list[T] = []
        self._pos = 0
        self._count = 0  # items in _chunks plus those left in _current
        self._closed = False
        self._error: BaseException | None = None
        self._producer_waiting = False
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]] = []

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return self._count

    def put(self, chunk: list[T]) -> bool:
        """Queue a chunk, waiting while the handoff is full; False if it was closed."""
        if not chunk:
            return not self._closed
        with self._cond:
            while self._count >= self.max_items and not self._closed:
                self._producer_waiting = True
                self._cond.wait()
            if self._closed:
                return False
            self._chunks.append(chunk)
            self._count += len(chunk)
            self._cond.notify_all()
            waiters, self._async_waiters = self._async_waiters, []
        for loop, woken in waiters:
            # RuntimeError: that event loop is closed, nobody waits there any more
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, woken, True)
        return True

    def get(self, timeout: float | None = None) -> T | None:
        """The next item, or None after ``timeout`` seconds (None: wait as long as it takes).

        Raises :class:`HandoffClosed` once closed.
        """
        with self._cond:
            while True:
                if self._closed:
                    raise HandoffClosed(self._error)
                if self._count:
                    return self._pop()
                if not self._cond.wait(timeout):
                    return None

    def get_nowait(self) -> tuple[bool, T | None]:
        """``(True, item)`` if an item is ready, else ``(False, None)``; raises when closed."""
        with self._cond:
            if self._closed:
                raise HandoffClosed(self._error)
            if self._count:
                return True, self._pop()
            return False, None

    async def aget(self, timeout: float | None = None) -> T | None:
        """Like :meth:`get`, awaiting instead of blocking.

        A wait is one future on the consumer's loop, set from the producer's thread, and a
        timer for ``timeout``: no task per wait (``asyncio.wait_for`` made one), which a
        router following busy streams paid for every batch its loop waited for."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            with self._cond:
                if self._closed:
                    raise HandoffClosed(self._error)
                if self._count:
                    return self._pop()
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    return None
                woken: asyncio.Future[bool] = loop.create_future()
                self._async_waiters.append((loop, woken))
            timer = (
                None if remaining is None else loop.call_later(remaining, _resolve, woken, False)
            )
            try:
                if not await woken:
                    return None  # timed out
            finally:
                if timer is not None:
                    timer.cancel()

    def close(self, error: BaseException | None = None) -> None:
        """Close: waiting consumers and the producer wake up; items left are dropped."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._error = error
            self._chunks.clear()
            self._current, self._pos, self._count = [], 0, 0
            self._cond.notify_all()
            waiters, self._async_waiters = self._async_waiters, []
        for loop, woken in waiters:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, woken, True)

    def _pop(self) -> T:
        # caller holds the lock and has checked _count > 0
        if self._pos >= len(self._current):
            self._current = self._chunks.popleft()
            self._pos = 0
        item = self._current[self._pos]
        self._pos += 1
        self._count -= 1
        if self._producer_waiting and self._count < self.max_items:
            self._producer_waiting = False
            self._cond.notify_all()
        return item


def _resolve(woken: asyncio.Future[bool], put: bool) -> None:
    """Wake a waiting :meth:`Handoff.aget`: ``put`` True (something came, or the handoff
    closed: look again) or False (its timeout). A wait cancelled or already woken is left."""
    if not woken.done():
        woken.set_result(put)
