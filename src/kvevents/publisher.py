"""The publisher an engine embeds: SGLang's and vLLM's publisher API, without their stalls.

``EventPublisher`` (publish, shutdown), ``NullEventPublisher``, ``ZmqEventPublisher`` and
``EventPublisherFactory.create(config, attn_dp_rank=0)`` keep SGLang's names, keywords
and bytes on the wire, so switching is one import; vLLM's ``data_parallel_rank=`` is
accepted wherever ``attn_dp_rank=`` is.

How :class:`ZmqEventPublisher` moves a batch::

    publish(batch) --append--> queue --> sender thread: seq, encode, replay buffer, PUB
                                 \\--(backlog >= help_backlog)--> the caller sends one itself
    replay thread: ROUTER <-> replay buffer      (never touches the PUB socket)

Guarantees:

* ``publish()`` takes no lock on its fast path (a deque append is atomic) and never
  waits for the network: PUB sends are non-blocking. When ``max_queue_size`` batches
  are waiting, the batch is dropped and counted, and it still consumes a sequence number
  that is never sent nor buffered, so consumers see the loss as a gap that replay
  cannot fill. Consecutive drops share one marker in the queue.
* Sequence numbers are assigned when a batch leaves the queue, under the send lock, so
  they are dense and in queue order; a batch is stored in the replay buffer *before*
  its send, so every sequence number sent is replayable while it is in the buffer.
* CPython gives the GIL to a thread that never blocks in slices of the switch interval
  (5 ms). A caller publishing in a tight loop would starve the sender thread until the
  queue overflowed. So when the backlog reaches ``help_backlog`` the caller sends one
  queued batch itself on each ``publish()`` (if the sender is not mid-send), and the
  sender thread steps aside while the caller is doing so. Under normal load (an engine
  publishing once per step) the queue is nearly empty and the caller only appends.
* The sender works in slices of about a millisecond and then yields, so a long backlog
  never holds the GIL away from the engine's own threads for long.
* ``shutdown()`` is idempotent: it sends what was accepted until ``shutdown_timeout``,
  lets the socket flush for what is left of it, then closes.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import msgspec
import zmq

from kvevents.config import KVEventsConfig
from kvevents.endpoints import Endpoint, offset_endpoint_port
from kvevents.errors import ConfigError, EndpointError, PublisherStateError
from kvevents.publisher_base import (
    EventPublisher,
    NullEventPublisher,
    PublisherState,
    PublisherStats,
    resolve_publisher_rank,
)
from kvevents.replay import ReplayBuffer, ReplayServer
from kvevents.wire import END_SEQ, KVEventBatch, encode_batch

__all__ = [
    "EventPublisher",
    "EventPublisherFactory",
    "NullEventPublisher",
    "PublisherState",
    "PublisherStats",
    "ZmqEventPublisher",
]

_SEQ_PACK = struct.Struct(">Q").pack
_SLICE_S = 0.001  # the sender yields the GIL after this much continuous work
_YIELD_S = 50e-6  # ... for this long
_STEP_ASIDE_S = 0.001  # the sender waits this long while the caller is sending itself
_HELP_WAIT_S = 0.001  # longest a helping caller waits for the sender to finish its chunk
_CHUNK = 32  # batches the sender sends per hold of the send lock


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


def _open_socket(
    sock: zmq.Socket[bytes], endpoint: Endpoint, bind: bool, rank: int, role: str
) -> str:
    """Bind or connect; return the address with an OS-picked port filled in."""
    address = str(endpoint)
    if endpoint.is_ipv6:
        sock.ipv6 = True
    try:
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    except zmq.ZMQError as exc:
        raise EndpointError(_open_error(address, endpoint, bind, rank, role, exc)) from None
    if bind and endpoint.is_tcp and endpoint.port == 0:
        bound = Endpoint.parse(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        assert bound.port is not None
        return str(endpoint.with_port(bound.port))
    return address


def _open_error(
    address: str, endpoint: Endpoint, bind: bool, rank: int, role: str, exc: zmq.ZMQError
) -> str:
    verb = "bind" if bind else "connect"
    head = f"cannot {verb} the {role} endpoint {address} of publisher rank {rank}"
    if exc.errno == zmq.EADDRINUSE:
        where = f"port {endpoint.port}" if endpoint.is_tcp else address
        return (
            f"{head}: {where} is already in use by another rank or process. Each rank needs "
            "its own port: rank r binds base + r. Under pure DP every scheduler has "
            "attn_dp_rank 0, so choose the rank with select_kv_publisher_dp_rank(attn_dp_size, "
            "attn_dp_rank, dp_rank); otherwise stop the other process or pick another base port"
        )
    if not bind and endpoint.is_wildcard:
        return f"{head}: a wildcard host can only be bound; set bind=true or name a host"
    return f"{head}: {exc.strerror}"


class ZmqEventPublisher(EventPublisher):
    """Publishes batches on a ZMQ PUB socket; serves replay on a ROUTER (see the module doc).

    ``endpoint`` and ``replay_endpoint`` are deployment bases, offset by ``rank``
    (:meth:`offset_endpoint_port`). ``bind=None`` binds wildcard hosts, ipc and inproc and
    connects otherwise. Port 0 lets the OS pick; :attr:`endpoint` and
    :attr:`replay_endpoint` hold the real addresses once constructed. A batch must not be
    modified after it is published.
    """

    END_SEQ: ClassVar[int] = END_SEQ
    SHUTDOWN_TIMEOUT: ClassVar[float] = 1.0

    def __init__(
        self,
        attn_dp_rank: int | None = None,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        bind: bool | None = None,
        *,
        data_parallel_rank: int | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        shutdown_timeout: float | None = None,
        help_backlog: int = 256,
        encoding: Literal["map", "array"] = "map",
    ) -> None:
        self._rank = resolve_publisher_rank(attn_dp_rank, data_parallel_rank)
        for name, value, low in (
            ("buffer_steps", buffer_steps, 1),
            ("hwm", hwm, 0),
            ("max_queue_size", max_queue_size, 1),
            ("help_backlog", help_backlog, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"ZmqEventPublisher {name}={value!r} must be an int >= {low}")
        if encoding not in ("map", "array"):
            raise ConfigError(f"ZmqEventPublisher encoding={encoding!r} must be 'map' or 'array'")
        live = Endpoint.parse(endpoint).for_rank(self._rank)
        replay = (
            None
            if replay_endpoint is None
            else Endpoint.parse(replay_endpoint).for_rank(self._rank)
        )
        self._topic = topic.encode()
        self._max_queue_size = max_queue_size
        self._help_backlog = help_backlog
        self._shutdown_timeout = (
            self.SHUTDOWN_TIMEOUT if shutdown_timeout is None else shutdown_timeout
        )
        if encoding == "map":
            self._encode: Callable[[KVEventBatch], bytes] = msgspec.msgpack.Encoder().encode
        else:
            self._encode = _encode_array
        context = context if context is not None else zmq.Context.instance()

        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, hwm)
        router = None
        self._buffer: ReplayBuffer | None = None
        self._replay: ReplayServer | None = None
        try:
            self._endpoint = _open_socket(
                pub, live, live.should_bind if bind is None else bind, self._rank, "live"
            )
            self._replay_endpoint: str | None = None
            if replay is not None:
                router = context.socket(zmq.ROUTER)
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                # Room for two whole answers per client: ZMQ acknowledges reads lazily, so a
                # pipe sized for one answer can refuse a client that is reading fine.
                router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay_endpoint = _open_socket(router, replay, True, self._rank, "replay")
                self._buffer = ReplayBuffer(buffer_steps)
                self._replay = ReplayServer(
                    router, self._buffer, self._topic, context, name=f"kvevents-replay-{self._rank}"
                )
        except BaseException:
            pub.close(linger=0)
            if router is not None:
                router.close(linger=0)
            raise
        self._pub = pub
        # pyzmq's Socket.send adds keyword handling in Python on top of the same C call;
        # the sender calls the C-level method directly (about 0.5 us less per batch).
        self._send_frame: Callable[[bytes, int], Any] = super(zmq.Socket, pub).send

        self._queue: deque[KVEventBatch | _Marker] = deque()
        self._send_lock = threading.Lock()  # held while a batch leaves the queue and is sent
        self._drop_lock = threading.Lock()  # orders drops against the sender closing a run
        self._lifecycle_lock = threading.Lock()
        self._wake = threading.Event()
        self._sender_idle = False
        self._abandon = False
        self._pub_open = True
        self._state = PublisherState.RUNNING
        self._next_seq = 0
        self._published = self._dropped = self._send_errors = self._encode_errors = 0
        self._help_requests = self._caller_sends = self._unsent = 0
        self._sender = threading.Thread(
            target=self._run_sender, name=f"kvevents-publisher-{self._rank}", daemon=True
        )
        self._sender.start()
        if self._replay is not None:
            self._replay.start()

    # --- public surface ---------------------------------------------------------------

    offset_endpoint_port = staticmethod(offset_endpoint_port)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def endpoint(self) -> str:
        """The live address, with the real port when the OS picked it."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The replay address (real port), or None when replay is off."""
        return self._replay_endpoint

    @property
    def topic(self) -> str:
        return self._topic.decode()

    @property
    def state(self) -> PublisherState:
        return self._state

    @property
    def stats(self) -> PublisherStats:
        replay = self._replay
        return PublisherStats(
            published=self._published,
            dropped=self._dropped,
            send_errors=self._send_errors,
            encode_errors=self._encode_errors,
            replay_requests=replay.requests if replay else 0,
            replayed=replay.replayed if replay else 0,
            replay_truncated=replay.truncated if replay else 0,
            malformed_requests=replay.malformed if replay else 0,
            caller_sends=self._caller_sends,
            queued=sum(1 for item in list(self._queue) if type(item) is not _Marker),
            unsent=self._unsent,
        )

    def publish(self, events: KVEventBatch) -> None:
        """Queue one batch (filling its rank when unset); drop and count it when the queue is full."""
        if self._state is not PublisherState.RUNNING:
            raise PublisherStateError(
                f"publisher rank {self._rank} is {self._state.value}: publish() before shutdown()"
            )
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._rank
        queue = self._queue
        backlog = len(queue)
        if backlog >= self._max_queue_size:
            self._drop()
            return
        queue.append(events)
        if backlog < self._help_backlog:
            if self._sender_idle and not self._wake.is_set():
                self._wake.set()
            return
        # The sender thread is behind (starved of the GIL by this caller, most likely).
        self._help_requests += 1
        # Waiting on the lock (not spinning) hands the GIL to a sender stuck mid-chunk.
        if self._send_lock.acquire(timeout=_HELP_WAIT_S):
            try:
                if self._pub_open and queue:
                    self._send_next()
                    self._caller_sends += 1
            finally:
                self._send_lock.release()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every batch accepted before this call is sent; False if ``timeout`` passed first."""
        if self._state is not PublisherState.RUNNING:
            return not self._queue
        flushed = threading.Event()
        self._queue.append(_Marker(flushed=flushed))
        self._wake.set()
        return flushed.wait(timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """Send what was accepted (up to ``timeout`` seconds, default ``shutdown_timeout``), then close."""
        with self._lifecycle_lock:
            if self._state is not PublisherState.RUNNING:
                return
            self._state = PublisherState.DRAINING
        deadline = time.monotonic() + (self._shutdown_timeout if timeout is None else timeout)
        self._wake.set()
        self._sender.join(max(0.0, deadline - time.monotonic()))
        if self._sender.is_alive():
            self._abandon = True
            self._sender.join(1.0)
        with self._send_lock:
            self._pub_open = False
            self._unsent = sum(1 for item in list(self._queue) if type(item) is not _Marker)
            linger_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.stop(timeout=1.0)
        self._state = PublisherState.CLOSED

    # --- internals --------------------------------------------------------------------

    def _drop(self) -> None:
        queue = self._queue
        with self._drop_lock:
            self._dropped += 1
            try:
                last = queue[-1]
            except IndexError:
                last = None
            if type(last) is _Marker and last.count and not last.closed:
                last.count += 1
            else:
                queue.append(_Marker(count=1))

    def _send_next(self) -> None:
        """Take the next queued item and send it. Caller holds the send lock; queue non-empty."""
        item = self._queue.popleft()
        if type(item) is _Marker:
            with self._drop_lock:
                item.closed = True
                self._next_seq += item.count
            if item.flushed is not None:
                item.flushed.set()
            return
        try:
            payload = self._encode(item)  # type: ignore[arg-type]
        except (TypeError, ValueError, msgspec.EncodeError):
            self._encode_errors += 1
            return
        seq = self._next_seq
        self._next_seq = seq + 1
        seq_frame = _SEQ_PACK(seq)
        if self._buffer is not None:
            self._buffer.put(seq, seq_frame, payload)
        send = self._send_frame
        try:
            send(self._topic, zmq.SNDMORE | zmq.NOBLOCK)
            send(seq_frame, zmq.SNDMORE | zmq.NOBLOCK)
            send(payload, zmq.NOBLOCK)
        except zmq.ZMQError:
            self._send_errors += 1
        else:
            self._published += 1

    def _run_sender(self) -> None:
        queue, wake = self._queue, self._wake
        while True:
            if queue and not self._abandon:
                seen_help = self._help_requests
                self._send_slice(seen_help)
                if queue and self._help_requests != seen_help and self._running():
                    # The caller is sending for itself: stay out of its way for a moment.
                    wake.clear()
                    wake.wait(_STEP_ASIDE_S)
                continue
            if not self._running():
                return
            wake.clear()
            self._sender_idle = True
            if not queue and self._running():
                wake.wait(1.0)
            self._sender_idle = False

    def _running(self) -> bool:
        return self._state is PublisherState.RUNNING

    def _send_slice(self, seen_help: int) -> None:
        """Send until the queue is empty or the caller starts helping; yield the GIL each ~1 ms."""
        queue, lock = self._queue, self._send_lock
        deadline = time.monotonic() + _SLICE_S
        while queue and not self._abandon:
            if self._help_requests != seen_help and self._running():
                return
            with lock:
                if not self._pub_open:
                    return
                for _ in range(_CHUNK):
                    if not queue:
                        break
                    self._send_next()
            if time.monotonic() > deadline:
                time.sleep(_YIELD_S)  # a deliberate GIL yield for the engine's threads, not a poll
                deadline = time.monotonic() + _SLICE_S


def _encode_array(batch: KVEventBatch) -> bytes:
    return encode_batch(batch, "array")


PublisherConstructor = Callable[..., EventPublisher]


class EventPublisherFactory:
    """Builds the publisher a ``--kv-events-config`` asks for, by name from a registry."""

    _registry: ClassVar[dict[str, PublisherConstructor]] = {
        "null": NullEventPublisher,
        "zmq": ZmqEventPublisher,
    }

    @classmethod
    def register_publisher(cls, name: str, ctor: PublisherConstructor) -> None:
        """Make ``{"publisher": name}`` construct ``ctor(attn_dp_rank=..., **settings)``."""
        if name in cls._registry:
            raise ConfigError(f"publisher {name!r} is already registered; choose another name")
        cls._registry[name] = ctor

    @classmethod
    def registered(cls) -> tuple[str, ...]:
        return tuple(sorted(cls._registry))

    @classmethod
    def create(
        cls,
        config: str | dict[str, Any] | KVEventsConfig | None,
        attn_dp_rank: int | None = None,
        *,
        data_parallel_rank: int | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> EventPublisher:
        """The publisher for ``config`` (JSON text, a dict, a KVEventsConfig or None) at a rank.

        None, ``""``, ``{}``, ``{"publisher": "null"}`` and ``enable_kv_cache_events: false``
        give a :class:`NullEventPublisher`. ``context`` is passed to the ZMQ publisher only.
        """
        rank = resolve_publisher_rank(attn_dp_rank, data_parallel_rank)
        if isinstance(config, KVEventsConfig):
            cfg = config
        elif isinstance(config, dict):
            cfg = KVEventsConfig.from_dict(config)
        elif config is None or isinstance(config, str):
            cfg = KVEventsConfig.from_json(config)
        else:
            raise ConfigError(
                f"kv-events config {config!r} must be JSON text, a dict, a KVEventsConfig or None"
            )
        if not cfg.enabled:
            return NullEventPublisher(attn_dp_rank=rank)
        ctor = cls._registry.get(cfg.publisher)
        if ctor is None:
            raise ConfigError(
                f"kv-events config key 'publisher' is {cfg.publisher!r}, which is not registered; "
                f"registered publishers: {', '.join(cls.registered())}"
            )
        settings = cfg.to_dict()
        for key in ("publisher", "enable_kv_cache_events"):
            settings.pop(key, None)
        if context is not None and ctor is ZmqEventPublisher:
            settings["context"] = context
        return ctor(attn_dp_rank=rank, **settings)
