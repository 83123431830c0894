"""The subscriber's socket thread: one ZMQ poller over every stream's sockets.

Per stream it holds a :class:`~kvevents.subscribe.stream_sockets.StreamSockets` (SUB socket,
monitor socket, replay client, tracker, counters). What arrives is fed to the stream's
:class:`~kvevents.subscribe.stream.StreamTracker`; what the tracker answers is carried out
here: payloads decoded into :class:`~kvevents.subscribe.items.Delivery` items, signals
passed on, replays requested. Everything one poll produced goes to the consumer as one
chunk through a :class:`~kvevents.subscribe.handoff.Handoff`. The loop also keeps each
stream's quiet clock (``check_at``) for the tail probes of :mod:`kvevents.subscribe.subscriber`.

Other threads talk to the loop only through :meth:`SubscriberLoop.submit` (a command
deque plus a wake-up byte on a socketpair the poller watches); every ZMQ socket is
created, used and closed on the loop's thread. A socket ZMQ refuses to open is reported
as ``Unreachable``; it never stops the loop.

The in-order path per message: three zero-copy frame receives, a frame-shape check, one
comparison in the tracker, ``decode_batch``, an append. The poll loop and the handlers of
everything it polls (live, replay, commands, timers) share its per-stream tables, so they
stay in one module.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kvevents.errors import WireError
from kvevents.subscribe.discovery import StreamSpec
from kvevents.subscribe.handoff import Handoff
from kvevents.subscribe.items import (
    Delivery,
    Item,
    Loss,
    Malformed,
    Removed,
    Reset,
    Signal,
    Unreachable,
)
from kvevents.subscribe.snapshot_assembly import SnapshotAssembly
from kvevents.subscribe.stats import SAMPLE_INTERVAL, StreamStats, StreamStatus
from kvevents.subscribe.stream import (
    MAX_SEQ_JUMP,
    CancelReplay,
    Deliver,
    DeliverSnapshot,
    RequestReplay,
    RequestSnapshot,
    TrackerAction,
)
from kvevents.subscribe.stream_sockets import StreamSockets
from kvevents.transport.curve_keys import CurveKeyPair
from kvevents.types import Holder
from kvevents.wire.codec import decode_batch
from kvevents.wire.events import AllBlocksCleared
from kvevents.wire.frames import SnapshotReply

__all__ = ["Command", "SubscriberLoop"]


class Command(enum.Enum):
    """What another thread asks the loop to do (:meth:`SubscriberLoop.submit`), with its argument."""

    ADD = "add"  # follow a new stream: (StreamSpec, seq to resume after or None)
    REPLACE = "replace"  # follow this spec instead of the holder's current stream: a StreamSpec
    REMOVE = "remove"  # stop following a holder's stream: (Holder, reason)
    SIGNAL = "signal"  # pass a Signal on to the consumer, in order with the deliveries
    STOP = "stop"  # close every socket and end the thread: no argument


_SEQ = struct.Struct(">Q")
_NOBLOCK = int(zmq.NOBLOCK)
_DRAIN = 256  # messages read from one socket per poll, for fairness between streams


def _implausible(seq: int, last: int) -> str:
    return (
        f"seq {seq} cannot follow seq {last}: more than {MAX_SEQ_JUMP} ahead, or the "
        "end marker (a corrupt frame, not a gap)"
    )


class SubscriberLoop:
    """The socket thread of a :class:`~kvevents.subscribe.subscriber.Subscriber`."""

    def __init__(
        self,
        handoff: Handoff[Item],
        *,
        context: zmq.Context[zmq.Socket[bytes]],
        replay_timeout: float,
        rcvhwm: int,
        max_pending: int,
        reconnect_max_ms: int,
        tail_probe: float | None,
        idle_check: float | None = None,
        max_message_size: int = -1,
        curve_key_pair: CurveKeyPair | None = None,
        curve_server_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.handoff = handoff
        self.curve_key_pair = curve_key_pair
        self.curve_server_key = curve_server_key
        self.max_message_size = max_message_size
        self.context = context
        self.replay_timeout = replay_timeout
        self.rcvhwm = rcvhwm
        self.max_pending = max_pending
        self.reconnect_max_ms = reconnect_max_ms
        # seconds of quiet before a stream with a replay endpoint first asks what follows
        # its last seq, then between further asks while it stays quiet (inf: never)
        inf = float("inf")
        first = tail_probe if tail_probe is not None else idle_check
        self._first_check = inf if first is None else first
        self._next_check = inf if idle_check is None else idle_check
        self.clock = clock
        self.streams: dict[Holder, StreamSockets] = {}
        self.refused: dict[Holder, StreamStats] = {}
        """Streams ZMQ refused to follow (a malformed address): their stats, ``refused``,
        until the holder is added or replaced with an address that works."""
        self._commands: deque[tuple[Command, Any]] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # submit() never waits, even on a stalled loop
        self._poller = zmq.Poller()
        self._handlers: dict[Any, Callable[[float, list[Item]], None]] = {}
        self._monitor_sockets: set[Any] = set()
        self._next_sample = 0.0
        self._stop = False
        self.thread = threading.Thread(target=self._main, name="kvevents-subscriber", daemon=True)

    # --- other threads -----------------------------------------------------------------

    def submit(self, command: Command, arg: Any = None) -> None:
        """Queue a :class:`Command` with its argument (see there)."""
        self._commands.append((command, arg))
        # OSError: the pipe is full (a wake-up is pending anyway) or the loop has ended
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def snapshot(self, now: float) -> list[StreamStats]:
        return [st.stats(now) for st in list(self.streams.values())] + list(self.refused.values())

    # --- the loop ------------------------------------------------------------------------

    def _main(self) -> None:
        error: BaseException | None = None
        try:
            self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
            self._run()
        except BaseException as exc:  # handed to the consumer, who re-raises it
            error = exc
        finally:
            self._teardown()
            self.handoff.close(error)

    def _run(self) -> None:
        wake_fd = self._wake_r.fileno()
        monitors = self._monitor_sockets
        while not self._stop:
            now = self.clock()
            deadline = self._next_deadline(now)
            ready = self._poller.poll(max(0, int((deadline - now) * 1000.0)) + 1)
            now = self.clock()
            out: list[Item] = []
            if len(ready) > 1:
                # Monitor events first: a disconnect must be known before data that follows it.
                ready.sort(key=lambda pair: pair[0] not in monitors)
            for sock, _ in ready:
                if sock == wake_fd:
                    self._drain_commands(now, out)
                else:
                    handler = self._handlers.get(sock)
                    if handler is not None:  # None: closed earlier in this round
                        handler(now, out)
            if now >= deadline:  # deadlines set during this round all lie in the future
                self._check_deadlines(now, out)
            if out and not self.handoff.put(out):
                return

    def _next_deadline(self, now: float) -> float:
        deadline = self._next_sample
        for st in self.streams.values():
            if st.retry_at is not None:
                deadline = min(deadline, st.retry_at)
            if st.replay is None:
                continue
            if st.replay.deadline is not None:
                deadline = min(deadline, st.replay.deadline)
            else:
                deadline = min(deadline, st.check_at)
        return deadline

    def _check_deadlines(self, now: float, out: list[Item]) -> None:
        for st in self.streams.values():
            if st.retry_at is not None and now >= st.retry_at:
                st.retry()
            if st.replay is None:
                continue
            if st.replay.timed_out(now):
                self._apply(st, st.tracker.on_replay_timeout(), now, out)
                if st.tracker.suspect and not st.tracker.replaying:
                    # A reconnect still unverified (the publisher's replay did not answer
                    # yet): verify again after a first quiet spell, not the longer
                    # interval between idle checks.
                    st.check_at = now + self._first_check
            elif not st.tracker.replaying and now >= st.check_at:
                # Quiet for a while: ask what follows the last seq, and again every
                # idle check while the quiet lasts. A lone batch the SUB missed (it was
                # still connecting, or a slow joiner) shows no gap: only this finds it.
                st.check_at = now + self._next_check
                self._apply(st, st.tracker.probe(), now, out)
        if now >= self._next_sample:
            for st in self.streams.values():
                st.counters.sample(now)
            self._next_sample = now + SAMPLE_INTERVAL

    def _drain_commands(self, now: float, out: list[Item]) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._commands:
            command, arg = self._commands.popleft()
            if command is Command.ADD:
                spec, after = arg
                self._add_stream(spec, now, out, after)
            elif command is Command.REPLACE:
                self._replace_stream(arg, now, out)
            elif command is Command.REMOVE:
                self._remove_stream(arg[0], arg[1], out)
            elif command is Command.SIGNAL:
                out.append(arg)
            elif command is Command.STOP:
                self._stop = True

    # --- streams -------------------------------------------------------------------------

    def _add_stream(
        self, spec: StreamSpec, now: float, out: list[Item], after: int | None = None
    ) -> None:
        def replay_opened(sock: zmq.Socket[bytes]) -> None:
            self._register(sock, lambda now, out: self._on_replay(st, now, out))

        try:
            st = StreamSockets(
                spec,
                self.context,
                rcvhwm=self.rcvhwm,
                max_message_size=self.max_message_size,
                reconnect_max_ms=self.reconnect_max_ms,
                replay_timeout=self.replay_timeout,
                max_pending=self.max_pending,
                on_replay_open=replay_opened,
                on_replay_close=self._unregister,
                curve_key_pair=self.curve_key_pair,
                curve_server_key=self.curve_server_key,
            )
        except zmq.ZMQError as exc:
            reason = f"ZMQ refused the address ({exc}); this stream is not followed"
            out.append(
                Unreachable(
                    worker=spec.worker,
                    dp_rank=spec.dp_rank,
                    address=spec.endpoint,
                    reason=reason,
                )
            )
            empty = StreamStats.empty(
                spec.worker, spec.dp_rank, spec.endpoint, spec.replay_endpoint
            )
            self.refused[Holder(spec.worker, spec.dp_rank)] = msgspec.structs.replace(
                empty, status=StreamStatus.REFUSED, error=reason
            )
            return
        self._drop_stream(st.holder)  # a holder given twice: the later spec wins, no leak
        self.streams[st.holder] = st
        self._monitor_sockets.add(st.monitor)
        self._register(st.monitor, lambda now, out: self._on_monitor(st, now, out))
        self._register(st.sub, lambda now, out: self._on_live(st, now, out))
        st.counters.sample(now)
        st.check_at = now + self._first_check
        self._apply(st, st.tracker.start(after), now, out)

    def _drop_stream(self, holder: Holder) -> StreamSockets | None:
        """Stop following ``holder``'s stream (closing its sockets); the stream, if any."""
        self.refused.pop(holder, None)
        old = self.streams.pop(holder, None)
        if old is not None:
            for sock in (old.sub, old.monitor):
                self._unregister(sock)
            self._monitor_sockets.discard(old.monitor)
            old.close()  # its replay socket unregisters itself
        return old

    def _remove_stream(self, holder: Holder, reason: str, out: list[Item]) -> None:
        """The engine no longer has this rank: stop following it, say ``Removed``."""
        self._drop_stream(holder)
        out.append(Removed(worker=holder.worker, dp_rank=holder.dp_rank, reason=reason))

    def _replace_stream(self, spec: StreamSpec, now: float, out: list[Item]) -> None:
        """The engine now publishes this rank elsewhere: drop the old stream, say ``Reset``
        (whatever it held is gone with the old engine), follow the new one from seq 0."""
        holder = Holder(spec.worker, spec.dp_rank)
        old = self._drop_stream(holder)
        if old is not None:
            out.append(
                Reset(
                    worker=spec.worker,
                    dp_rank=spec.dp_rank,
                    last_seq=old.tracker.last,
                    new_seq=None,
                    reason=f"the engine now publishes this rank on {spec.endpoint} "
                    f"(was {old.spec.endpoint}): it restarted",
                )
            )
        self._add_stream(spec, now, out)

    def _register(
        self, sock: zmq.Socket[bytes], handler: Callable[[float, list[Item]], None]
    ) -> None:
        self._poller.register(sock, zmq.POLLIN)
        self._handlers[sock] = handler

    def _unregister(self, sock: zmq.Socket[bytes]) -> None:
        self._poller.unregister(sock)
        self._handlers.pop(sock, None)

    def _on_live(self, st: StreamSockets, now: float, out: list[Item]) -> None:
        sock, tracker = st.sub, st.tracker
        recv, unpack = sock.recv, _SEQ.unpack
        st.check_at = now + self._first_check
        if st.counters.status is StreamStatus.CONNECTING:
            # data came, so a handshake happened (a ZMTP 1.0/2.0 publisher reports none)
            self._apply(st, st.handshake_done(), now, out)
        skipped, first_reason = 0, ""
        for _ in range(_DRAIN):
            # Frame by frame without copying: cheaper than recv_multipart, whose
            # per-frame RCVMORE getsockopt dominates for small messages.
            try:
                frame = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            frames = [frame]
            while frame.more:
                frame = recv(_NOBLOCK, copy=False)
                frames.append(frame)
            if len(frames) != 3 or len(frames[1]) != 8:
                skipped += 1
                first_reason = first_reason or (
                    f"{len(frames)} frames of {[len(f) for f in frames[:4]]} bytes, "
                    "expected [topic, 8-byte seq, payload]"
                )
                continue
            seq = unpack(frames[1].buffer)[0]
            payload = frames[2].bytes
            if skipped and tracker.plausible(seq):
                # the signal goes before the next batch, in stream order
                self._malformed(st, "live", skipped, first_reason, out)
                skipped, first_reason = 0, ""
            if tracker.accept_in_order(seq, payload):
                self._emit(st, seq, payload, now, out)
            elif not tracker.plausible(seq):
                skipped += 1
                first_reason = first_reason or _implausible(seq, tracker.last)
            else:
                self._apply(st, tracker.on_live(seq, payload), now, out)
        if skipped:
            self._malformed(st, "live", skipped, first_reason, out)

    def _malformed(
        self, st: StreamSockets, source: str, count: int, reason: str, out: list[Item]
    ) -> None:
        st.counters.malformed += count
        out.append(
            Malformed(
                worker=st.spec.worker,
                dp_rank=st.spec.dp_rank,
                source=source,
                count=count,
                reason=reason,
            )
        )

    def _on_replay(self, st: StreamSockets, now: float, out: list[Item]) -> None:
        client = st.replay
        assert client is not None
        sock = client.socket
        last = st.tracker.last
        skipped, first_reason = 0, ""
        for _ in range(_DRAIN):
            if client.socket is not sock:  # the tracker asked for a new replay meanwhile
                break
            try:
                reply = client.read(now)
            except WireError as exc:
                skipped += 1
                first_reason = first_reason or str(exc)
                continue
            if reply is None:
                break
            if isinstance(reply, SnapshotReply):
                reason = self._on_snapshot_reply(st, reply, now, out)
                if reason is not None:
                    skipped += 1
                    first_reason = first_reason or reason
                continue
            if not reply.is_end and not st.tracker.plausible(reply.seq):
                skipped += 1
                first_reason = first_reason or _implausible(reply.seq, st.tracker.last)
                continue
            if skipped:  # the signal goes before what follows it, in stream order
                self._malformed(st, "replay", skipped, first_reason, out)
                skipped, first_reason = 0, ""
            if reply.is_end:
                actions = st.tracker.on_replay_end()
            else:
                subscribed = reply.topic is None or reply.topic.startswith(st.topic)
                actions = st.tracker.on_replay_reply(reply.seq, reply.payload, subscribed)
            self._apply(st, actions, now, out)
        if skipped:
            self._malformed(st, "replay", skipped, first_reason, out)
        if st.tracker.last != last:
            # batches came: quiet from now on. An answer that brought nothing keeps the
            # schedule, or the checks of a quiet stream would come every ``tail_probe``.
            st.check_at = now + self._first_check

    def _on_snapshot_reply(
        self, st: StreamSockets, reply: SnapshotReply, now: float, out: list[Item]
    ) -> str | None:
        """One frame of a snapshot answer; a reason when it is skipped as malformed."""
        assembly = st.snapshot
        if assembly is None:
            return "a snapshot frame that no request of this stream asked for"
        if reply.kind == "part":
            return assembly.add(reply)
        st.snapshot = None
        tracker = st.tracker
        if reply.kind == "unavailable":
            actions = tracker.on_snapshot_failed(f"the publisher has none ({reply.reason})")
        elif not tracker.plausible(reply.seq):
            actions = tracker.on_snapshot_failed(_implausible(reply.seq, tracker.last))
        else:
            whole = assembly.finish(reply)
            if isinstance(whole, str):
                actions = tracker.on_snapshot_failed(whole)
            else:
                st.snapshot_batch = whole  # what the tracker's DeliverSnapshot hands out
                actions = tracker.on_snapshot(reply.seq)
        self._apply(st, actions, now, out)
        st.snapshot_batch = None
        return None

    def _on_monitor(self, st: StreamSockets, now: float, out: list[Item]) -> None:
        connections = st.connections
        actions, signals = st.read_monitor(now)
        if st.connections != connections:
            # The tracker asks what was missed while connecting; a batch sent just after
            # its answer, before the subscription reached the publisher (slow joiner),
            # is found by the first quiet check, as after a last message.
            st.check_at = now + self._first_check
        out.extend(signals)
        self._apply(st, actions, now, out)

    def _apply(
        self, st: StreamSockets, actions: list[TrackerAction], now: float, out: list[Item]
    ) -> None:
        for action in actions:
            if type(action) is Deliver:
                if action.payload is not None:
                    self._emit(st, action.seq, action.payload, now, out)
            elif type(action) is RequestReplay:
                assert st.replay is not None
                st.snapshot = None
                st.replay.request(action.start, now)
            elif type(action) is CancelReplay:
                assert st.replay is not None
                st.snapshot = None
                st.replay.cancel()
            elif type(action) is RequestSnapshot:
                assert st.replay is not None
                st.snapshot = SnapshotAssembly(st.spec.dp_rank)
                st.replay.request_snapshot(now)
            elif type(action) is DeliverSnapshot:
                batch, st.snapshot_batch = st.snapshot_batch, None
                if batch is not None:
                    st.counters.last_arrival = now
                    st.counters.batches += 1
                    out.append(Delivery(st.holder, action.seq, batch))
            else:
                assert isinstance(action, Signal)
                out.append(action)

    def _emit(
        self, st: StreamSockets, seq: int, payload: bytes, now: float, out: list[Item]
    ) -> None:
        counters = st.counters
        counters.last_arrival = now
        unknown: list[str] = []
        try:
            batch = decode_batch(payload, unknown)
        except WireError as exc:
            counters.decode_errors += 1
            st.tracker.lost += 1
            out.append(
                Loss(
                    worker=st.spec.worker,
                    dp_rank=st.spec.dp_rank,
                    first_seq=seq,
                    last_seq=seq,
                    reason=f"payload could not be decoded: {exc}",
                )
            )
            return
        if unknown:
            counters.unknown_events += len(unknown)
            counters.unknown_event_type = unknown[-1]
        counters.batches += 1
        blocks = 0
        for event in batch.events:
            if type(event) is not AllBlocksCleared:
                blocks += len(event.block_hashes)  # type: ignore[union-attr]
        counters.blocks += blocks
        counters.last_lag = time.time() - batch.ts
        out.append(Delivery(st.holder, seq, batch))

    def _teardown(self) -> None:
        for st in self.streams.values():
            st.close()
        self._wake_r.close()
        self._wake_w.close()
