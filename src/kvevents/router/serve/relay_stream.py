"""A streamed answer's two loose ends: the usage its last event reports, and its life
bound to the client's.

A stream is relayed chunk by chunk as the engine sends it; when the client goes away the
relay stops, releases the engine's connection and ends the request's in-flight count, as
it does when the stream ends. Usage is read from the ``data:`` lines as they pass, never
from the stream kept whole.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec

from kvevents.router.serve.request_stats import engine_usage

__all__ = ["UsageTracker", "until_gone"]


class UsageTracker:
    """Remembers the last SSE ``data:`` line that carries usage (``include_usage``)."""

    def __init__(self) -> None:
        self._partial = b""
        self.last: bytes | None = None

    def feed(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()[-65536:]
        for line in lines:
            if line.startswith(b"data:") and b'"usage"' in line:
                self.last = line[5:].strip()

    def usage(self) -> tuple[int, int] | None:
        if self.last is None:
            return None
        try:
            return engine_usage(msgspec.json.decode(self.last))
        except msgspec.DecodeError:
            return None


async def until_gone(
    relay: Awaitable[None],
    gone: Awaitable[Any],
    stream: AsyncIterator[bytes],
    release: Callable[[], None] | None = None,
) -> None:
    """Run ``relay`` until it ends or ``gone`` (the client left) does, whichever is first;
    then close ``stream`` and call ``release``, so the engine's connection and the
    in-flight count are freed even when the relay stopped before the stream started."""
    relaying, watching = asyncio.ensure_future(relay), asyncio.ensure_future(gone)
    try:
        await asyncio.wait((relaying, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (relaying, watching):
            task.cancel()
        # Only the relay is awaited: the watch of the client ends with its connection,
        # which a kept-alive client keeps open.
        results = await asyncio.gather(relaying, return_exceptions=True)
        close = getattr(stream, "aclose", None)
        if close is not None:
            with contextlib.suppress(RuntimeError):  # already closed by its own end
                await close()
        if release is not None:
            release()
    error = results[0]
    if isinstance(error, BaseException) and not isinstance(
        error, (asyncio.CancelledError, OSError, RuntimeError)
    ):
        raise error  # a bug, not the client leaving: let the server log it
