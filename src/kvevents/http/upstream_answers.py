"""An engine's answer as the engine client hands it back: whole, or as it arrives.

:class:`FullResponse` is an answer read to its end (:meth:`Upstream.post_whole
<kvevents.http.upstream.Upstream.post_whole>`, every ``GET``); :class:`Response` one whose
head is in and whose body the caller reads (:meth:`Response.read`,
:meth:`Response.chunks`) or releases. A :class:`Response`'s connection goes back to the
pool only when its answer was read to the end; released earlier, it is closed. It reads
its connection through :class:`_AnswerConnection`, not the connection's class, so the
connection's module imports this one and not the reverse.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

__all__ = ["FullResponse", "Response"]


class _AnswerConnection(Protocol):
    """What a :class:`Response` reads of the connection its answer arrives on
    (:class:`~kvevents.http.upstream_connection.Connection`)."""

    closed: bool
    _complete: bool
    _error: BaseException | None
    _on_end: Callable[[], None] | None

    async def next_chunk(self) -> bytes | None: ...

    def release(self) -> None: ...


class FullResponse:
    """An engine's whole answer (:meth:`Upstream.post_whole`): ``status``, ``headers``
    (lower-case names) and ``body``."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        """The body parsed as JSON (UTF-8, -16 or -32, as :func:`json.loads` reads bytes);
        ValueError when it is not JSON."""
        return json.loads(self.body)


class Response:
    """An engine's answer: ``status``, ``headers`` (lower-case names) and the body."""

    __slots__ = ("_conn", "_done", "headers", "status")

    def __init__(self, conn: _AnswerConnection, status: int, headers: dict[str, str]) -> None:
        self._conn = conn
        self._done = False
        self.status = status
        self.headers = headers

    async def read(self) -> bytes:
        """The whole body (then the connection goes back to the pool)."""
        parts = [chunk async for chunk in self.chunks()]
        return b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives."""
        conn = self._conn
        while True:
            chunk = await conn.next_chunk()
            if chunk is None:
                self.release()
                return
            yield chunk

    def release(self) -> None:
        """Give the connection back when its answer was read to the end, else close it."""
        if self._done:
            return
        self._done = True
        self._conn.release()

    def on_end(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the answer has ended on the engine's side: all of it
        received (read by the caller or not), failed, or the connection closed; at once
        if it already has. A relayed stream counts its request off the engine then, not
        when a slow client has read the last of it."""
        conn = self._conn
        if self._done or conn._complete or conn._error is not None or conn.closed:
            callback()
            return
        conn._on_end = callback
