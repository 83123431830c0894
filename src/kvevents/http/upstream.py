"""The client for requests to engines: kept-alive HTTP/1.1, nothing more.

Every request the router forwards (``/v1/completions``, ``/v1/chat/completions``,
``/generate``) is one ``POST`` with a body the router already holds, to an engine it
talks to all day. :class:`Upstream` does only that: a pool of kept-alive connections per
engine, head and body in one write, the answer parsed by httptools (the router server's
parser), handed back whole (:meth:`Response.read`) or as it arrives
(:meth:`Response.chunks`). Every other request the router sends an engine (the load
polls, registration and discovery, its models, a prefill's bootstrap port) is a ``GET``
through :meth:`Upstream.get` or :meth:`Upstream.get_json` on the same connections, with
the same key and TLS context. :meth:`Upstream.post_whole` resolves one future from the
parser's callbacks, so a relay on a kept-alive connection runs no task and no coroutine;
it and :meth:`Upstream.post_head` write the request on a kept-alive connection before
they return, so legs sent together leave together.
Why its own client: a general client's per-request machinery (sessions, connectors,
timers, header multidicts) cost more of the router's CPU than the relay's own work
(docs/router-performance.md). A decode engine takes its prefills' hand-offs with it too
(:mod:`kvevents.engine.bootstrap`).

What it does and does not do:

* ``http://`` and ``https://`` (the service's shared TLS context); ``Host`` and
  ``Content-Length`` are its own, the caller's headers go as given.
* One deadline per request (``timeout``, the router's ``--forward-timeout``) for
  connecting, the head and the whole body; connecting has its own limit too. Past it,
  :class:`TimeoutError`; an unreachable engine, a connection closed midway or an answer
  that is not HTTP, :class:`UpstreamError`.
* An idle connection is kept ``idle_s`` seconds, less than uvicorn's keep-alive, so a
  request never goes out on a connection the server is closing; newest first. A
  forwarded ``POST`` is never retried (it may have started a generation); a ``GET`` or a
  ``POST`` that changes nothing (:meth:`Upstream.post_safe`) that failed on a kept-alive
  connection before its answer began is sent once more, on a new connection.
* A stream is read as the reader takes it: past ``_PAUSE_AT`` bytes unread, the socket
  pauses.
* An answer's head is bounded apart from its body (``max_head_bytes``, ``head_timeout``):
  it is parsed as it arrives, so an unbounded one would hold the event loop and memory.
  Past either, :class:`HeadTooLarge` or :class:`TimeoutError`, and the connection closes.
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from kvevents.errors import KVEventsError
from kvevents.http.auth import ClientCredentials
from kvevents.http.deadlines import Deadlines

__all__ = ["FullResponse", "HeadTooLarge", "MidwayError", "Response", "Upstream", "UpstreamError"]

DEFAULT_MAX_HEAD_BYTES = 256 * 1024
DEFAULT_HEAD_TIMEOUT_S = 30.0

_PAUSE_AT = 256 * 1024
_RESUME_AT = 64 * 1024


class UpstreamError(KVEventsError, ConnectionError):
    """The engine could not be reached, or did not answer in HTTP to its end."""


class HeadTooLarge(UpstreamError):
    """The engine's answer head went past the client's bound (``max_head_bytes``)."""


class MidwayError(UpstreamError):
    """The engine's answer began (``status``) but did not arrive whole: ``cause`` says why
    (an :class:`UpstreamError`, or a :class:`TimeoutError` past the deadline)."""

    def __init__(self, status: int, cause: BaseException) -> None:
        super().__init__(f"the answer ({status}) stopped midway: {cause or type(cause).__name__}")
        self.status = status
        self.cause = cause


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


class _Origin:
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
        self.idle: list[tuple[float, _Connection]] = []
        """Kept-alive connections and when each became idle, the newest last."""


class Response:
    """An engine's answer: ``status``, ``headers`` (lower-case names) and the body."""

    __slots__ = ("_conn", "_done", "headers", "status")

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
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


class _Connection(asyncio.Protocol):
    """One connection, one exchange at a time; httptools parses the answers."""

    def __init__(
        self, upstream: Upstream, origin: _Origin, loop: asyncio.AbstractEventLoop
    ) -> None:
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
        sees the client leave, as :func:`_exchange` makes it see a cancelled await."""
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


class Upstream:
    """Forwards ``POST`` requests to engines, and polls them with ``GET``, over a pool of
    kept-alive connections per engine.

    ``tls``: the context ``https://`` engines are verified with (the router's, from
    ``--ssl-ca-certs``); None trusts the system's store (``SSL_CERT_FILE`` and
    ``SSL_CERT_DIR`` honoured), as the router does without ``--ssl-ca-certs``, through
    one context for the process (making one per connection read the store each time)."""

    def __init__(
        self,
        *,
        timeout: float,
        connect_timeout: float = 5.0,
        headers: Mapping[str, str] | None = None,
        tls: ssl.SSLContext | None = None,
        idle_s: float = 2.0,
        max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
        head_timeout: float = DEFAULT_HEAD_TIMEOUT_S,
    ) -> None:
        if max_head_bytes < 1:
            raise ValueError(f"max_head_bytes={max_head_bytes}: give a positive number of bytes")
        if not head_timeout > 0:
            raise ValueError(f"head_timeout={head_timeout}: give a positive number of seconds")
        self.timeout = timeout
        self.max_head_bytes = max_head_bytes
        self.head_timeout = head_timeout
        self.connect_timeout = connect_timeout
        self.idle_s = idle_s
        self._tls = tls
        self._fixed = b"".join(_header_line(k, v) for k, v in (headers or {}).items())
        self._origins: dict[str, _Origin] = {}
        self._closed = False
        self.deadlines: Deadlines[_Connection] = Deadlines(_Connection._timed_out)
        """The exchanges in flight, each failed with TimeoutError at its deadline."""

    async def post(
        self,
        base: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | bytes,
        *,
        timeout: float | None = None,
    ) -> Response:
        """POST ``body`` to ``base + path``; the answer once its head is in.

        :class:`UpstreamError` or :class:`TimeoutError` when there is none; the body
        must then be read (:meth:`Response.read`, :meth:`Response.chunks`) or the
        response released. ``timeout``: seconds for the whole exchange, instead of the
        client's own (a leg of disaggregated serving has its own deadline).
        """
        origin, deadline, conn, head = self._start(base, path, body, headers, timeout)
        conn = conn or await self._connect(origin, deadline)
        response: Response = await _exchange(conn, head, body, deadline, whole=False)
        return response

    def post_whole(
        self,
        base: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | bytes,
        *,
        timeout: float | None = None,
    ) -> asyncio.Future[FullResponse]:
        """POST ``body`` to ``base + path``; a future of the whole answer.

        It fails with :class:`UpstreamError` or :class:`TimeoutError` when no answer
        began, and with :class:`MidwayError` when one began but did not arrive whole.
        On a kept-alive connection the request is written before this returns and the
        future is the exchange's own; a new connection is opened by a task first.
        Cancelling the future closes the connection. ``timeout``: as :meth:`post`'s.
        """
        future: asyncio.Future[FullResponse] = self._post_now(
            base, path, body, headers, timeout, whole=True
        )
        return future

    def post_head(
        self,
        base: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | bytes,
        *,
        timeout: float | None = None,
    ) -> asyncio.Future[Response]:
        """:meth:`post`, written now: on a kept-alive connection the request is on the
        wire before this returns (a new connection is opened by a task first), and the
        future is its :class:`Response` once the head is in. Errors, the body and
        ``timeout`` as :meth:`post`'s; cancelling the future closes the connection. Two
        legs sent one after the other this way leave in one step of the loop, before
        anything else it has to do."""
        future: asyncio.Future[Response] = self._post_now(
            base, path, body, headers, timeout, whole=False
        )
        return future

    def _post_now(
        self,
        base: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | bytes,
        timeout: float | None,
        *,
        whole: bool,
    ) -> asyncio.Future[Any]:
        try:
            origin, deadline, conn, head = self._start(base, path, body, headers, timeout)
        except UpstreamError as exc:
            refused: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            refused.set_exception(exc)
            return refused
        if conn is None:
            return asyncio.get_running_loop().create_task(
                self._connect_then_send(origin, deadline, head, body, whole)
            )
        pending = conn.send(head, body, deadline, whole=whole)
        pending.add_done_callback(conn.closed_if_cancelled)
        return pending

    async def _connect_then_send(
        self, origin: _Origin, deadline: float, head: bytes, body: bytes, whole: bool
    ) -> Any:
        conn = await self._connect(origin, deadline)
        return await _exchange(conn, head, body, deadline, whole=whole)

    async def get(
        self,
        base: str,
        path: str,
        *,
        timeout: float,
        on_head: Callable[[], None] | None = None,
    ) -> FullResponse:
        """GET ``base + path`` and its whole answer within ``timeout`` seconds: the
        engines' load polls (:mod:`kvevents.router.fleet.engines`), on the same kept-alive
        connections as the requests forwarded to them. ``on_head`` is called when the
        answer's head is read, before its body (a load poll notes then what had ended:
        the engine counted before it answered).

        Errors as :meth:`post_whole`'s. A GET changes nothing on the engine, so one that
        failed on a kept-alive connection (the engine closed it as the request left) is
        sent once more on a new connection.
        """
        if self._closed:
            raise UpstreamError("the client is closed: its process is shutting down")
        origin = self._origin(base)
        now = asyncio.get_running_loop().time()
        head = b"GET %s%s HTTP/1.1\r\nHost: %s\r\n%s\r\n" % (
            origin.prefix.encode("latin-1"),
            path.encode("latin-1"),
            origin.netloc,
            self._fixed,
        )
        conn = self._idle(origin, now)
        return await self._send_safe(origin, now + timeout, conn, head, b"", on_head)

    async def get_json(self, base: str, path: str, *, timeout: float) -> tuple[int, Any]:
        """GET ``base + path`` within ``timeout`` seconds: the answer's status and, for a
        200, its body parsed as JSON (None for any other status: that body is the
        engine's error page, not the document asked for). The engines' rare reads
        (``/server_info``, ``/v1/models``) take this.

        ValueError, naming the URL, when a 200's body is not JSON; otherwise errors as
        :meth:`get`'s (sent once more on a new connection in the same case).
        """
        response = await self.get(base, path, timeout=timeout)
        if response.status != 200:
            return response.status, None
        try:
            return 200, response.json()
        except ValueError as exc:
            raise ValueError(
                f"GET {base}{path} answered 200 with a body that is not JSON: {exc}"
            ) from None

    async def post_safe(
        self,
        base: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        timeout: float | None = None,
    ) -> FullResponse:
        """:meth:`post_whole` for a POST that changes nothing on the engine (``/tokenize``):
        like :meth:`get`, one that failed on a kept-alive connection before its answer
        began is sent once more on a new connection. ``timeout``: seconds for the whole
        exchange, instead of the client's own."""
        origin, deadline, conn, head = self._start(base, path, body, headers, timeout)
        return await self._send_safe(origin, deadline, conn, head, body)

    async def _send_safe(
        self,
        origin: _Origin,
        deadline: float,
        conn: _Connection | None,
        head: bytes,
        body: bytes,
        on_head: Callable[[], None] | None = None,
    ) -> FullResponse:
        """The whole answer to a request that may be sent twice: on ``conn`` (kept alive)
        first, then once on a new connection if that one failed before an answer began."""
        if conn is not None:
            try:
                kept: FullResponse = await _exchange(
                    conn, head, body, deadline, whole=True, on_head=on_head
                )
                return kept
            except MidwayError:
                raise  # an answer began: the engine took the request
            except UpstreamError:
                pass
        conn = await self._connect(origin, deadline)
        response: FullResponse = await _exchange(
            conn, head, body, deadline, whole=True, on_head=on_head
        )
        return response

    def _origin(self, base: str) -> _Origin:
        """The pool of ``base`` (an engine's URL), made on its first request."""
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origins[base] = _Origin(base)
        return origin

    def _start(
        self,
        base: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | bytes,
        timeout: float | None = None,
    ) -> tuple[_Origin, float, _Connection | None, bytes]:
        """Where the request goes, its deadline, a kept-alive connection if one is free,
        and its head (built first: a header it refuses takes no connection from the pool).
        ``headers`` may be their lines already written (``name: value\\r\\n`` each, checked
        by the caller: the relay's, :func:`kvevents.router.serve.openai_relay._request_lines`)."""
        if self._closed:
            raise UpstreamError("the router is shutting down: forwarding is closed")
        origin = self._origin(base)
        idle = origin.idle
        # the newest idle connection's loop is the running one (asked only when there is
        # none: each ask is a getpid system call)
        now = (idle[-1][1].loop if idle else asyncio.get_running_loop()).time()
        lines = [
            b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n"
            % (origin.prefix.encode("latin-1"), path.encode("latin-1"), origin.netloc, len(body)),
            self._fixed,
        ]
        if isinstance(headers, bytes):
            lines.append(headers)
        else:
            lines.extend(_header_line(k, v) for k, v in headers.items())
        lines.append(b"\r\n")
        deadline = now + (self.timeout if timeout is None else timeout)
        return origin, deadline, self._idle(origin, now), b"".join(lines)

    def keep(self, origin: _Origin, conn: _Connection) -> None:
        """Take a connection back whose exchange ended cleanly."""
        if self._closed:
            conn.close()
            return
        origin.idle.append((conn.loop.time(), conn))

    async def close(self) -> None:
        """Close every idle connection; later requests are refused."""
        self._closed = True
        for origin in self._origins.values():
            for _, conn in origin.idle:
                conn.close()
            origin.idle.clear()

    def _idle(self, origin: _Origin, now: float) -> _Connection | None:
        idle = origin.idle
        while idle:
            since, conn = idle.pop()
            if not conn.closed and now - since < self.idle_s:
                if idle and now - idle[0][0] >= self.idle_s:
                    self._expire(idle, now)
                return conn
            conn.close()
        return None

    def _expire(self, idle: list[tuple[float, _Connection]], now: float) -> None:
        keep = [(since, conn) for since, conn in idle if now - since < self.idle_s]
        for since, conn in idle:
            if now - since >= self.idle_s:
                conn.close()
        idle[:] = keep

    async def _connect(self, origin: _Origin, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(self, origin, loop)
        limit = min(deadline, loop.time() + self.connect_timeout)
        kwargs: dict[str, Any] = {}
        if origin.tls:
            kwargs = {
                # without the service's context: the system's trust store, as the
                # router's own (--ssl-ca-certs unset), one context for the process
                "ssl": self._tls or ClientCredentials().ssl_context(),
                "server_hostname": origin.host,
            }
        try:
            await asyncio.wait_for(
                loop.create_connection(lambda: conn, origin.host, origin.port, **kwargs),
                limit - loop.time(),
            )
        except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
            raise UpstreamError(
                f"no connection to {origin.host}:{origin.port} within {self.connect_timeout:g} s"
            ) from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {origin.host}:{origin.port}: {exc}") from None
        return conn


async def _exchange(
    conn: _Connection,
    head: bytes,
    body: bytes,
    deadline: float,
    *,
    whole: bool,
    on_head: Callable[[], None] | None = None,
) -> Any:
    """One exchange on ``conn`` (:meth:`_Connection.send`), awaited; a timeout, a cancel or
    a failure ends it, and the connection is closed."""
    pending = conn.send(head, body, deadline, whole=whole, on_head=on_head)
    try:
        return await pending
    except BaseException:
        conn.close()
        raise


def _header_line(name: str, value: str) -> bytes:
    if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
        raise ValueError(f"header {name!r}: a name or value with a line break or colon")
    return b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
