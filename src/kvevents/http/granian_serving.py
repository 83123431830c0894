"""Serving on granian's RSGI interface: the router's opt-in faster HTTP stack.

granian (a Rust HTTP server for Python) parses HTTP and moves bytes on its own Rust
thread, and hands each request to Python through RSGI: one call with the request's
scope and a protocol object that reads the body in one ``await`` and answers in one
call. Under the same load it answers the router's ``/route`` markedly faster than
uvicorn with httptools (README, Performance), because the parsing and socket work
leave the GIL-holding thread.

What this module gives :func:`kvevents.http.serving.serve_app` (``server="granian"``):

* :func:`start_granian`: serve an app on a socket *we* bound (so ``--port 0``,
  ``SO_REUSEPORT`` for ``--workers`` and the bind error messages stay ours), on the
  running event loop, after running the app's ASGI lifespan; returns a handle whose
  :meth:`GranianServer.stop` drains and stops it and runs the lifespan's shutdown.
* :class:`AsgiOverRsgi`: any ASGI app served over RSGI, for every path the app does not
  answer natively (the FastAPI app behind the hot path: ``/workers``, ``/metrics``,
  ``/docs``, the OpenAI routes, streaming included). An app with its own ``__rsgi__``
  (:class:`~kvevents.router.serve.hot_path.HotPath`) answers its hot paths natively and
  hands the rest to this bridge.

granian's embedding entry points are internal (``granian._granian``), so the version is
pinned to a minor release in ``pyproject.toml`` and :func:`require_granian` checks that
the names used here exist; a missing or changed granian is a clear
:class:`~kvevents.errors.ConfigError`, never a silent fall-back to uvicorn.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvevents.errors import ConfigError
from kvevents.http.auth import Message

__all__ = ["AsgiOverRsgi", "GranianServer", "require_granian", "start_granian"]

AsgiApp = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]

_INSTALL_HINT = (
    "install it with pip install 'kvevents[granian]' (granian 2.8), or serve with the "
    "default --http-server uvicorn"
)


def _granian_internals() -> tuple[Any, Any, Any, Any, Any]:
    try:
        from granian._futures import _future_watcher_wrapper, _new_cbscheduler
        from granian._granian import RSGIWorker, SocketHolder, WorkerSignal
    except ImportError as exc:
        raise ConfigError(
            f"--http-server granian: granian is not installed or not a 2.8 release ({exc}); "
            + _INSTALL_HINT
        ) from None
    return RSGIWorker, SocketHolder, WorkerSignal, _future_watcher_wrapper, _new_cbscheduler


def require_granian() -> None:
    """Raise :class:`~kvevents.errors.ConfigError` unless a granian this module can drive is installed."""
    _granian_internals()


async def drain(chunks: Any) -> None:
    """Read what is left of an RSGI request body (an iterator over its chunks) and drop
    it: granian would otherwise close a connection whose body was not read (a 413)."""
    while True:
        try:
            await chunks.__anext__()
        except StopAsyncIteration:
            return


class AsgiOverRsgi:
    """Serve an ASGI app over RSGI (HTTP only; granian is started without websockets).

    The request body is read from the RSGI protocol chunk by chunk as the app asks for
    it; the answer is sent in one piece when the app gives it in one
    ``http.response.body``, and streamed (``response_stream``) otherwise, so server-sent
    events reach the client as they are produced.
    """

    def __init__(self, app: AsgiApp) -> None:
        self.app = app

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        client_host, _, client_port = scope.client.rpartition(":")
        server_host, _, server_port = (scope.server or ":0").rpartition(":")
        path: str = scope.path
        asgi_scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": scope.http_version,
            "method": scope.method,
            "scheme": scope.scheme,
            "path": path,
            "raw_path": path.encode(),
            "query_string": scope.query_string.encode(),
            "root_path": "",
            "headers": [
                (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in scope.headers.items()
            ],
            "client": (client_host, int(client_port or 0)),
            "server": (server_host, int(server_port or 0)),
            "state": {},
        }
        body = proto.__aiter__()
        body_done = False
        responded = False
        status = 500
        headers: list[tuple[str, str]] = []
        stream: Any = None

        async def receive() -> Message:
            nonlocal body_done
            if body_done:
                await proto.client_disconnect()
                return {"type": "http.disconnect"}
            try:
                chunk = await body.__anext__()
            except StopAsyncIteration:
                body_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return {"type": "http.request", "body": bytes(chunk), "more_body": True}

        async def send(message: Message) -> None:
            nonlocal status, headers, stream, responded
            kind = message["type"]
            if kind == "http.response.start":
                status = message["status"]
                headers = [
                    (k.decode("latin-1"), v.decode("latin-1"))
                    for k, v in message.get("headers", ())
                ]
            elif kind == "http.response.body":
                data = message.get("body", b"")
                more = message.get("more_body", False)
                if stream is None and not more:
                    if not body_done:  # as uvicorn does: the unread body is read and
                        await drain(body)  # dropped, so the connection stays usable
                    proto.response_bytes(status, headers, data)
                    responded = True
                    return
                if stream is None:
                    stream = proto.response_stream(status, headers)
                    responded = True
                if data:
                    await stream.send_bytes(data)

        await self.app(asgi_scope, receive, send)
        if not responded:  # the app ended without an answer: never leave the client hanging
            proto.response_bytes(500, [("content-type", "text/plain")], b"no response")


class _Lifespan:
    """Run an ASGI app's lifespan: ``startup`` before serving, ``shutdown`` after."""

    def __init__(self, app: AsgiApp) -> None:
        self.app = app
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._started = asyncio.Event()
        self._stopped = asyncio.Event()
        self._failed: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind.endswith(".failed"):
            self._failed = str(message.get("message", kind))
        if kind.startswith("lifespan.startup"):
            self._started.set()
        elif kind.startswith("lifespan.shutdown"):
            self._stopped.set()

    async def _run(self) -> None:
        try:
            await self.app(
                {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                self._inbox.get,
                self._send,
            )
        except Exception as exc:  # an app that raises instead of answering *.failed
            if not self._started.is_set() and self._failed is None:
                self._failed = f"{type(exc).__name__}: {exc}"
        finally:
            self._started.set()
            self._stopped.set()

    async def startup(self) -> None:
        self._task = asyncio.create_task(self._run())
        await self._inbox.put({"type": "lifespan.startup"})
        await self._started.wait()
        if self._failed is not None:
            raise ConfigError(f"the app's startup failed: {self._failed}")

    async def shutdown(self) -> None:
        if self._task is None:
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._stopped.wait()
        await self._task


class GranianServer:
    """A running granian RSGI worker on one socket; :meth:`stop` drains and stops it."""

    def __init__(self, signal: Any, done: asyncio.Future[None], lifespan: _Lifespan | None) -> None:
        self._signal = signal
        self._done = done
        self._lifespan = lifespan

    @property
    def finished(self) -> asyncio.Future[None]:
        """Resolves when the worker stopped (after :meth:`stop`)."""
        return self._done

    async def stop(self) -> None:
        self._signal.set()
        await self._done
        if self._lifespan is not None:
            await self._lifespan.shutdown()


async def start_granian(
    app: Any, sock: socket.socket, *, lifespan: AsgiApp | None = None, backlog: int = 1024
) -> GranianServer:
    """Serve ``app`` (an object with ``__rsgi__``) on the listening ``sock``.

    ``lifespan``: an ASGI app whose lifespan runs first (startup) and last (shutdown).
    Returns once the worker accepts requests.
    """
    RSGIWorker, SocketHolder, WorkerSignal, watcher_wrapper, new_scheduler = _granian_internals()
    span = _Lifespan(lifespan) if lifespan is not None else None
    if span is not None:
        await span.startup()
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    signal = WorkerSignal()

    def _resolve() -> None:
        if not done.done():
            done.set_result(None)

    def _on_stop() -> None:
        loop.call_soon_threadsafe(_resolve)

    signal.add_cb(_on_stop)
    callback = app.__rsgi__
    worker = RSGIWorker(
        1,  # worker id
        (None, SocketHolder(os.dup(sock.fileno()), False, backlog)),  # granian closes its own copy
        None,  # IPC handle (granian's own multi-process mode)
        1,  # Rust runtime threads: parsing and I/O off the Python thread
        512,  # Rust blocking threads
        1,  # Python blocking threads (unused by RSGI)
        30,  # their idle timeout, s
        backlog,  # backpressure: requests in flight before accept pauses
        "1",  # HTTP/1.1 only, as uvicorn serves
        None,  # HTTP/1 settings: defaults
        None,  # HTTP/2 settings
        False,  # websockets
        None,  # static files
        False,
        None,
        None,
        None,
        "tls1.3",
        None,
        [],
        False,  # no TLS
        (None, None),  # metrics
    )
    scheduler = new_scheduler(loop, watcher_wrapper(callback), impl_asyncio=True)
    worker.serve_async(scheduler, loop, signal)
    await asyncio.sleep(0)
    return GranianServer(signal, done, span)
