"""Scripted HTTP servers on real sockets, for the router's engine client and its users.

Each server is a plain asyncio TCP server on an OS-chosen loopback port that reads
requests and writes exactly the bytes a test gives it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
"""What the server does on a connection: reader, writer and the connection's number."""

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (bodies here always carry a Content-Length)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await asyncio.wait_for(reader.readexactly(length), 5)


class Server:
    """A scripted server: ``connections`` counts accepted connections, ``requests`` holds
    each request's (head, body)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.url = ""
        self._server: asyncio.Server | None = None
        self._handlers: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        task = asyncio.current_task()
        assert task is not None
        self._handlers.append(task)
        try:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, TimeoutError):
                await self.script(reader, writer, number)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        head, body = await read_request(reader)
        self.requests.append((head, body))
        return body

    async def exchange(
        self, r: asyncio.StreamReader, w: asyncio.StreamWriter, answer: bytes
    ) -> None:
        """Read one request and write ``answer``."""
        await self.request(r)
        w.write(answer)
        await w.drain()


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))  # type: ignore[arg-type]


def keep_alive(answer: bytes = OK) -> Callable[[Server], Script]:
    """Answer every request on a connection with ``answer``."""

    def script(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            while True:
                await server.exchange(r, w, answer)

        return serve

    return script


def answer_once(answer: bytes, *, then_hold: bool = False) -> Callable[[Server], Script]:
    """Answer one request with ``answer``, then close (or hold the connection open)."""

    def script(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await server.exchange(r, w, answer)
            if then_hold:
                await r.read()  # returns once the client closes

        return serve

    return script


@contextlib.asynccontextmanager
async def serving(make: Callable[[Server], Script]) -> AsyncIterator[Server]:
    server = Server(lambda r, w, n: asyncio.sleep(0))
    server.script = make(server)
    async with server:
        yield server
