"""Per-stream statistics of a subscriber: live counters and a readable snapshot.

:class:`StreamCounters` is written by the socket thread only; a :class:`StreamStats`
snapshot of it (:meth:`StreamSockets.stats <kvevents.subscribe.stream_sockets.StreamSockets.stats>`)
may be taken on any thread and reads plain ints and floats (each read is atomic under the
GIL, so a snapshot is consistent per field, not across fields).

Rates come from a window of samples the socket thread takes about every
``SAMPLE_INTERVAL`` seconds, ``WINDOW`` samples long: a rate is the counter's growth
from the oldest sample to now, divided by the elapsed time. O(1) per sample, O(1) per
snapshot.
"""

from __future__ import annotations

from collections import deque

import msgspec

from kvevents.types import StrEnum

__all__ = ["SAMPLE_INTERVAL", "WINDOW", "StreamCounters", "StreamStats", "StreamStatus"]

SAMPLE_INTERVAL = 0.5
WINDOW = 10  # samples: rates cover the last ~5 s


class StreamStatus(StrEnum):
    """The connection state of one stream's SUB socket, as its monitor reports it.

    ``CONNECTING`` -> ``CONNECTED`` <-> ``DISCONNECTED`` (dropped, reconnecting); a
    connection attempt that fails, at any point, makes it ``UNREACHABLE`` until one
    succeeds. ``REFUSED``: the connection is made but the ZMQ handshake fails (a CURVE
    key the publisher refuses, CURVE on one side only, or an address where no PUB
    socket listens): no data arrives until a handshake succeeds, and
    ``handshake_error`` in the stats says why. A stream is ``CONNECTED`` only once its
    handshake succeeds: until then it stays ``CONNECTING`` (a TCP connection alone says
    nothing of what listens, or of the key). Members are their strings
    ("connected", ...), as JSON shows them.
    """

    CONNECTING = "connecting"
    CONNECTED = "connected"
    DISCONNECTED = "disconnected"
    UNREACHABLE = "unreachable"
    REFUSED = "refused"


class StreamStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one stream.

    ``status``: a :class:`StreamStatus`: "connecting" (not connected yet), "connected",
    "disconnected" (dropped, reconnecting), "unreachable" (connection attempts fail) or
    "refused" (its handshake was refused, or ZMQ refused its address: ``error``). ``last_seq`` is None before
    the first delivery. ``age_s`` is the time since the last message (live or replayed)
    arrived; ``lag_s`` how far that batch's timestamp was behind the local wall clock on
    arrival. ``lost`` counts sequence numbers, the other counters batches or events.
    ``curve``: the stream is CURVE-encrypted (it has a server key); ``handshake_failures``
    counts refused handshakes on its live socket, ``handshake_error`` says why the last
    one failed (None once a handshake succeeds).
    """

    worker: str
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    status: StreamStatus
    last_seq: int | None
    batches: int
    blocks: int
    batches_per_s: float
    blocks_per_s: float
    gaps: int
    replayed: int
    lost: int
    resets: int
    decode_errors: int
    malformed: int
    replay_requests: int
    replay_timeouts: int
    age_s: float | None
    lag_s: float | None
    curve: bool = False
    handshake_failures: int = 0
    handshake_error: str | None = None
    unknown_events: int = 0
    """Events of a type this subscriber does not know (a newer engine's), left out of
    their batches; the last such type is ``unknown_event_type``."""
    unknown_event_type: str | None = None
    error: str | None = None
    """Why a ``refused`` stream is not followed when no handshake was refused (ZMQ
    refused its address); None otherwise."""
    snapshots: int = 0
    """Gaps replay could not fill that the publisher's snapshot filled (each a ``resync``)."""
    snapshot_failures: int = 0
    """Snapshots asked for that did not come whole (what replay lacked was then lost)."""

    @classmethod
    def empty(
        cls, worker: str, dp_rank: int, endpoint: str, replay_endpoint: str | None
    ) -> StreamStats:
        """The stats of a stream that is not connected yet."""
        return cls(
            worker=worker,
            dp_rank=dp_rank,
            endpoint=endpoint,
            replay_endpoint=replay_endpoint,
            status=StreamStatus.CONNECTING,
            last_seq=None,
            batches=0,
            blocks=0,
            batches_per_s=0.0,
            blocks_per_s=0.0,
            gaps=0,
            replayed=0,
            lost=0,
            resets=0,
            decode_errors=0,
            malformed=0,
            replay_requests=0,
            replay_timeouts=0,
            age_s=None,
            lag_s=None,
        )


class StreamCounters:
    """What the socket thread counts for one stream (see the module docstring)."""

    __slots__ = (
        "batches",
        "blocks",
        "decode_errors",
        "handshake_error",
        "handshake_failures",
        "last_arrival",
        "last_lag",
        "malformed",
        "samples",
        "status",
        "unknown_event_type",
        "unknown_events",
    )

    def __init__(self) -> None:
        self.batches = 0
        self.blocks = 0
        self.decode_errors = 0
        self.unknown_events = 0
        self.unknown_event_type: str | None = None
        self.malformed = 0
        self.handshake_failures = 0
        self.handshake_error: str | None = None
        self.status = StreamStatus.CONNECTING
        self.last_arrival: float | None = None  # monotonic clock
        self.last_lag: float | None = None
        self.samples: deque[tuple[float, int, int]] = deque(maxlen=WINDOW)

    def sample(self, now: float) -> None:
        self.samples.append((now, self.batches, self.blocks))

    def rates(self, now: float) -> tuple[float, float]:
        """(batches/s, blocks/s) over the sample window."""
        if not self.samples:
            return 0.0, 0.0
        t0, b0, k0 = self.samples[0]
        dt = now - t0
        if dt <= 0:
            return 0.0, 0.0
        return (self.batches - b0) / dt, (self.blocks - k0) / dt
