"""Subscriber.aclose: closing from asyncio never blocks the event loop."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from kvevents import Subscriber, SubscriberState, SubscriberStateError


class StallingServer:
    """A TCP server on an OS-chosen port that takes one HTTP request and answers only when
    told to, so a subscriber's discovery thread stays blocked in its GET meanwhile."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.requested = threading.Event()
        self.release = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._listener.settimeout(10)
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(10)
            try:
                conn.recv(65536)
            except OSError:
                return
            self.requested.set()
            self.release.wait(10)
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
        self._listener.close()  # any further request (vLLM's /kv_event_sources) is refused

    def close(self) -> None:
        self.release.set()
        self._listener.close()
        self._thread.join(10)


@pytest.fixture
def stalling_server() -> Iterator[StallingServer]:
    server = StallingServer()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("how", ["aclose", "async with"])
def test_closing_lets_other_tasks_run_until_the_threads_are_joined(
    stalling_server: StallingServer, how: str
) -> None:
    """While aclose (or leaving ``async with``) waits for a discovery thread stuck in a GET,
    other tasks run; it returns once the thread ends, and a second aclose returns at once."""

    async def scenario() -> None:
        sub = Subscriber(engines=[stalling_server.url], discovery_timeout=10)
        assert await asyncio.to_thread(stalling_server.requested.wait, 10)

        async def leave() -> None:
            if how == "aclose":
                await sub.aclose(timeout=10)
            else:
                async with sub:
                    pass

        def get_until_closed() -> str:
            for _ in range(3):
                try:
                    sub.get(timeout=5)
                except SubscriberStateError:
                    return "closed"
            return "still open"

        # A consumer in a thread, told by the close's first step; its task, on the loop,
        # can only finish meanwhile if closing does not hold the loop.
        consumer = asyncio.create_task(asyncio.to_thread(get_until_closed))
        closing = asyncio.create_task(leave())
        assert await asyncio.wait_for(consumer, 20) == "closed"
        assert sub.state is SubscriberState.CLOSED  # close began ...
        assert not closing.done()  # ... and still waits for the stuck thread, off the loop
        stalling_server.release.set()
        await asyncio.wait_for(closing, 10)
        watcher = f"kvevents-discover {stalling_server.url}"
        assert not [t for t in threading.enumerate() if t.name == watcher]
        await asyncio.wait_for(sub.aclose(), 1)  # idempotent

    asyncio.run(scenario())
