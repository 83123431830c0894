"""Writes held to the end of the event loop's round, so that one wake-up serves many.

A server under load reads requests from many connections in one round of its event
loop. Writing each answer as soon as it is computed wakes the client once per answer:
when the client is another process waiting in ``epoll_wait`` (a load generator, a
gateway, an engine's server), every write pays for waking it, and that cost (an
inter-processor interrupt, a VM exit, the scheduler) is charged to the writer. Held to
the end of the round, the answers leave in one burst: the first wakes the client, the
rest arrive while it is awake (docs/router-performance.md).

:class:`HeldWrites` wraps a transport: :meth:`HeldWrites.hold` keeps data for the end
of the round; every other write or close through the wrapper first writes what it
holds, so one connection's bytes always leave in the order given. The end of the round
is a ``call_soon`` callback scheduled when a round's first data is held: it runs before
the loop handles more I/O and before any task step scheduled after the hold, so a held
answer never waits for the next wake-up and never overtakes data written later.
``KVEVENTS_HOLD_WRITES=0`` writes at once instead (for comparisons).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

__all__ = ["HeldWrites", "holding_enabled"]

log = logging.getLogger(__name__)


def holding_enabled() -> bool:
    """False when ``KVEVENTS_HOLD_WRITES=0`` asks for every write at once."""
    return os.environ.get("KVEVENTS_HOLD_WRITES", "1") != "0"


class _Round:
    """The wrappers of one loop holding data in this round; released by one callback."""

    __slots__ = ("_holding", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._holding: list[HeldWrites] = []

    def add(self, held: HeldWrites) -> None:
        if not self._holding:
            self._loop.call_soon(self._release_all)
        self._holding.append(held)

    def _release_all(self) -> None:
        holding, self._holding = self._holding, []
        for held in holding:
            try:
                held.release()
            except Exception:  # one broken transport must not keep the others' answers
                log.exception("writing held data failed")


_ROUNDS: dict[asyncio.AbstractEventLoop, _Round] = {}


def _round_of(loop: asyncio.AbstractEventLoop) -> _Round:
    found = _ROUNDS.get(loop)
    if found is None:
        for gone in [other for other in _ROUNDS if other.is_closed()]:
            del _ROUNDS[gone]
        found = _ROUNDS[loop] = _Round(loop)
    return found


class HeldWrites:
    """A transport whose :meth:`hold` writes at the end of the loop's round; everything
    else is the wrapped transport's (see the module docstring)."""

    __slots__ = ("_held", "_round", "transport")

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        """The wrapped transport."""
        self._round = _round_of(loop)
        self._held: list[bytes] = []

    def hold(self, data: bytes) -> None:
        """Write ``data`` at the end of this round of the loop (see the module docstring)."""
        if not self._held:
            self._round.add(self)
        self._held.append(data)

    def release(self) -> None:
        """Write what is held now; dropped when the transport is closing (as a write to a
        closing transport is)."""
        held = self._held
        if not held:
            return
        self._held = []
        if not self.transport.is_closing():
            self.transport.write(held[0] if len(held) == 1 else b"".join(held))

    @property
    def holding(self) -> int:
        """Bytes held for the end of the round."""
        return sum(len(data) for data in self._held)

    # --- the transport's own members, ordered after what is held -------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held:
            self.release()
        self.transport.write(data)

    def writelines(self, lines: Any) -> None:
        if self._held:
            self.release()
        self.transport.writelines(lines)

    def write_eof(self) -> None:
        self.release()
        self.transport.write_eof()

    def close(self) -> None:
        self.release()
        self.transport.close()

    def abort(self) -> None:
        self._held = []
        self.transport.abort()

    def get_write_buffer_size(self) -> int:
        return int(self.transport.get_write_buffer_size()) + self.holding

    # --- the rest, passed through (named for speed where uvicorn calls them often) -

    def is_closing(self) -> bool:
        return bool(self.transport.is_closing())

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self.transport.pause_reading()

    def resume_reading(self) -> None:
        self.transport.resume_reading()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)
