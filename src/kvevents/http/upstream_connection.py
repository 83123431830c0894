"""One kept-alive connection to an engine, one exchange at a time, and its engine's pool.

:class:`Connection` is the asyncio protocol under :class:`~kvevents.http.upstream.Upstream`:
the request's head and body leave in one write, httptools (the router server's parser)
parses the answer as it arrives, and the exchange's future is resolved from the parser's
callbacks (a relay on a kept-alive connection runs no task and no coroutine): its
:class:`~kvevents.http.upstream_answers.Response` once the head is in, or its
:class:`~kvevents.http.upstream_answers.FullResponse` once all of it is. :class:`Origin` is an engine's URL parsed once, with its idle connections.

* A stream is read as the reader takes it: past ``_PAUSE_AT`` bytes unread, the socket
  pauses.
* An answer's head is bounded apart from its body (the client's ``max_head_bytes`` and
  ``head_timeout``): it is parsed as it arrives, so an unbounded one would hold the event
  loop and memory. Past either, :class:`~kvevents.http.upstream_errors.HeadTooLarge` or
  :class:`TimeoutError`, and the connection closes.
* A connection goes back to the pool only after an exchange that ended cleanly; a
  failure, a deadline or a cancel closes it.

A connection reads its client through :class:`_Owner`, not the client's class, so the
client's module imports this one and not the reverse.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import Callable
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import httptools

from kvevents.http.deadlines import Deadlines
from kvevents.http.upstream_answers import FullResponse, Response
from kvevents.http.upstream_errors import HeadTooLarge, MidwayError, UpstreamError

__all__ = ["Connection", "Origin", "exchange"]

_PAUSE_AT = 256 * 1024
_RESUME_AT = 64 * 1024


class _Owner(Protocol):
    """What a :class:`Connection` reads of the client it belongs to
    (:class:`~kvevents.http.upstream.Upstream`)."""

    max_head_bytes: int
    head_timeout: float
    deadlines: Deadlines[Connection]

    def keep(self, origin: Origin, conn: Connection) -> None: ...


class Origin:
    """Where a base URL's connections go, parsed once."""

    __slots__ = ("host", "idle", "netloc", "port", "prefix", "tls")

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL {base!r}: give http://HOST[:PORT] or https://...")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.netloc = parts.netloc.rpartition("@")[2].encode("latin-1")
        self.prefix = parts.path.rstrip("/")
        self.idle: list[tuple[float, Connection]] = []
        """Kept-alive connections and when each became idle, the newest last."""


class Connection(asyncio.Protocol):
    """One connection, one exchange at a time; httptools parses the answers."""

    def __init__(self, upstream: _Owner, origin: Origin, loop: asyncio.AbstractEventLoop) -> None:
        self._upstream = upstream
        self._origin = origin
        self.loop = loop
        """The loop the connection lives on: read from here on the per-request path, as
        ``asyncio.get_running_loop()`` makes a ``getpid`` system call each time."""
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._headers: dict[str, str] = {}
        self._head: asyncio.Future[Any] | None = None
        """The exchange's future: its :class:`Response` once the head is in, or (``_whole``)
        its :class:`FullResponse` once all of it is."""
        self._whole = False
        self._on_head: Callable[[], None] | None = None
        """Called once the final answer's head is in (see :meth:`Upstream.get`)."""
        self._on_end: Callable[[], None] | None = None
        """Called once the answer has ended (see :meth:`Response.on_end`)."""
        self._status = 0  # the final answer's status, once its head is in
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._framed = True  # the body's end is marked by a length or chunking
        self._keep_alive = False
        self._error: BaseException | None = None
        self.closed = False
        self._head_bytes = 0
        """Bytes of the answer read while its final head is not yet whole."""
        self._deadline = 0.0
        """The exchange's own deadline (loop time); the head's may be earlier."""

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._head is None or self._complete:
            self._fail(UpstreamError("the engine sent bytes no request asked for"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("the engine answered with a protocol upgrade"))
            return
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"the engine's answer is not HTTP: {exc}"))
            return
        if not self._status and self._head is not None:  # the head is still coming
            self._head_growing(len(data))

    def _head_growing(self, more: int) -> None:
        """Every byte read so far is head: bound its size, and its time from its first byte."""
        upstream = self._upstream
        first = self._head_bytes == 0
        self._head_bytes += more
        if self._head_bytes > upstream.max_head_bytes:
            self._fail(
                HeadTooLarge(
                    f"the engine's answer head is larger than {upstream.max_head_bytes} bytes"
                    " (the router's bound on an engine answer's head)"
                )
            )
        elif first:
            at = self.loop.time() + upstream.head_timeout
            if at < self._deadline:
                upstream.deadlines.watch(self, at, self.loop)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._head is None or self._complete:
            return
        if self._status and not self._framed and exc is None and self._error is None:
            self.on_message_complete()  # a body without a length ends with the connection
            return  # (closed cleanly by the engine: a reset, or our own close after a
            # failure such as the deadline, leaves it cut short, and fails below)
        why = f": {exc}" if exc else ""
        self._fail(UpstreamError(f"the engine closed the connection midway{why}"))

    def pause_writing(self) -> None:  # a 2,048-token body fits in the socket buffer
        pass

    def resume_writing(self) -> None:
        pass

    # --- httptools callbacks ---

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        head = self._head
        assert head is not None
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim answer: the final one follows
            self._headers = {}
            return
        headers = self._headers
        self._status = status
        if self._head_bytes:  # the head came in pieces: the exchange's deadline again
            self._head_bytes = 0
            self._upstream.deadlines.watch(self, self._deadline, self.loop)
        on_head, self._on_head = self._on_head, None
        if on_head is not None:
            on_head()
        self._framed = "content-length" in headers or "transfer-encoding" in headers
        self._keep_alive = self._parser.should_keep_alive()  # reset by the message's end
        if not self._whole and not head.done():
            head.set_result(Response(self, status, headers))

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        if self._whole:
            return  # taken whole: no reader to wait for
        self._buffered += len(body)
        if self._buffered > _PAUSE_AT and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._parser.get_status_code() < 200:
            return  # an interim answer's end: the parser goes on to the final one
        self._complete = True
        self._forget_deadline()  # all of it is in: the deadline no longer applies
        if self._whole:
            self._hand_over()
            return
        self._ended()
        self._wake()

    def _hand_over(self) -> None:
        """A whole answer is in: it resolves the exchange's future, and the connection
        goes back to the pool (or is closed when it cannot be reused)."""
        head = self._head
        assert head is not None
        answer = FullResponse(self._status, self._headers, b"".join(self._chunks))
        self._chunks.clear()
        if head.done():  # cancelled: nobody takes it
            self.close()
            return
        self.release()
        head.set_result(answer)

    # --- used by Upstream and Response ---

    def send(
        self,
        head: bytes,
        body: bytes,
        deadline: float,
        *,
        whole: bool = False,
        on_head: Callable[[], None] | None = None,
    ) -> asyncio.Future[Any]:
        """Write the request; the answer's head arrives in the future returned (its
        :class:`Response`), or with ``whole`` all of it does (its :class:`FullResponse`).
        At ``deadline`` (loop time) an exchange not yet over fails with TimeoutError.
        ``on_head`` is called as the final answer's head is read."""
        assert self._transport is not None
        loop = self.loop
        self._whole = whole
        self._on_head = on_head
        self._on_end = None
        self._head = loop.create_future()
        self._head_bytes = 0
        self._deadline = deadline
        self._upstream.deadlines.watch(self, deadline, loop)
        self._transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self._transport.write(body)
        return self._head

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body, or None at its end."""
        while not self._chunks:
            if self._complete:
                return None
            if self._error is not None:
                raise self._error
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._paused and self._buffered < _RESUME_AT and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return chunk

    def release(self) -> None:
        reusable = (
            self._complete
            and not self.closed
            and self._error is None
            and not self._chunks
            and self._keep_alive
        )
        if reusable:
            self._forget_deadline()
            self._head = None
            self._complete = False
            self._status = 0
            self._headers = {}
            self._upstream.keep(self._origin, self)
        else:
            self.close()

    def closed_if_cancelled(self, exchange: asyncio.Future[Any]) -> None:
        """Close the connection when ``exchange`` (its future) was cancelled: the engine
        sees the client leave, as :func:`exchange` makes it see a cancelled await."""
        if exchange.cancelled():
            self.close()

    def close(self) -> None:
        self._forget_deadline()
        self.closed = True
        if self._transport is not None:
            self._transport.close()
        self._ended()

    def _ended(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()

    def _forget_deadline(self) -> None:
        self._upstream.deadlines.forget(self)

    def _timed_out(self) -> None:
        """The exchange's deadline, or its head's, passed before it ended."""
        if self._head_bytes and not self._status:
            self._fail(
                TimeoutError(
                    f"the engine's answer head did not arrive whole within"
                    f" {self._upstream.head_timeout:g} s of its first byte"
                )
            )
            return
        self._fail(TimeoutError())

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        head = self._head
        if head is not None and not head.done():
            head.set_exception(MidwayError(self._status, error) if self._status else error)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        self.close()


async def exchange(
    conn: Connection,
    head: bytes,
    body: bytes,
    deadline: float,
    *,
    whole: bool,
    on_head: Callable[[], None] | None = None,
) -> Any:
    """One exchange on ``conn`` (:meth:`Connection.send`), awaited; a timeout, a cancel or
    a failure ends it, and the connection is closed."""
    pending = conn.send(head, body, deadline, whole=whole, on_head=on_head)
    try:
        return await pending
    except BaseException:
        conn.close()
        raise
