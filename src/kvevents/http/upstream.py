"""The client for requests to engines: kept-alive HTTP/1.1, nothing more.

Every request the router forwards (``/v1/completions``, ``/v1/chat/completions``,
``/generate``) is one ``POST`` with a body the router already holds, to an engine it
talks to all day; every other one it sends an engine (load polls, registration and
discovery, models, a prefill's bootstrap port) is a ``GET`` (:meth:`Upstream.get`,
:meth:`Upstream.get_json`). :class:`Upstream` sends both on one pool of kept-alive
connections per engine (:mod:`~kvevents.http.upstream_connection`), with one key and TLS
context, and hands the answer back whole or as it arrives
(:mod:`~kvevents.http.upstream_answers`). :meth:`Upstream.post_whole` and
:meth:`Upstream.post_head` write the request on a kept-alive connection before they
return, so legs sent together leave together. Why its own client: a general client's
per-request machinery (sessions, connectors, timers, header multidicts) cost more of the
router's CPU than the relay's own work (docs/router-performance.md). A decode engine
takes its prefills' hand-offs with it too (:mod:`kvevents.engine.bootstrap`).

* ``http://`` and ``https://`` (the service's shared TLS context); ``Host`` and
  ``Content-Length`` are its own, the caller's headers go as given.
* One deadline per request (``timeout``, the router's ``--forward-timeout``) for
  connecting, the head and the whole body; connecting has its own limit too. Past it,
  :class:`TimeoutError`; an unreachable engine, a connection closed midway or an answer
  that is not HTTP, :class:`~kvevents.http.upstream_errors.UpstreamError`.
* An idle connection is kept ``idle_s`` seconds, less than uvicorn's keep-alive, so a
  request never goes out on a connection the server is closing; newest first. A
  forwarded ``POST`` is never retried (it may have started a generation); a ``GET`` or a
  ``POST`` that changes nothing (:meth:`Upstream.post_safe`) that failed on a kept-alive
  connection before its answer began is sent once more, on a new connection.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping
from typing import Any

from kvevents.http.auth import ClientCredentials
from kvevents.http.deadlines import Deadlines
from kvevents.http.upstream_answers import FullResponse, Response
from kvevents.http.upstream_connection import Connection, Origin, exchange
from kvevents.http.upstream_errors import MidwayError, UpstreamError

__all__ = ["Upstream"]

DEFAULT_MAX_HEAD_BYTES = 256 * 1024
DEFAULT_HEAD_TIMEOUT_S = 30.0


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
        self._origins: dict[str, Origin] = {}
        self._closed = False
        self.deadlines: Deadlines[Connection] = Deadlines(Connection._timed_out)
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
        response: Response = await exchange(conn, head, body, deadline, whole=False)
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
        self, origin: Origin, deadline: float, head: bytes, body: bytes, whole: bool
    ) -> Any:
        conn = await self._connect(origin, deadline)
        return await exchange(conn, head, body, deadline, whole=whole)

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
        origin: Origin,
        deadline: float,
        conn: Connection | None,
        head: bytes,
        body: bytes,
        on_head: Callable[[], None] | None = None,
    ) -> FullResponse:
        """The whole answer to a request that may be sent twice: on ``conn`` (kept alive)
        first, then once on a new connection if that one failed before an answer began."""
        if conn is not None:
            try:
                kept: FullResponse = await exchange(
                    conn, head, body, deadline, whole=True, on_head=on_head
                )
                return kept
            except MidwayError:
                raise  # an answer began: the engine took the request
            except UpstreamError:
                pass
        conn = await self._connect(origin, deadline)
        response: FullResponse = await exchange(
            conn, head, body, deadline, whole=True, on_head=on_head
        )
        return response

    def _origin(self, base: str) -> Origin:
        """The pool of ``base`` (an engine's URL), made on its first request."""
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origins[base] = Origin(base)
        return origin

    def _start(
        self,
        base: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | bytes,
        timeout: float | None = None,
    ) -> tuple[Origin, float, Connection | None, bytes]:
        """Where the request goes, its deadline, a kept-alive connection if one is free,
        and its head (built first: a header it refuses takes no connection from the pool).
        ``headers`` may be their lines already written (``name: value\\r\\n`` each, checked
        by the caller: the relay's, :func:`kvevents.router.serve.relay_headers._request_lines`)."""
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

    def keep(self, origin: Origin, conn: Connection) -> None:
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

    def _idle(self, origin: Origin, now: float) -> Connection | None:
        idle = origin.idle
        while idle:
            since, conn = idle.pop()
            if not conn.closed and now - since < self.idle_s:
                if idle and now - idle[0][0] >= self.idle_s:
                    self._expire(idle, now)
                return conn
            conn.close()
        return None

    def _expire(self, idle: list[tuple[float, Connection]], now: float) -> None:
        keep = [(since, conn) for since, conn in idle if now - since < self.idle_s]
        for since, conn in idle:
            if now - since >= self.idle_s:
                conn.close()
        idle[:] = keep

    async def _connect(self, origin: Origin, deadline: float) -> Connection:
        loop = asyncio.get_running_loop()
        conn = Connection(self, origin, loop)
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


def _header_line(name: str, value: str) -> bytes:
    if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
        raise ValueError(f"header {name!r}: a name or value with a line break or colon")
    return b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
