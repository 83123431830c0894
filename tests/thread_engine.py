"""A loopback HTTP server in threads of its own, for tests that must see what a client
wrote while the client's event loop is not running (or runs in another process).

:class:`ThreadEngine` answers every request 200 (``{}``) on kept-alive connections, puts
each request's ``(path, body)`` in :attr:`ThreadEngine.arrived` in arrival order and a
None in :attr:`ThreadEngine.left` for each connection the client closed. ``close()`` it.
"""

from __future__ import annotations

import queue
import socket
import threading

__all__ = ["ThreadEngine"]

_OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class ThreadEngine:
    """See the module docstring."""

    def __init__(self) -> None:
        self.arrived: queue.Queue[tuple[bytes, bytes]] = queue.Queue()
        self.left: queue.Queue[None] = queue.Queue()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def bodies(self) -> list[bytes]:
        """The bodies arrived so far, in arrival order (taken out of :attr:`arrived`)."""
        out = []
        while not self.arrived.empty():
            out.append(self.arrived.get_nowait()[1])
        return out

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        buffered = b""
        with conn:
            while not self._stop.is_set():
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:  # reset: the client closed with our answer unread
                    data = b""
                if not data:
                    self.left.put(None)
                    return
                buffered += data
                while b"\r\n\r\n" in buffered:
                    head, _, rest = buffered.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":", 1)[1])
                    if len(rest) < length:
                        break
                    buffered = rest[length:]
                    self.arrived.put((head.split(b" ")[1], rest[:length]))
                    conn.sendall(_OK)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._listener.close()
