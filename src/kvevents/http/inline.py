"""uvicorn's httptools protocol with an inline path: small POSTs answered without ASGI.

uvicorn serves every request as an ASGI cycle (a scope dict, a cycle object, a task, two
checked writes), which for the router's ``/route`` and ``/query`` costs more CPU than the
routing itself (docs/router-performance.md). An :class:`InlineApp` instead has its answer
called straight from the parser's callbacks: the body collected as it arrives, the answer
computed synchronously and written, head and body, in one write held to the end of the
loop's round (:mod:`kvevents.http.held_writes`). Everything else is uvicorn's own:
keep-alive, graceful shutdown, TLS, the 400 for an unparsable request.

A request goes inline only when, at its headers: it is a POST to one of
:attr:`InlineApp.inline_paths`; no earlier request on the connection is still being
answered and the client reads its answers; it has no ``Transfer-Encoding``, no
``Expect: 100-continue``, no upgrade; and its ``Content-Length`` is within
:attr:`InlineApp.inline_limit`. When :meth:`InlineApp.answer_inline` returns None (text
to tokenize, a missing API key), the request becomes an ordinary ASGI cycle with its body
already read: every request is answered once, one way or the other. An exception out of
an inline answer is uvicorn's plain 500 and the connection closes.

Slow and idle clients are bounded (:class:`HttpLimits`), where uvicorn alone waits
forever: a request's head and body must arrive within ``request_timeout`` (else 408), a
connection silent since it opened is closed at the keep-alive timeout, and past
``max_idle_connections`` the oldest idle connection is closed.

An :class:`AsyncInlineApp` may answer some paths later, with a coroutine or a future (the
router's relay, resolved from its engine connection's callbacks); uvicorn meanwhile sees a
stand-in request cycle, so pipelining, shutdown and a client that went away behave as
with ASGI. :func:`protocol_for` picks this protocol for an :class:`InlineApp`, uvicorn's
own otherwise, or when uvicorn lacks a method this relies on (:data:`UVICORN_METHODS`), or
with ``KVEVENTS_INLINE_HTTP=0``. It relies on uvicorn internals, so pyproject.toml pins
the uvicorn minor and ``tests/test_uvicorn_contract.py`` names what an upgrade breaks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Awaitable
from typing import Any, Protocol, runtime_checkable

from kvevents.http.deadlines import Deadlines
from kvevents.http.held_writes import HeldWrites, holding_enabled

__all__ = [
    "DEFAULT_LIMITS",
    "UVICORN_METHODS",
    "UVICORN_STATE",
    "AsyncInlineApp",
    "HttpLimits",
    "InlineAnswer",
    "InlineApp",
    "protocol_for",
]

log = logging.getLogger(__name__)


class HttpLimits:
    """Bounds on slow and idle clients, per server process (module docstring)."""

    __slots__ = ("max_idle_connections", "request_timeout")

    def __init__(self, *, request_timeout: float = 30.0, max_idle_connections: int = 4096) -> None:
        if not request_timeout > 0:
            raise ValueError(
                f"request_timeout={request_timeout}: give a positive number of seconds"
            )
        if max_idle_connections < 1:
            raise ValueError(f"max_idle_connections={max_idle_connections}: give a positive number")
        self.request_timeout = request_timeout
        self.max_idle_connections = max_idle_connections

    def __repr__(self) -> str:
        return (
            f"HttpLimits(request_timeout={self.request_timeout!r}, "
            f"max_idle_connections={self.max_idle_connections!r})"
        )


DEFAULT_LIMITS = HttpLimits()

_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@runtime_checkable
class InlineApp(Protocol):
    """An ASGI app that can answer some POSTs synchronously from their body."""

    inline_paths: frozenset[bytes]
    """Raw request paths (no query string) worth trying inline."""
    inline_limit: int
    """The largest ``Content-Length`` taken inline; bigger bodies go the ASGI way (and its
    limit answers them)."""

    def answer_inline(
        self, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, bytes] | None:
        """Status and JSON answer, or None to have the request served as ASGI instead.

        ``headers`` are the request's, names lowercased. Must not raise (an exception
        closes the connection as a protocol error would).
        """
        ...


InlineAnswer = tuple[int, list[tuple[bytes, bytes]] | bytes, bytes]
"""An answer computed asynchronously: status, headers (no ``content-length`` or
``connection``: the protocol writes those), body. The headers are ``(name, value)``
pairs, or their lines already written (``b"name: value\\r\\n"`` each): an answer whose
headers are mostly the same each time formats them in one step instead of one per pair."""


@runtime_checkable
class AsyncInlineApp(InlineApp, Protocol):
    """An inline app that can also answer some POSTs with a coroutine, written whole."""

    async_inline_paths: frozenset[bytes]
    """Raw request paths whose answers may come from :meth:`answer_async_inline`."""

    def answer_async_inline(
        self, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Awaitable[InlineAnswer] | None:
        """The answer to come (a coroutine, or a future of the loop), or None to have the
        request served as ASGI instead (as :meth:`InlineApp.answer_inline`). Only for
        answers written whole (no stream)."""
        ...


class _Exchange:
    """Stands in for uvicorn's request cycle while an asynchronous inline answer is
    pending: a request that arrives meanwhile is queued behind it as uvicorn queues
    pipelined requests, and a lost connection or a shutdown is recorded on it."""

    __slots__ = ("disconnected", "keep_alive", "response_complete")

    def __init__(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive
        self.disconnected = False
        self.response_complete = False

    @property
    def message_event(self) -> _Exchange:
        return self  # uvicorn sets it when the connection is lost: nothing waits on it

    def set(self) -> None:
        pass


_PLAIN_500 = (500, [(b"content-type", b"text/plain; charset=utf-8")], b"Internal Server Error")
"""What uvicorn answers when an ASGI app raises (then closing the connection); the
asynchronous inline path does the same."""


UVICORN_METHODS = (
    "connection_made",
    "connection_lost",
    "on_message_begin",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "shutdown",
    "timeout_keep_alive_handler",
    "_unset_keepalive_if_required",
    "_start_asgi_task",
)
"""The methods of uvicorn's ``HttpToolsProtocol`` the inline protocol overrides or calls:
without one of them, :func:`protocol_for` falls back to uvicorn's own protocol."""

UVICORN_STATE: dict[str, tuple[str, ...]] = {
    "config": ("app",),
    "server_state": ("total_requests",),
    "loop": ("time", "create_future"),
    "tasks": ("add", "discard"),
    "timeout_keep_alive": (),
    "transport": ("write", "close", "is_closing"),
    "flow": ("resume_reading", "write_paused"),
    "pipeline": ("pop",),
    "parser": ("get_method", "get_http_version", "should_keep_alive", "should_upgrade"),
    "url": (),
    "headers": (),
    "expect_100_continue": (),
    "cycle": ("body", "more_body", "keep_alive", "message_event", "response_complete"),
}
"""The instance attributes of uvicorn's protocol the inline one reads, once a request's
headers are in, each with the attributes it uses of them. An instance attribute cannot be
checked on the class: ``tests/test_uvicorn_contract.py`` serves a request and checks
these, and the names uvicorn reads of a request cycle, which ``_Exchange`` stands in for."""


def _subclass() -> type[Any] | None:
    """The inline protocol class, or None when uvicorn's protocol cannot carry it."""
    try:
        from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools is a dependency
        return None
    missing = [name for name in UVICORN_METHODS if not hasattr(HttpToolsProtocol, name)]
    if missing:  # pragma: no cover - the pinned uvicorn has them all
        log.warning(
            "uvicorn's httptools protocol lacks %s: no inline path (kvevents is tested with "
            "the uvicorn versions pyproject.toml pins)",
            ", ".join(missing),
        )
        return None

    def _head(status: int, headers: list[tuple[bytes, bytes]] | bytes, answer: bytes) -> bytes:
        """An answer's status line and headers, ``content-length`` last, without the blank line."""
        status_line = STATUS_LINE.get(status) or b"HTTP/1.1 %d \r\n" % status
        if isinstance(headers, bytes):  # written already (see InlineAnswer)
            return b"%s%scontent-length: %d\r\n" % (status_line, headers, len(answer))
        lines = [status_line]
        lines.extend(b"%s: %s\r\n" % header for header in headers)
        lines.append(b"content-length: %d\r\n" % len(answer))
        return b"".join(lines)

    class InlineHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's protocol, with the inline path of the module docstring."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            app = self.config.app
            self._inline_app: InlineApp | None = app if isinstance(app, InlineApp) else None
            self._async_app: AsyncInlineApp | None = (
                app if isinstance(app, AsyncInlineApp) else None
            )
            self._async_paths: frozenset[bytes] = getattr(
                self._async_app, "async_inline_paths", frozenset()
            )
            self._inline_path: bytes | None = None
            self._inline_body: list[bytes] = []
            self._close_after = False
            self._held: HeldWrites | None = None
            self._idle = _idle_deadlines(self.server_state)
            self._reading = _request_deadlines(self.server_state)
            self._limits: HttpLimits = getattr(self.config, "kvevents_limits", DEFAULT_LIMITS)

        def connection_made(self, transport: Any) -> None:
            if holding_enabled():  # uvicorn's own writes and closes go through it too
                transport = self._held = HeldWrites(transport, self.loop)
            super().connection_made(transport)
            # idle until its first request begins, as between two requests
            loop = self.loop
            idle = self._idle
            idle.watch(self, loop.time() + self.timeout_keep_alive, loop)
            if len(idle) > self._limits.max_idle_connections:
                oldest = idle.oldest()
                if oldest is not None and oldest is not self:
                    idle.forget(oldest)
                    oldest.timeout_keep_alive_handler()

        def connection_lost(self, exc: Exception | None) -> None:
            self._idle.forget(self)
            self._reading.forget(self)
            super().connection_lost(exc)

        def _request_timed_out(self) -> None:
            """The request's head and body did not arrive within the request timeout."""
            if self.transport.is_closing():
                return
            if not self.pipeline and (self.cycle is None or self.cycle.response_complete):
                self.transport.write(_TIMED_OUT)  # nothing else is being answered: say why
            self.transport.close()

        def on_response_complete(self) -> None:
            # What uvicorn does once an answer is out (count it, read again, start the
            # next pipelined request), but an idle connection's keep-alive timeout is
            # watched by the server's one timer for every connection (kvevents.http.deadlines):
            # a timer of its own, armed here and cancelled by the next request, would
            # cost the loop more per answer than the bookkeeping does.
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            self._unset_keepalive_if_required()
            self.flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            else:
                loop = self.loop
                self._idle.watch(self, loop.time() + self.timeout_keep_alive, loop)

        def _unset_keepalive_if_required(self) -> None:
            self._idle.forget(self)  # nothing when it is not idle
            super()._unset_keepalive_if_required()  # a timer uvicorn armed itself, if any

        def _send(self, data: bytes) -> None:
            """An answer on a connection kept alive: held to the end of the loop's round."""
            held = self._held
            if held is None:
                self.transport.write(data)
            else:
                held.hold(data)

        def on_message_begin(self) -> None:
            # A request begins: the connection is not idle. An inline answer arms
            # uvicorn's keep-alive timer from inside the parser (on_response_complete),
            # so a request read from the same data would otherwise run under that timer,
            # and a slow body or a relayed answer be cut off when it fires.
            self._unset_keepalive_if_required()
            loop = self.loop
            self._reading.watch(self, loop.time() + self._limits.request_timeout, loop)
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            path = self._inline_candidate()
            if path is None:
                super().on_headers_complete()
                return
            self._inline_path = path
            self._inline_body = []

        def _inline_candidate(self) -> bytes | None:
            app = self._inline_app
            if app is None or self.parser.get_method() != b"POST" or self.expect_100_continue:
                return None
            if self.pipeline or not (self.cycle is None or self.cycle.response_complete):
                return None
            if self.parser.should_upgrade():  # uvicorn decides: a WebSocket or a 400
                return None
            if self.flow.write_paused:  # a client not reading: uvicorn's back-pressure
                return None
            path = self.url.partition(b"?")[0]
            if path not in app.inline_paths and path not in self._async_paths:
                return None
            length = 0
            for name, value in self.headers:
                if name == b"transfer-encoding":
                    return None
                if name == b"content-length":
                    if not value.isdigit():
                        return None
                    length = int(value)
            return path if length <= app.inline_limit else None

        def shutdown(self) -> None:
            if self._inline_path is None:
                super().shutdown()
            else:  # a request whose body is still arriving: answer it, then close
                self._close_after = True

        def on_body(self, body: bytes) -> None:
            if self._inline_path is None:
                super().on_body(body)
            else:
                self._inline_body.append(body)

        def on_message_complete(self) -> None:
            self._reading.forget(self)  # all of it is in
            path = self._inline_path
            if path is None:
                super().on_message_complete()
                return
            self._inline_path = None
            body = b"".join(self._inline_body)
            self._inline_body = []
            if path in self._async_paths:
                assert self._async_app is not None
                try:
                    pending = self._async_app.answer_async_inline(path, self.headers, body)
                except Exception as exc:  # a bug: answered as one in the answer to come
                    failed: asyncio.Future[InlineAnswer] = self.loop.create_future()
                    failed.set_exception(exc)
                    pending = failed
                if pending is None:
                    self._serve_as_asgi(body)
                else:
                    self._answer_later(pending)
                return
            app = self._inline_app
            assert app is not None
            try:
                answered = app.answer_inline(path, self.headers, body)
            except Exception:  # a bug: uvicorn's plain 500, logged, and the connection closes
                log.exception("the app failed answering a request")
                status, headers, answer = _PLAIN_500
                self._write_and_close(_head(status, headers, answer), answer)
                return
            if answered is None:
                self._serve_as_asgi(body)
                return
            status, answer = answered
            keep_alive = self._keep_alive()
            # the status line exactly as uvicorn writes it on the ASGI path
            head = b"%scontent-type: application/json\r\ncontent-length: %d\r\n" % (
                STATUS_LINE[status],
                len(answer),
            )
            if keep_alive:
                self._send(head + b"\r\n" + answer)
                self.on_response_complete()  # uvicorn's keep-alive timer and pipelining
            else:
                self._write_and_close(head, answer)

        def _write_and_close(self, head: bytes, answer: bytes) -> None:
            """The connection's last answer (``head`` without its blank line), then its end."""
            self.transport.write(head + b"connection: close\r\n\r\n" + answer)
            self.transport.close()
            self.on_response_complete()  # counted, as uvicorn counts every answer

        def _keep_alive(self) -> bool:
            return (
                not self._close_after
                and self.parser.get_http_version() != "1.0"
                and self.parser.should_keep_alive()
            )

        def _serve_as_asgi(self, body: bytes) -> None:
            """The app's ASGI side answers the request, its body already read."""
            super().on_headers_complete()
            if self._close_after:  # a shutdown began while its body arrived
                self.cycle.keep_alive = False
            self.cycle.body += body
            self.cycle.more_body = False
            self.cycle.message_event.set()

        def _answer_later(self, pending: Awaitable[InlineAnswer]) -> None:
            exchange = _Exchange(self._keep_alive())
            self.cycle = exchange  # type: ignore[assignment]  # uvicorn's callbacks see it
            # a future is waited on as it is, a coroutine runs as a task
            future = asyncio.ensure_future(pending, loop=self.loop)
            future.add_done_callback(lambda done: self._write_done(done, exchange))
            # uvicorn's shutdown waits for these (and cancels them past its timeout), a
            # future as well as a task
            future.add_done_callback(self.tasks.discard)
            self.tasks.add(future)  # type: ignore[arg-type]

        def _write_done(self, done: asyncio.Future[InlineAnswer], exchange: _Exchange) -> None:
            if done.cancelled():
                return  # a forced shutdown: the connection closes with the server
            try:
                status, headers, answer = done.result()
            except Exception:
                log.exception("the app failed answering a request")
                status, headers, answer = _PLAIN_500
                exchange.keep_alive = False  # then the connection closes, as uvicorn's does
            exchange.response_complete = True
            if exchange.disconnected or self.transport.is_closing():
                return  # the client went away: as uvicorn's cycle, nothing is written
            head = _head(status, headers, answer)
            if exchange.keep_alive:
                self._send(head + b"\r\n" + answer)
                self.on_response_complete()  # the next pipelined request, or keep-alive
            else:
                self._write_and_close(head, answer)

    def _idle_deadlines(server_state: Any) -> Deadlines[InlineHttpToolsProtocol]:
        """The keep-alive deadlines of one server's connections (a server runs on one
        loop; servers on other loops or threads have their own)."""
        deadlines = _IDLE_BY_SERVER.get(server_state)
        if deadlines is None:
            # past the keep-alive timeout, uvicorn's handler closes the connection
            deadlines = Deadlines(InlineHttpToolsProtocol.timeout_keep_alive_handler)
            _IDLE_BY_SERVER[server_state] = deadlines
        return deadlines

    def _request_deadlines(server_state: Any) -> Deadlines[InlineHttpToolsProtocol]:
        """The deadlines of one server's requests still arriving (head and body)."""
        deadlines = _READING_BY_SERVER.get(server_state)
        if deadlines is None:
            deadlines = Deadlines(InlineHttpToolsProtocol._request_timed_out)
            _READING_BY_SERVER[server_state] = deadlines
        return deadlines

    return InlineHttpToolsProtocol


_READING_BY_SERVER: weakref.WeakKeyDictionary[Any, Deadlines[Any]] = weakref.WeakKeyDictionary()
"""Per uvicorn server, the deadlines of its inline connections' requests being read."""
_IDLE_BY_SERVER: weakref.WeakKeyDictionary[Any, Deadlines[Any]] = weakref.WeakKeyDictionary()
"""Per uvicorn server (its ``ServerState``, shared by its connections), the keep-alive
deadlines of its inline connections: dropped with the server, and the loop with it."""
_INLINE: type[Any] | bool | None = False  # False: not built yet


def protocol_for(app: object, default: Any) -> Any:
    """uvicorn's ``http`` option for ``app``: the inline protocol class, or ``default``."""
    global _INLINE
    if not isinstance(app, InlineApp) or os.environ.get("KVEVENTS_INLINE_HTTP", "1") == "0":
        return default
    if _INLINE is False:
        _INLINE = _subclass()
    return default if _INLINE is None else _INLINE
