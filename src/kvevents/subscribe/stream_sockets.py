"""One stream's sockets, tracker and counters, as the subscriber's socket thread holds them.

A :class:`StreamSockets` owns a SUB socket (live messages), a monitor socket on it
(connected, disconnected, connect retried) and, when the stream has a replay endpoint, a
:class:`~kvevents.subscribe.replay_client.ReplayClient`. Everything here runs on the socket
thread, except :meth:`StreamSockets.stats`, which only reads.

Monitor events become tracker inputs (a drop and a reconnect may mean another
publisher: see :mod:`kvevents.subscribe.stream`) and the connection status shown in the stats; the
first failed connection attempt of a streak is reported as an
:class:`~kvevents.subscribe.items.Unreachable` signal (ZMQ itself keeps retrying with backoff
up to ``reconnect_max_ms``).

A stream's status stays ``CONNECTING`` from the TCP connection until the ZMQ handshake
succeeds (or, from a publisher too old to report one, a batch arrives), which must
happen within ``curve_client.HANDSHAKE_TIMEOUT_MS`` (10 s): an address where something
else listens (an HTTP port, a replay socket given as the live one) never looks
connected. A stream with a CURVE server key (its spec's, or the subscriber's default)
connects both sockets as CURVE clients (:mod:`kvevents.subscribe.curve_client`). A
failed handshake, or a connection dropped before its handshake ended, makes the status
``REFUSED``, is counted, and the first of a streak is reported as an ``Unreachable``
signal saying why. libzmq does not retry some refusals at all and others every 100 ms,
so after a refused handshake the socket is connected again once, ``reconnect_max_ms``
later (:attr:`StreamSockets.retry_at`), unless libzmq's own retry has succeeded by then.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvevents.subscribe import curve_client
from kvevents.subscribe.curve_client import (
    HANDSHAKE_EVENTS,
    handshake_failure_reason,
    secure_client,
)
from kvevents.subscribe.discovery import StreamSpec
from kvevents.subscribe.items import Signal, Unreachable
from kvevents.subscribe.replay_client import ReplayClient
from kvevents.subscribe.snapshot_assembly import SnapshotAssembly
from kvevents.subscribe.stats import StreamCounters, StreamStats, StreamStatus
from kvevents.subscribe.stream import StreamTracker, TrackerAction
from kvevents.transport.curve_keys import CurveKeyPair
from kvevents.types import Holder
from kvevents.wire.events import KVEventBatch

log = logging.getLogger(__name__)

__all__ = ["StreamSockets"]

_MONITORED = (
    zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | HANDSHAKE_EVENTS
)

SocketHook = Callable[["zmq.Socket[bytes]"], None]


class StreamSockets:
    """See the module docstring. ``on_replay_open``/``on_replay_close`` let the owner
    (un)register the replay socket, which is replaced whenever a replay is abandoned."""

    def __init__(
        self,
        spec: StreamSpec,
        context: zmq.Context[zmq.Socket[bytes]],
        *,
        rcvhwm: int,
        reconnect_max_ms: int,
        max_message_size: int = -1,
        replay_timeout: float,
        max_pending: int,
        on_replay_open: SocketHook,
        on_replay_close: SocketHook,
        curve_key_pair: CurveKeyPair | None = None,
        curve_server_key: str | None = None,
    ) -> None:
        self.spec = spec
        self.curve_key_pair = curve_key_pair
        self.curve_server_key = spec.curve_server_key or curve_server_key
        self.retry_at: float | None = None  # reconnect then, after a refused handshake
        self._refused = False  # the last handshake failed
        self._handshaking = False  # connected, the handshake not ended yet
        self.holder = Holder(spec.worker, spec.dp_rank)
        self.topic = spec.topic.encode()
        self.tracker = StreamTracker(
            spec.worker,
            spec.dp_rank,
            has_replay=spec.replay_endpoint is not None,
            max_pending=max_pending,
            has_snapshot=spec.snapshot,
        )
        # the snapshot answer being received (set when one is asked), and the state it
        # gave once whole, until delivered
        self.snapshot: SnapshotAssembly | None = None
        self.snapshot_batch: KVEventBatch | None = None
        self.counters = StreamCounters()
        # when the stream, quiet until then, next asks the publisher what follows its
        # last seq (the socket loop sets it: inf when it never asks)
        self.check_at = float("inf")
        self.connections = 0  # connections established (handshakes done)
        self._reconnect_max_ms = reconnect_max_ms
        self._unreachable_reported = False
        self.replay: ReplayClient | None = None
        sub = context.socket(zmq.SUB)
        self.sub: zmq.Socket[bytes] = sub
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, rcvhwm)
            sub.setsockopt(zmq.MAXMSGSIZE, max_message_size)
            sub.setsockopt(zmq.RECONNECT_IVL, 100)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, reconnect_max_ms)
            sub.setsockopt(zmq.HANDSHAKE_IVL, curve_client.HANDSHAKE_TIMEOUT_MS)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            secure_client(sub, curve_key_pair, self.curve_server_key)
            self.monitor: zmq.Socket[bytes] = sub.get_monitor_socket(_MONITORED)
            sub.connect(spec.endpoint)
            if spec.replay_endpoint is not None:
                self.replay = ReplayClient(
                    context,
                    spec.replay_endpoint,
                    timeout=replay_timeout,
                    on_open=on_replay_open,
                    on_close=on_replay_close,
                    reconnect_max_ms=reconnect_max_ms,
                    max_message_size=max_message_size,
                    secure=lambda sock: secure_client(sock, curve_key_pair, self.curve_server_key),
                )
                self.replay.open()  # a bad address fails here, not mid-replay
        except BaseException:
            self.close()
            raise
        if curve_key_pair is not None and self.curve_server_key is None:
            log.warning(
                "stream %s of %s (dp %d) has no CURVE server key: it connects in the clear, "
                "unauthenticated, though this subscriber has a key pair; give the engine's "
                "public key (--curve-server-key, or the engine advertises it) to require CURVE",
                spec.endpoint,
                spec.worker,
                spec.dp_rank,
            )

    def read_monitor(self, now: float) -> tuple[list[TrackerAction], list[Signal]]:
        """Every waiting monitor event, as tracker actions and signals to pass on."""
        actions: list[TrackerAction] = []
        signals: list[Signal] = []
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return actions, signals
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                if not self._refused:
                    # Connected once the ZMQ handshake succeeds (below), CURVE or not: a
                    # TCP connection whose handshake then fails or never ends is not one
                    # (a wrong address where something else listens, or a refused key).
                    self.counters.status = StreamStatus.CONNECTING
                self._handshaking = True
                self._unreachable_reported = False
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                actions += self.handshake_done()
            elif kind & HANDSHAKE_EVENTS:
                self._handshaking = False
                signals += self._on_refused(int(kind), int(event["value"]))
            elif kind == zmq.EVENT_DISCONNECTED:
                if self._handshaking:
                    # Dropped before the handshake ended, and libzmq said nothing of it:
                    # what a socket of another kind (or a publisher refusing this one's
                    # mechanism, at times) does. A failed handshake like the others: no
                    # reconnecting at once, or a wrong address would loop here.
                    self._handshaking = False
                    signals += self._on_refused(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0)
                self.tracker.on_disconnected()
                if self._refused:  # connected again later (retry_at), not at once
                    self.retry_at = now + self._reconnect_max_ms / 1000
                else:
                    self.counters.status = StreamStatus.DISCONNECTED
                    self._reconnect()
            elif kind == zmq.EVENT_CONNECT_RETRIED and not self._refused:
                self.counters.status = StreamStatus.UNREACHABLE
                if not self._unreachable_reported:
                    self._unreachable_reported = True
                    signals.append(
                        Unreachable(
                            worker=self.spec.worker,
                            dp_rank=self.spec.dp_rank,
                            address=self.spec.endpoint,
                            reason="connection attempts fail; retrying with backoff "
                            f"up to every {self._reconnect_max_ms / 1000:g} s",
                        )
                    )

    def handshake_done(self) -> list[TrackerAction]:
        """The stream is connected: its handshake succeeded, or (a publisher whose ZMQ
        protocol predates handshake events) a message arrived while connecting. The
        tracker hears of the connection now, not at the TCP connection: a refused
        attempt is no reconnection to verify. It answers with a replay request from the
        next expected seq (:meth:`~kvevents.subscribe.stream.StreamTracker.on_connected`)."""
        self.connections += 1
        self.counters.status = StreamStatus.CONNECTED
        self.counters.handshake_error = None
        self._refused = self._handshaking = False
        # libzmq may have reconnected by itself after a refusal: no reconnect of ours
        # later, which would drop this working connection
        self.retry_at = None
        if self.replay is not None:
            # the tracker asks what was missed while connecting: on a socket that
            # connects now, not one deep in reconnect backoff from a publisher that was down
            self.replay.refresh()
        return self.tracker.on_connected()

    def _on_refused(self, kind: int, value: int) -> list[Signal]:
        """A failed handshake: counted, the status and reason set, the first one reported."""
        counters = self.counters
        counters.handshake_failures += 1
        counters.status = StreamStatus.REFUSED
        reason = handshake_failure_reason(kind, value, self.curve_server_key, self.curve_key_pair)
        first = not self._refused or counters.handshake_error != reason
        counters.handshake_error = reason
        self._refused = True
        if not first:
            return []
        return [
            Unreachable(
                worker=self.spec.worker,
                dp_rank=self.spec.dp_rank,
                address=self.spec.endpoint,
                reason=f"handshake refused: {reason}",
            )
        ]

    def retry(self) -> None:
        """Connect again after a refused handshake (the loop calls it at ``retry_at``)."""
        self.retry_at = None
        self._reconnect()

    def _reconnect(self) -> None:
        """Connect the SUB socket again after a drop.

        ZMQ reconnects by itself after a network error, but not after a protocol error,
        such as a frame above ``max_message_size``: it ends that connection for good.
        Connecting again here covers both (a pending automatic reconnect is replaced).
        """
        with contextlib.suppress(zmq.ZMQError):  # already gone with the failed session
            self.sub.disconnect(self.spec.endpoint)
        self.sub.connect(self.spec.endpoint)

    def stats(self, now: float) -> StreamStats:
        """A snapshot (any thread)."""
        c, t, spec = self.counters, self.tracker, self.spec
        bps, kps = c.rates(now)
        return StreamStats(
            worker=spec.worker,
            dp_rank=spec.dp_rank,
            endpoint=spec.endpoint,
            replay_endpoint=spec.replay_endpoint,
            status=c.status,
            last_seq=None if t.last < 0 else t.last,
            batches=c.batches,
            blocks=c.blocks,
            batches_per_s=bps,
            blocks_per_s=kps,
            gaps=t.gaps,
            replayed=t.replayed,
            lost=t.lost,
            resets=t.resets,
            snapshots=t.snapshots,
            snapshot_failures=t.snapshot_failures,
            decode_errors=c.decode_errors,
            malformed=c.malformed,
            replay_requests=0 if self.replay is None else self.replay.requests,
            replay_timeouts=0 if self.replay is None else self.replay.timeouts,
            age_s=None if c.last_arrival is None else now - c.last_arrival,
            lag_s=c.last_lag,
            curve=self.curve_server_key is not None,
            handshake_failures=c.handshake_failures,
            handshake_error=c.handshake_error,
            unknown_events=c.unknown_events,
            unknown_event_type=c.unknown_event_type,
        )

    def close(self) -> None:
        """Close every socket of the stream (linger 0). Idempotent."""
        if self.replay is not None:
            self.replay.close()
        with contextlib.suppress(zmq.ZMQError):
            self.sub.disable_monitor()
        self.sub.close(linger=0)
        monitor = getattr(self, "monitor", None)
        if monitor is not None:
            monitor.close(linger=0)
