"""The publisher's send path: a lock-free queue that one sender thread drains onto a PUB socket.

::

    put(batch) --append--> deque --> sender thread: seq, encode, replay buffer, PUB send

Invariants:

* ``put()`` takes no lock on its fast path (deque ``len`` and ``append`` are atomic under
  the GIL) and never waits for the network.
* A batch refused because ``max_size`` entries wait is counted and still takes a
  sequence number, never sent: consumers see a gap replay cannot fill. Consecutive drops
  share one marker.
* Sequence numbers are assigned as entries leave the queue, under the send lock, so they
  are dense and in order; a batch enters the replay buffer before its send.

Why a GIL hand-off: CPython lets a thread that never blocks keep the GIL for a whole
switch interval, so a caller publishing in a tight loop would starve the sender until
the queue overflowed. When the backlog reaches ``handoff_backlog``, ``put()`` waits (at
most ``_HANDOFF_TIMEOUT_S``) for the sender to empty the queue; the sender then ends the
hand-off itself and waits for the caller to run again, because a caller whose timeout
expired could still not get the GIL back from a sender that retakes it after every send.
Outside a hand-off the sender yields the GIL after each ``_SLICE_S`` of continuous work.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import zmq

from kvevents.publish.block_state import BlockState
from kvevents.publish.replay_server import ReplayBuffer
from kvevents.wire.events import KVEventBatch

log = logging.getLogger("kvevents.publish")

__all__ = ["SendQueue"]

_SEQ_PACK = struct.Struct(">Q").pack
_SLICE_S = 0.001  # the sender yields the GIL after this much continuous work
_YIELD_S = 50e-6  # ... for this long
# Longest put() waits for the sender to empty the queue: long enough for the sender to
# send a whole backlog of 32-block batches in one hand-off (shorter, the queue grows),
# short enough that the worst publish() stays within a few milliseconds.
_HANDOFF_TIMEOUT_S = 0.0015
_RESUME_WAIT_S = 0.005  # longest the sender blocks after a hand-off for the caller to run
_CHUNK = 32  # entries sent per hold of the send lock
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)  # plain ints: or-ing zmq's flag enums is a Python call
_LAST = int(zmq.NOBLOCK)


class _Marker:
    """A queue entry that is not a batch: a run of drops, or a flush waiting to be reached.

    A drop run (``count`` > 0) stands for consecutive batches refused while the queue was
    full; each takes one sequence number when the run leaves the queue. A flush marker
    (``flushed`` set) is signalled when everything queued before it has been sent.
    """

    __slots__ = ("closed", "count", "flushed")

    def __init__(self, count: int = 0, flushed: threading.Event | None = None) -> None:
        self.count = count
        self.closed = False
        self.flushed = flushed


class SendQueue:
    """Batches waiting to be sent on ``pub`` by a sender thread (see the module docstring).

    The queue owns ``pub`` from construction on: only the sender thread sends on it, and
    :meth:`close` closes it. Counters (read from any thread): ``published``, ``dropped``,
    ``send_errors``, ``encode_errors``, ``handoffs``.
    """

    def __init__(
        self,
        pub: zmq.Socket[bytes],
        *,
        topic: bytes,
        encode: Callable[[KVEventBatch], bytes],
        buffer: ReplayBuffer | None,
        max_size: int,
        handoff_backlog: int,
        name: str,
        state: BlockState | None = None,
    ) -> None:
        self._pub = pub
        self._state = state
        # pyzmq's Socket.send adds keyword handling in Python on top of the same C call;
        # the sender calls the C-level method directly, skipping that per batch.
        self._send_frame: Callable[[bytes, int], Any] = super(zmq.Socket, pub).send
        self._topic = topic
        self._encode = encode
        self._buffer = buffer
        self._max_size = max_size
        self._handoff_backlog = handoff_backlog
        self._queue: deque[KVEventBatch | _Marker] = deque()
        self._send_lock = threading.Lock()  # held while entries leave the queue and are sent
        self._drop_lock = threading.Lock()  # orders drops against the sender closing a run
        self._wake = threading.Event()
        self._drained = threading.Event()  # set by the sender: the hand-off is over
        self._resumed = threading.Event()  # set by the caller: it runs again after a hand-off
        self._handoff_wanted = False
        self._handoff_deadline = 0.0  # monotonic; the sender ends the hand-off here at latest
        self._handoff_emptied = False  # the last hand-off ended with the queue empty
        self._since_timeout = -1  # batches put above the mark since a hand-off timed out
        self._sender_idle = False
        self._closing = False
        self._abandon = False
        self._pub_open = True
        self._next_seq = 0
        self.published = self.dropped = self.send_errors = self.encode_errors = 0
        self.handoffs = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- the caller's side ------------------------------------------------------------

    def put(self, batch: KVEventBatch) -> None:
        """Queue ``batch``, or drop and count it when the queue is full."""
        queue = self._queue
        backlog = len(queue)
        if backlog >= self._max_size:
            self._drop()
            return
        queue.append(batch)
        if backlog < self._handoff_backlog:
            if self._sender_idle and not self._wake.is_set():
                self._wake.set()
            return
        self._hand_off()

    @property
    def sending(self) -> bool:
        """Whether the sender thread still runs (a batch queued now may still go out)."""
        return self._thread.is_alive()

    def queued(self) -> int:
        """Batches waiting now (markers not counted)."""
        return sum(1 for item in list(self._queue) if type(item) is not _Marker)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every batch queued before this call is sent; False if ``timeout`` passed."""
        if self._closing:
            return not self._queue
        flushed = threading.Event()
        self._queue.append(_Marker(flushed=flushed))
        self._wake.set()
        return flushed.wait(timeout)

    def close(self, deadline: float) -> int:
        """Send what is queued until ``deadline`` (monotonic), close the socket; return unsent batches.

        What ZMQ still holds gets the time left before ``deadline`` to reach peers (linger).
        """
        self._closing = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._abandon = True
            self._thread.join(1.0)
        with self._send_lock:
            self._pub_open = False
            unsent = self.queued()
            self._pub.close(linger=int(max(0.0, deadline - time.monotonic()) * 1000))
        return unsent

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Keep the sender from sending while inside (what a starved sender looks like)."""
        with self._send_lock:
            yield

    def _hand_off(self) -> None:
        """Let the sender run until the queue is empty, at most ~1.5 ms (see the module doc)."""
        if 0 <= self._since_timeout < self._handoff_backlog:
            self._since_timeout += 1  # the last hand-off did not empty the queue: not so soon
            return
        self.handoffs += 1
        self._drained.clear()
        self._resumed.clear()
        self._handoff_emptied = False
        self._handoff_deadline = time.monotonic() + _HANDOFF_TIMEOUT_S
        self._handoff_wanted = True
        self._wake.set()
        # The sender sets the event at its first chunk boundary past the deadline; this
        # timeout decides only when the sender is not running at all (descheduled, stuck).
        ended = self._drained.wait(_HANDOFF_TIMEOUT_S)
        self._handoff_wanted = False
        self._resumed.set()
        self._since_timeout = -1 if ended and self._handoff_emptied else 0

    def _drop(self) -> None:
        queue = self._queue
        with self._drop_lock:
            self.dropped += 1
            try:
                last = queue[-1]
            except IndexError:
                last = None
            if type(last) is _Marker and last.count and not last.closed:
                last.count += 1
            else:
                queue.append(_Marker(count=1))

    # --- the sender thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._serve()
                return
            except Exception:  # a bug must not end the stream silently: log, go on
                log.exception("KV-event sender: unexpected error; sending goes on")
                time.sleep(0.1)  # not a spin, should it happen again at once

    def _serve(self) -> None:
        queue, wake = self._queue, self._wake
        while True:
            if queue and not self._abandon:
                self._send_slice()
                continue
            if self._handoff_wanted:  # the queue is empty: the waiting caller may go on
                self._end_handoff(emptied=True)
                continue  # the caller may have queued more, or begun closing, meanwhile
            if self._closing:
                return
            wake.clear()
            self._sender_idle = True
            if not queue and not self._closing:
                wake.wait(1.0)
            self._sender_idle = False

    def _send_slice(self) -> None:
        """Send until the queue is empty, giving the GIL back at every hand-off deadline and,
        outside a hand-off, after each ~1 ms of work."""
        queue, lock = self._queue, self._send_lock
        deadline = time.monotonic() + _SLICE_S
        while queue and not self._abandon:
            with lock:
                if not self._pub_open:
                    return
                self._send_chunk()
            now = time.monotonic()
            if self._handoff_wanted:
                if now > self._handoff_deadline:
                    self._end_handoff(emptied=False)
                    deadline = time.monotonic() + _SLICE_S
            elif now > deadline:
                time.sleep(_YIELD_S)  # a deliberate GIL yield for other threads, not a poll
                deadline = time.monotonic() + _SLICE_S

    def _end_handoff(self, *, emptied: bool) -> None:
        """Release the caller waiting in :meth:`_hand_off` and block until it runs again."""
        self._handoff_wanted = False
        self._handoff_emptied = emptied
        self._drained.set()
        # Blocking here is what hands the GIL over; without it the caller would be woken
        # but could wait for the GIL until the backlog is gone (see the module doc).
        self._resumed.wait(_RESUME_WAIT_S)

    def _send_chunk(self) -> None:
        """Send up to ``_CHUNK`` entries; the send lock is held. The per-batch hot loop."""
        queue, encode, send, topic = self._queue, self._encode, self._send_frame, self._topic
        popleft = queue.popleft
        store = self._buffer.put if self._buffer is not None else None
        track = self._state.apply if self._state is not None else None
        seq = self._next_seq
        sent = failed = 0
        try:
            for _ in range(_CHUNK):
                if not queue:
                    break
                item = popleft()
                if isinstance(item, _Marker):  # C-level check on an exact type
                    self._next_seq, self.published, self.send_errors = (
                        seq,
                        self.published + sent,
                        self.send_errors + failed,
                    )
                    sent = failed = 0
                    self._take_marker(item)
                    seq = self._next_seq
                    continue
                try:
                    payload = encode(item)
                except Exception as exc:  # any batch the encoder refuses, not only bad types
                    # its seq is burned, as a drop's is: consumers see the loss as a gap
                    seq += 1
                    self._encode_failed(exc)
                    continue
                seq_frame = _SEQ_PACK(seq)
                if store is not None:
                    store(seq, seq_frame, payload)  # buffered before it is sent
                seq += 1
                try:
                    send(topic, _MORE)
                    send(seq_frame, _MORE)
                    send(payload, _LAST)
                except zmq.ZMQError:
                    failed += 1
                else:
                    sent += 1
                if track is not None:
                    track(seq - 1, item)
        finally:
            self._next_seq = seq
            self.published += sent
            self.send_errors += failed

    def _encode_failed(self, exc: Exception) -> None:
        self.encode_errors += 1
        if self._state is not None:
            self._state.invalidate("a batch could not be encoded")
        if self.encode_errors == 1 or self.encode_errors % 1000 == 0:
            log.error(
                "KV-event batch not encodable, skipped as a sequence gap (%d so far): %s: %s",
                self.encode_errors,
                type(exc).__name__,
                exc,
            )

    def _take_marker(self, marker: _Marker) -> None:
        """A drop run burns its sequence numbers; a flush marker wakes its waiter."""
        with self._drop_lock:
            marker.closed = True
            self._next_seq += marker.count
        if marker.count and self._state is not None:
            self._state.invalidate(f"the publisher dropped {marker.count} batch(es) (queue full)")
        if marker.flushed is not None:
            marker.flushed.set()
