"""The replay side of one stream: a DEALER socket to the publisher's replay ROUTER.

Protocol (docs/architecture.md, The wire): send ``[b"", start_seq]``; receive ``[b"", topic, seq, payload]``
(or the older ``[b"", seq, payload]``) for every buffered batch with ``seq >= start``,
then the end marker (``seq == 2**64 - 1``). A REQ socket would only ever get the first
reply, hence DEALER. A publisher that advertises snapshots is also asked, on the same
socket, for its rank's whole state (:meth:`ReplayClient.request_snapshot`); its answer's
frames are five, tagged (:mod:`kvevents.wire.frames`), so :meth:`ReplayClient.read` tells
them from replay replies by their shape.

Invariants
----------
* At most one request is in flight. Asking again while one is in flight, or giving up on
  one (timeout), closes the socket and opens a fresh one, so late replies to an
  abandoned request can never be mistaken for replies to the next one.
* The timeout is an inactivity timeout: every reply pushes the deadline back, so a long
  replay of a full buffer is not cut short while it keeps flowing.
* The receive high-water mark is unlimited: a publisher's ROUTER drops what a full
  peer pipe cannot take, which would turn into false losses here. Memory stays bounded
  by the publisher's own buffer size.

The socket loop owns this object; it is not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from kvevents.wire.frames import (
    ReplayReply,
    SnapshotReply,
    is_snapshot_reply,
    parse_replay_reply,
    parse_snapshot_reply,
    replay_request_frames,
    snapshot_request_frames,
)

__all__ = ["ReplayClient"]

SocketHook = Callable[["zmq.Socket[bytes]"], None]


class ReplayClient:
    """One stream's replay requests; see the module docstring."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        *,
        timeout: float,
        on_open: SocketHook,
        on_close: SocketHook,
        reconnect_max_ms: int = 2000,
        max_message_size: int = -1,
        secure: SocketHook | None = None,
    ) -> None:
        self._max_message_size = max_message_size
        self._secure = secure  # sets CURVE client keys on each new socket
        self.endpoint = endpoint
        self.timeout = timeout
        self.deadline: float | None = None  # set while a request is in flight
        self.requests = 0
        self.timeouts = 0
        self._context = context
        self._on_open = on_open
        self._on_close = on_close
        self._reconnect_max_ms = reconnect_max_ms
        self.socket: zmq.Socket[bytes] | None = None

    @property
    def in_flight(self) -> bool:
        return self.deadline is not None

    def open(self) -> None:
        """Open the socket now (it is otherwise opened by the first request)."""
        if self.socket is None:
            self._reopen()

    def request(self, start: int, now: float) -> None:
        """Ask for every buffered batch with ``seq >= start`` (abandons one in flight)."""
        self._send(replay_request_frames(start), now)

    def request_snapshot(self, now: float) -> None:
        """Ask for the rank's whole state (abandons a request in flight). Only for a
        publisher that advertises snapshots."""
        self._send(snapshot_request_frames(), now)

    def _send(self, frames: list[bytes], now: float) -> None:
        if self.socket is None or self.in_flight:
            self._reopen()
        assert self.socket is not None
        self.socket.send_multipart(frames)
        self.requests += 1
        self.deadline = now + self.timeout

    def timed_out(self, now: float) -> bool:
        """True (once) when the request in flight saw no reply for ``timeout`` seconds;
        the socket is then replaced."""
        if self.deadline is None or now < self.deadline:
            return False
        self.timeouts += 1
        self.deadline = None
        self._reopen()
        return True

    def read(self, now: float) -> ReplayReply | SnapshotReply | None:
        """One reply if one is waiting (None otherwise); raises WireError for a malformed one.

        Replies push the deadline back; the end marker, and a snapshot's end or
        unavailable frame, clear it.
        """
        assert self.socket is not None
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        reply: ReplayReply | SnapshotReply
        if is_snapshot_reply(frames):
            reply = parse_snapshot_reply(frames)
            last = reply.kind != "part"
        else:
            reply = parse_replay_reply(frames)
            last = reply.is_end
        if self.deadline is not None:
            self.deadline = None if last else now + self.timeout
        return reply

    def refresh(self) -> None:
        """Replace the socket by a fresh one unless a request is in flight.

        A DEALER whose publisher was down has been reconnecting with backoff, up to
        ``reconnect_max_ms`` apart; a request sent on it waits for the next attempt,
        which may come after the timeout. A fresh socket connects at once.
        """
        if not self.in_flight:
            self._reopen()

    def cancel(self) -> None:
        """Forget the request in flight: its socket goes, so late replies are never read."""
        if self.in_flight:
            self.close()

    def close(self) -> None:
        if self.socket is not None:
            self._on_close(self.socket)
            self.socket.close(linger=0)
            self.socket = None
        self.deadline = None

    def _reopen(self) -> None:
        self.close()
        sock = self._context.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_size)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, self._reconnect_max_ms)
            if self._secure is not None:
                self._secure(sock)
            sock.connect(self.endpoint)
        except BaseException:
            sock.close(linger=0)
            raise
        self.socket = sock
        self._on_open(sock)
