"""Ctrl-C and SIGTERM in ``kvevents demo``: stop at a safe point, then clean up.

Python runs a signal handler in the main thread between two bytecodes, wherever that
thread is. Raising ``KeyboardInterrupt`` there, as Python's own SIGINT handler does, is
fine in plain synchronous code but not inside an event loop: in an anyio task group
(httpx runs one while it opens a connection) it is wrapped in a ``BaseExceptionGroup``,
which ``except KeyboardInterrupt`` does not catch, and the demo would exit 1 with a
traceback instead of 130, depending on where the signal landed.

:class:`Interrupts` handles SIGINT and SIGTERM alike, in one of three modes:

* ``raise`` (synchronous code, the default): the first signal raises
  ``KeyboardInterrupt`` where the main thread is, as Ctrl-C does;
* ``cancel`` (inside :meth:`Interrupts.run`): the signal cancels the event loop's main
  task, which unwinds through every ``finally`` and task group as a cancellation; once
  ``asyncio.run`` has returned, ``KeyboardInterrupt`` is raised from synchronous code;
* ``defer`` (inside :meth:`Interrupts.deferred`, i.e. cleanup): the signal is only
  recorded, so a second Ctrl-C cannot cut the stopping of child processes short;
  ``KeyboardInterrupt`` is raised when the block ends.

Only the first signal ever raises; later ones are recorded (``received``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine, Iterator
from types import FrameType, TracebackType
from typing import Any, TypeVar

__all__ = ["SIGNALS", "Interrupts"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)

T = TypeVar("T")

_Handler = Callable[[int, FrameType | None], Any] | int | None


class Interrupts:
    """SIGINT/SIGTERM handling for the demo; a context manager that installs it.

    Installing replaces the handlers of :data:`SIGNALS` (main thread only); leaving
    restores the previous ones. See the module docstring for the modes.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._mode = "raise"
        self._cancel: Callable[[], object] | None = None
        self._previous: dict[int, _Handler] = {}

    def __enter__(self) -> Interrupts:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if self._mode == "cancel" and self._cancel is not None:
            self._cancel()
        elif self._mode == "raise" and len(self.received) == 1:
            raise KeyboardInterrupt

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        """``asyncio.run(main)``, a signal cancelling ``main`` instead of raising inside it.

        Raises ``KeyboardInterrupt`` (after the loop has shut down) if a signal arrived.
        """
        outer = self._mode
        self._mode = "defer"  # until the loop runs: asyncio.run's own setup
        try:
            if self.received:
                main.close()
                raise KeyboardInterrupt
            try:
                return asyncio.run(self._guarded(main))
            except asyncio.CancelledError:
                if not self.received:
                    raise
                raise KeyboardInterrupt from None
        finally:
            self._mode = outer

    async def _guarded(self, main: Coroutine[Any, Any, T]) -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._cancel = lambda: loop.call_soon_threadsafe(task.cancel)
        self._mode = "cancel"
        try:
            if self.received:  # arrived while the loop was starting
                main.close()
                raise asyncio.CancelledError
            result = await main
        finally:
            self._mode = "defer"  # asyncio.run's shutdown follows
            self._cancel = None
        if self.received:  # arrived as main was returning: too late to cancel it
            raise asyncio.CancelledError
        return result

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Signals only recorded inside the block; ``KeyboardInterrupt`` after it if one came.

        An exception already leaving the block is not replaced.
        """
        outer = self._mode
        before = len(self.received)
        self._mode = "defer"
        try:
            yield
        finally:
            self._mode = outer
        if len(self.received) > before:
            raise KeyboardInterrupt
