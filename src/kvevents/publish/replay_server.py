"""Replay: the ring of recently published batches and the ROUTER that serves it.

A consumer that notices a gap in the live sequence asks the publisher's replay socket
for every batch from ``start_seq`` on (wire format in :mod:`kvevents.wire`). Two parts:

* :class:`ReplayBuffer` keeps the last ``capacity`` published batches, already encoded,
  indexed by sequence number. The publisher writes it; the replay thread reads it.
* :class:`ReplayServer` owns the ROUTER socket and answers requests from its own thread,
  so a slow or stalled replay client never delays live publishing: live batches go out
  on another socket from another thread, and the answer to a client whose pipe is full
  is cut short (and counted) rather than waited for. With snapshots on it also answers a
  snapshot request with the rank's whole block set (:mod:`kvevents.publish.snapshot`).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator
from typing import NamedTuple

import zmq

from kvevents.errors import WireError
from kvevents.publish.block_state import BlockState
from kvevents.publish.snapshot import snapshot_parts
from kvevents.wire.events import KVEventBatch
from kvevents.wire.frames import (
    is_snapshot_request,
    parse_replay_request,
    replay_end_frames,
    snapshot_end_frames,
    snapshot_part_frames,
    snapshot_unavailable_frames,
)

__all__ = ["ReplayBuffer", "ReplayEntry", "ReplayServer"]


class ReplayEntry(NamedTuple):
    """One buffered batch: its sequence number, that number as the 8-byte frame, the payload."""

    seq: int
    seq_frame: bytes
    payload: bytes


class ReplayBuffer:
    """The last ``capacity`` batches published, for replay; one writer, any readers.

    A ring of three parallel lists (each stored batch's sequence number, its 8-byte
    frame, payload); the ``n``-th batch stored lives in slot ``n % capacity``. Slots go
    by batches stored, not by sequence numbers: a batch dropped or not encodable burns a
    sequence number but takes no slot, so the buffer always holds the last ``capacity``
    batches it was given, as upstream's deque does (slots by sequence number would hold
    fewer after every drop, and answer less than the buffer had). Parallel lists rather
    than one tuple per batch, because ints and bytes are not tracked by the cyclic
    garbage collector and tuples are: a tuple per batch would count towards the
    collector's thresholds and so, at a few hundred thousand batches a second, set off
    collections of the host engine's whole heap from inside the publisher's hot path.
    Storing a batch allocates nothing the collector tracks.

    Invariants:

    * sequence numbers are stored in increasing order by a single writer (the publisher,
      under its send lock), so they increase along the ring from its oldest slot;
      ``next_seq`` is one past the highest stored;
    * readers in other threads never see a mix of two entries. The writer marks the slot
      -1, stores frame and payload, then the new sequence number; a reader reads the
      sequence number, frame and payload, then the sequence number again, and keeps the
      entry only if both readings are the one it wants. A write in between changes the
      second reading, because no sequence number is written twice (a seqlock, with the
      GIL making each list store atomic). An entry overwritten while a reader looks for
      it has left the buffer, as any older one has.

    Complexity: ``put`` is O(1); ``get`` and finding where ``since(start)`` begins are
    O(log capacity) (a bisection: the stored sequence numbers increase along the ring),
    then ``since`` is O(1) per entry it yields. A deque scanned for ``start``
    (upstream's choice) is O(n) per request.
    """

    __slots__ = ("_capacity", "_count", "_frames", "_next", "_payloads", "_seqs")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"ReplayBuffer capacity={capacity} must be at least 1")
        self._capacity = capacity
        self._seqs: list[int] = [-1] * capacity
        self._frames: list[bytes] = [b""] * capacity
        self._payloads: list[bytes] = [b""] * capacity
        self._next = 0
        self._count = 0  # batches stored so far: the next one goes to slot count % capacity

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def next_seq(self) -> int:
        """One past the highest sequence number stored (0 when empty)."""
        return self._next

    def put(self, seq: int, seq_frame: bytes, payload: bytes) -> None:
        """Store a batch; ``seq`` must be above every stored one."""
        slot = self._count % self._capacity
        seqs = self._seqs
        seqs[slot] = -1  # readers of this slot from here on see no entry, or the new one
        self._frames[slot] = seq_frame
        self._payloads[slot] = payload
        seqs[slot] = seq
        self._next = seq + 1
        self._count += 1

    def get(self, seq: int) -> ReplayEntry | None:
        """The entry of ``seq``, or None when it was never stored or has left the buffer."""
        count = self._count
        i = self._first_at_or_after(seq, count)
        if i >= count:
            return None
        entry = self._read(i % self._capacity)
        return entry if entry is not None and entry.seq == seq else None

    def since(self, start: int) -> Iterator[ReplayEntry]:
        """Every stored entry with ``seq >= start`` and below ``next_seq`` at the call, in order.

        A start older than the buffer begins at the oldest entry kept, so the caller sees
        the missing range as a gap. Entries are read lazily: one the writer overwrites
        before it is reached has left the buffer and is skipped, like any older one.
        """
        count, end = self._count, self._next
        capacity, read = self._capacity, self._read
        last = start - 1
        for i in range(self._first_at_or_after(start, count), count):
            entry = read(i % capacity)
            if entry is not None and last < entry.seq < end:  # else: overwritten since
                last = entry.seq
                yield entry

    def _first_at_or_after(self, seq: int, count: int) -> int:
        """The write number of the oldest kept entry with a sequence number >= ``seq``
        (``count`` when none)."""
        seqs, capacity = self._seqs, self._capacity
        # an entry overwritten meanwhile reads as a newer seq (or -1 while written):
        # bisection then starts a little early or late, and the reads that follow check
        return bisect.bisect_left(
            range(max(0, count - capacity), count), seq, key=lambda i: seqs[i % capacity]
        ) + max(0, count - capacity)

    def _read(self, slot: int) -> ReplayEntry | None:
        seqs = self._seqs
        seq = seqs[slot]
        if seq < 0:
            return None
        entry = ReplayEntry(seq, self._frames[slot], self._payloads[slot])
        return entry if seqs[slot] == seq else None  # overwritten while it was read


class ReplayServer:
    """Answers replay requests on a bound ROUTER socket from a thread of its own.

    The socket must have ``ROUTER_MANDATORY`` set so that a full pipe raises instead of
    silently discarding; every send is non-blocking. For a request ``[id, b"", start]``
    the answer is every buffered entry with ``seq >= start`` as ``[b"", topic, seq,
    payload]`` followed by the end marker. A malformed request gets the end marker alone.
    When a client's pipe is full (it stopped reading: the publisher sizes the pipe for two
    whole answers) or it is gone, the rest of its answer, end marker included, is dropped
    and ``truncated`` counts it.

    A snapshot request (:func:`~kvevents.wire.frames.is_snapshot_request`) is answered
    from ``snapshot``, the rank's :class:`~kvevents.publish.block_state.BlockState`, its
    parts encoded with ``encode`` as batches of rank ``rank``; without one (snapshots
    off), or when the state is not exact, the answer says it is unavailable and why.

    Counters (read from any thread): ``requests``, ``replayed`` (batches sent),
    ``truncated``, ``malformed``, ``snapshots`` (answered whole or cut short),
    ``snapshots_unavailable``.
    """

    def __init__(
        self,
        router: zmq.Socket[bytes],
        buffer: ReplayBuffer,
        topic: bytes,
        context: zmq.Context[zmq.Socket[bytes]],
        *,
        name: str = "kvevents-replay",
        snapshot: BlockState | None = None,
        encode: Callable[[KVEventBatch], bytes] | None = None,
        rank: int = 0,
    ) -> None:
        self._router = router
        self._buffer = buffer
        self._topic = topic
        self._state = snapshot
        self._encode = encode
        self._rank = rank
        self.requests = 0
        self.replayed = 0
        self.truncated = 0
        self.malformed = 0
        self.snapshots = 0
        self.snapshots_unavailable = 0
        # A PAIR over inproc wakes the poller for shutdown without a polling timeout.
        address = f"inproc://{name}-stop-{id(self):x}"
        self._stop_rx = context.socket(zmq.PAIR)
        self._stop_rx.bind(address)
        self._stop_tx = context.socket(zmq.PAIR)
        self._stop_tx.connect(address)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop the thread (which closes the ROUTER) and wait up to ``timeout`` seconds."""
        if self._thread.is_alive():
            self._stop_tx.send(b"", zmq.NOBLOCK)
            self._thread.join(timeout)
        else:
            self._router.close(linger=0)
            self._stop_rx.close(linger=0)
        self._stop_tx.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._stop_rx, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._stop_rx in ready:
                    return
                if self._router in ready:
                    self._serve_waiting()
        except zmq.ContextTerminated:
            return  # the application terminated the context: nothing left to serve
        finally:
            self._router.close(linger=0)
            self._stop_rx.close(linger=0)

    def _serve_waiting(self) -> None:
        """Answer every request already queued on the ROUTER."""
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.serve(frames)

    def serve(self, frames: list[bytes]) -> None:
        """Answer one request as received by the ROUTER (identity first)."""
        if is_snapshot_request(frames):
            self._serve_snapshot(bytes(frames[0]))
            return
        try:
            identity, start = parse_replay_request(frames)
        except WireError as exc:
            self.malformed += 1
            sender: bytes | None = getattr(exc, "identity", None)
            if sender is not None:
                self._send(sender, replay_end_frames())
            return
        self.requests += 1
        topic = self._topic
        for entry in self._buffer.since(start):
            if not self._send(identity, [b"", topic, entry.seq_frame, entry.payload]):
                self.truncated += 1
                return
            self.replayed += 1
        if not self._send(identity, replay_end_frames()):
            self.truncated += 1

    def _serve_snapshot(self, identity: bytes) -> None:
        """Send the rank's state as parts then an end frame, or say why there is none."""
        state, encode = self._state, self._encode
        view = (
            'this publisher keeps no block set (its kv-events config has no "snapshot": true)'
            if state is None or encode is None
            else state.view()
        )
        if isinstance(view, str):
            self.snapshots_unavailable += 1
            if not self._send(identity, snapshot_unavailable_frames(view)):
                self.truncated += 1
            return
        assert encode is not None
        self.snapshots += 1
        sent = 0
        for payload in snapshot_parts(view, self._rank, encode):
            if not self._send(identity, snapshot_part_frames(view.seq, payload)):
                self.truncated += 1
                return
            sent += 1
        if not self._send(identity, snapshot_end_frames(view.seq, sent)):
            self.truncated += 1

    def _send(self, identity: bytes, frames: list[bytes]) -> bool:
        """Send one reply without blocking; False when the client cannot take it."""
        try:
            self._router.send_multipart([identity, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EAGAIN, zmq.EHOSTUNREACH):
                return False
            raise
        return True
