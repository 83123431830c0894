"""Serving an ASGI app on a socket the router binds itself, until SIGINT or SIGTERM.

The socket is bound before uvicorn starts, so ``--port 0`` works and a taken port is
an :class:`~kvevents.errors.EndpointError` naming the address. Once the app accepts
requests, one line goes to stdout: ``{ready_prefix}http://HOST:PORT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from kvevents.errors import EndpointError

__all__ = ["serve_app"]


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise EndpointError(
            f"router address {host}:{port} cannot be bound ({exc.strerror}): choose another --port"
        ) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: :func:`serve` owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_app(app: Any, host: str, port: int, ready_prefix: str) -> int:
    """Serve ``app`` until SIGINT or SIGTERM; prints the ready line once accepting requests."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sock = _bind(host, port)
    try:
        server = _Server(uvicorn.Config(app, log_level="warning", access_log=False))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        for _ in range(3000):  # bounded: startup is the lifespan plus one listen()
            if server.started or serving.done():
                break
            await asyncio.sleep(0.01)
        if not server.started:
            await serving
            raise EndpointError(f"router HTTP server on {host}:{port} did not start")
        shown = "127.0.0.1" if host in ("0.0.0.0", "", "*") else host
        print(f"{ready_prefix}http://{shown}:{sock.getsockname()[1]}", flush=True)
        stop_wait = asyncio.create_task(stop.wait())
        await asyncio.wait({stop_wait, serving}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        server.should_exit = True
        await serving
        return 0
    finally:
        sock.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
