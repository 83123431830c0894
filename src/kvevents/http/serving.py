"""Serving an HTTP app for a kvevents command: bind first, announce, stop on a signal.

The listening socket is bound before uvicorn starts, so ``--port 0`` works and a taken
port is an :class:`~kvevents.errors.EndpointError` naming the address. Once the app
accepts requests the command prints one machine-readable line,
``{ready_prefix}http://HOST:PORT``, which tests, the demo and scripts wait for.
uvicorn's own signal handling is off: the command owns SIGINT and SIGTERM. With a
:class:`~kvevents.http.auth.ServerTLS` the app is served over HTTPS and the URL says
``https``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Literal, TypeVar, get_args

import uvicorn

from kvevents.errors import EndpointError
from kvevents.http.auth import ServerTLS
from kvevents.http.inline import HttpLimits, protocol_for
from kvevents.transport.endpoints import WILDCARD_HOSTS

__all__ = [
    "HTTP_PARSER",
    "HTTP_SERVERS",
    "HttpServer",
    "bind_http",
    "http_url",
    "run_event_loop",
    "serve_app",
    "start_http",
    "stop_on_signals",
]

T = TypeVar("T")

HttpServer = Literal["uvicorn"]
"""The HTTP servers :func:`serve_app` runs an app on (``kvevents router --http-server``)."""
HTTP_SERVERS: tuple[HttpServer, ...] = get_args(HttpServer)


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on uvloop when it is installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a dependency; absent only on exotic platforms
        return asyncio.run(main)
    return uvloop.run(main)


try:  # the C parser: several times the requests per second of the pure-Python h11
    import httptools  # noqa: F401

    HTTP_PARSER: Literal["httptools", "h11"] = "httptools"
except ImportError:  # pragma: no cover - a dependency; absent only on exotic platforms
    HTTP_PARSER = "h11"

_STARTUP_POLLS = 3000  # x 10 ms: startup is the app's lifespan plus one listen()


def bind_http(
    host: str, port: int, what: str, *, reuse_port: bool = False, listen: bool = True
) -> socket.socket:
    """A listening, non-blocking TCP socket on ``host:port`` (0: the OS picks).

    ``reuse_port``: several processes listen on one port (``SO_REUSEPORT``) and the
    kernel spreads new connections over them (``kvevents router --workers N``).
    ``listen=False`` only binds: the port is held, and no connection is ever queued on it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio's loop sets TCP_NODELAY only on accepted sockets
    # whose proto says TCP (uvloop sets it on any). Without it the simulated engine, on
    # asyncio's loop, answers every request after a connection's first late (Nagle's
    # algorithm waiting on the client's delayed ACK), which a keep-alive client, the
    # router's relay included, sees as latency many times the request's own.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise EndpointError(
            f"{what} HTTP address {host}:{port} cannot be bound ({exc.strerror}): "
            "choose another --port (0 lets the OS pick)"
        ) from None
    if listen:
        sock.listen(1024)
        sock.setblocking(False)
    return sock


def http_url(host: str, sock: socket.socket, *, tls: bool = False) -> str:
    """The URL clients use for ``sock`` (``https`` with ``tls``): a wildcard host is shown
    as 127.0.0.1."""
    port = sock.getsockname()[1]
    shown = "127.0.0.1" if host in WILDCARD_HOSTS or host == "" else host
    scheme = "https" if tls else "http"
    return f"{scheme}://{'[' + shown + ']' if ':' in shown else shown}:{port}"


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def start_http(
    app: Any,
    sock: socket.socket,
    *,
    lifespan: Literal["auto", "on", "off"] = "auto",
    graceful_timeout: float | None = None,
    tls: ServerTLS | None = None,
    limits: HttpLimits | None = None,
) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    """Start serving ``app`` on ``sock`` (HTTPS with ``tls``); returns once it accepts requests.

    Stop it with ``server.should_exit = True`` and ``await task``; requests in flight
    then get ``graceful_timeout`` seconds (None: no limit) before they are cancelled. Raises
    :class:`EndpointError` if the server ends before it started. ``limits``: the bounds on
    slow and idle clients (:class:`~kvevents.http.inline.HttpLimits`; its defaults when None),
    for apps served by the inline protocol.
    """
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan=lifespan,
        http=protocol_for(app, HTTP_PARSER),
        server_header=False,
        date_header=False,
        # uvicorn annotates int, but only hands it to asyncio.wait_for, which takes float
        timeout_graceful_shutdown=graceful_timeout,  # type: ignore[arg-type]
        ssl_certfile=None if tls is None else tls.certfile,
        ssl_keyfile=None if tls is None else tls.keyfile,
    )
    if limits is not None:
        config.kvevents_limits = limits  # type: ignore[attr-defined]  # the protocol reads it
    server = _QuietServer(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(_STARTUP_POLLS):
        if server.started or serving.done():
            break
        await asyncio.sleep(0.01)
    if not server.started:
        await serving
        raise EndpointError(f"HTTP server on {http_url('', sock)} did not start")
    return server, serving


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """Set ``stop`` on SIGINT or SIGTERM while the block runs."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def serve_app(
    app: Any,
    host: str,
    port: int,
    ready_prefix: str,
    what: str,
    *,
    reuse_port: bool = False,
    announce: Callable[[str], None] | None = None,
    tls: ServerTLS | None = None,
    limits: HttpLimits | None = None,
) -> int:
    """Serve ``app`` until SIGINT or SIGTERM, announcing it once ready; exit code 0.

    The announcement is ``ready_prefix + URL`` on stdout, or ``announce(URL)`` when given.
    """
    stop = asyncio.Event()
    with stop_on_signals(stop):
        sock = bind_http(host, port, what, reuse_port=reuse_port)
        try:
            finished: asyncio.Future[Any]
            halt: Callable[[], Awaitable[None]]
            finished, halt = await _start_uvicorn(app, sock, tls, limits)
            url = http_url(host, sock, tls=tls is not None)
            if announce is None:
                print(ready_prefix + url, flush=True)
            else:
                announce(url)
            stop_wait = asyncio.create_task(stop.wait())
            await asyncio.wait({stop_wait, finished}, return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
            await halt()
            return 0
        finally:
            sock.close()


async def _start_uvicorn(
    app: Any, sock: socket.socket, tls: ServerTLS | None, limits: HttpLimits | None
) -> tuple[asyncio.Future[Any], Callable[[], Awaitable[None]]]:
    """Serve on uvicorn: what ends when it stops, and how to stop it."""
    server, serving = await start_http(app, sock, tls=tls, limits=limits)

    async def halt() -> None:
        server.should_exit = True
        await serving

    return serving, halt
