"""The publisher an engine embeds: SGLang's and vLLM's publisher API, without their stalls.

``EventPublisher`` (publish, shutdown), ``NullEventPublisher``, ``ZmqEventPublisher`` and
``EventPublisherFactory.create(config, attn_dp_rank=0)`` keep SGLang's names, keywords
and bytes on the wire, so switching is one import; vLLM's ``data_parallel_rank=`` is
accepted wherever ``attn_dp_rank=`` is.

A :class:`ZmqEventPublisher` is three parts, each on its own thread:

* the caller's ``publish(batch)``: a lock-free append, with a bounded wait that hands the
  GIL to the sender when the backlog grows (:mod:`kvevents.publish.send_queue`);
* the sender thread: sequence number, encoding, replay buffer, then the PUB socket;
  a full queue drops the batch and leaves a sequence gap (same module);
* the replay thread: answers DEALER requests from the replay buffer on a ROUTER
  (:mod:`kvevents.publish.replay_server`), and with ``snapshot=True`` a snapshot request
  with the rank's current block set (:mod:`kvevents.publish.block_state`).

Exposure: the default ``endpoint``, SGLang's and vLLM's ``tcp://*:5557``, binds every
interface with no authentication, and a batch's token ids reveal the prompt text. Bind a
specific address, or use CURVE keys (:mod:`kvevents.publish.curve_server`), as
docs/security.md says; ``kvevents engine`` binds loopback unless told otherwise.

Lifecycle: RUNNING from construction (sockets bound, threads started), DRAINING while
``shutdown()`` sends what was accepted, CLOSED after. ``shutdown()`` is idempotent and
bounded by ``shutdown_timeout``; ZMQ gets what is left of it to deliver (linger).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import msgspec
import zmq

from kvevents.errors import ConfigError, PublisherStateError
from kvevents.publish.base import (
    EventPublisher,
    NullEventPublisher,
    PublisherState,
    PublisherStats,
    resolve_publisher_rank,
)
from kvevents.publish.block_state import BlockState
from kvevents.publish.config import DEFAULT_SNAPSHOT_MAX_BLOCKS, KVEventsConfig
from kvevents.publish.curve_server import CurveServer
from kvevents.publish.replay_server import ReplayBuffer, ReplayServer
from kvevents.publish.send_queue import SendQueue
from kvevents.publish.snapshot import PART_BLOCKS
from kvevents.publish.sockets import open_socket
from kvevents.transport.endpoints import Endpoint, offset_endpoint_port
from kvevents.wire.codec import encode_batch
from kvevents.wire.events import KVEventBatch
from kvevents.wire.frames import END_SEQ

__all__ = [
    "EventPublisher",
    "EventPublisherFactory",
    "NullEventPublisher",
    "PublisherState",
    "PublisherStats",
    "ZmqEventPublisher",
]


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
        handoff_backlog: int = 256,
        encoding: Literal["map", "array"] = "map",
        curve_secret_key_file: str | None = None,
        curve_secret_key: str | None = None,
        curve_allowed_keys: list[str] | None = None,
        curve_allowed_keys_dir: str | None = None,
        snapshot: bool | None = None,
        snapshot_max_blocks: int | None = None,
    ) -> None:
        self._rank = resolve_publisher_rank(attn_dp_rank, data_parallel_rank)
        for name, value, low in (
            ("buffer_steps", buffer_steps, 1),
            ("hwm", hwm, 0),
            ("max_queue_size", max_queue_size, 1),
            ("handoff_backlog", handoff_backlog, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"ZmqEventPublisher {name}={value!r} must be an int >= {low}")
        if encoding not in ("map", "array"):
            raise ConfigError(f"ZmqEventPublisher encoding={encoding!r} must be 'map' or 'array'")
        max_blocks = (
            DEFAULT_SNAPSHOT_MAX_BLOCKS if snapshot_max_blocks is None else snapshot_max_blocks
        )
        if snapshot is None:
            snapshot = snapshot_max_blocks is not None
        if snapshot and replay_endpoint is None:
            raise ConfigError(
                "ZmqEventPublisher snapshot=True needs a replay_endpoint: snapshots are "
                "served on the replay socket"
            )
        if not isinstance(max_blocks, int) or max_blocks < 1:
            raise ConfigError(
                f"ZmqEventPublisher snapshot_max_blocks={snapshot_max_blocks!r} must be an int >= 1"
            )
        live = Endpoint.parse(endpoint).for_rank(self._rank)
        replay = (
            None
            if replay_endpoint is None
            else Endpoint.parse(replay_endpoint).for_rank(self._rank)
        )
        self._topic = topic.encode()
        self._shutdown_timeout = (
            self.SHUTDOWN_TIMEOUT if shutdown_timeout is None else shutdown_timeout
        )
        encoder: Callable[[KVEventBatch], bytes] = (
            msgspec.msgpack.Encoder().encode if encoding == "map" else _encode_array
        )
        context = context if context is not None else zmq.Context.instance()
        self._curve = CurveServer.configured(
            context,
            self._rank,
            curve_secret_key_file=curve_secret_key_file,
            curve_secret_key=curve_secret_key,
            curve_allowed_keys=curve_allowed_keys,
            curve_allowed_keys_dir=curve_allowed_keys_dir,
        )

        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, hwm)
        router = None
        buffer: ReplayBuffer | None = None
        self._replay: ReplayServer | None = None
        self._blocks = BlockState(max_blocks) if snapshot else None
        try:
            if self._curve is not None:
                self._curve.secure(pub, "live")
            self._endpoint = open_socket(
                pub, live, live.should_bind if bind is None else bind, self._rank, "live"
            )
            self._replay_endpoint: str | None = None
            if replay is not None:
                router = context.socket(zmq.ROUTER)
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                # Room for two whole answers per client: ZMQ acknowledges reads lazily, so a
                # pipe sized for one answer can refuse a client that is reading fine.
                answer = buffer_steps + 1
                if snapshot:  # a snapshot's parts: a block copied to another tier counts twice
                    answer = max(answer, 2 * -(-max_blocks // PART_BLOCKS) + 3)
                router.setsockopt(zmq.SNDHWM, 2 * answer)
                if self._curve is not None:
                    self._curve.secure(router, "replay")
                self._replay_endpoint = open_socket(router, replay, True, self._rank, "replay")
                buffer = ReplayBuffer(buffer_steps)
                self._replay = ReplayServer(
                    router,
                    buffer,
                    self._topic,
                    context,
                    name=f"kvevents-replay-{self._rank}",
                    snapshot=self._blocks,
                    encode=encoder,
                    rank=self._rank,
                )
        except BaseException:
            pub.close(linger=0)
            if router is not None:
                router.close(linger=0)
            if self._curve is not None:
                self._curve.close()
            raise
        self._send_queue = SendQueue(
            pub,
            topic=self._topic,
            encode=encoder,
            buffer=buffer,
            max_size=max_queue_size,
            handoff_backlog=handoff_backlog,
            name=f"kvevents-publisher-{self._rank}",
            state=self._blocks,
        )
        self._lifecycle_lock = threading.Lock()
        self._state = PublisherState.RUNNING
        self._accepting = True  # publish()'s one-attribute view of the state
        self._put = self._send_queue.put
        self._unsent = 0
        if self._replay is not None:
            self._replay.start()
        if self._curve is not None:
            self._curve.start()

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
    def curve_public_key(self) -> str | None:
        """The publisher's CURVE public key (what subscribers need), or None: no CURVE."""
        return None if self._curve is None else self._curve.public_key

    @property
    def snapshot_enabled(self) -> bool:
        """Whether the replay socket answers snapshot requests with the rank's block set."""
        return self._blocks is not None

    @property
    def topic(self) -> str:
        return self._topic.decode()

    @property
    def state(self) -> PublisherState:
        return self._state

    @property
    def stats(self) -> PublisherStats:
        replay, sending = self._replay, self._send_queue
        # Once closed, whatever is still queued is unsent for good: the batches the close
        # left, and one a publish() racing the shutdown queued after it (counted nowhere).
        left = sending.queued()
        closed = self._state is PublisherState.CLOSED
        return PublisherStats(
            published=sending.published,
            dropped=sending.dropped,
            send_errors=sending.send_errors,
            encode_errors=sending.encode_errors,
            replay_requests=replay.requests if replay else 0,
            replayed=replay.replayed if replay else 0,
            replay_truncated=replay.truncated if replay else 0,
            malformed_requests=replay.malformed if replay else 0,
            handoffs=sending.handoffs,
            queued=0 if closed else left,
            unsent=left if closed else self._unsent,
            curve_handshakes=self._curve.handshakes if self._curve else 0,
            curve_refused=self._curve.refused if self._curve else 0,
            snapshots=replay.snapshots if replay else 0,
            snapshots_unavailable=replay.snapshots_unavailable if replay else 0,
            snapshot_blocks=self._blocks.blocks if self._blocks else 0,
        )

    def publish(self, events: KVEventBatch) -> None:
        """Queue one batch (filling its rank when unset); drop and count it when the queue is full."""
        if not self._accepting:
            raise PublisherStateError(
                f"publisher rank {self._rank} is {self._state.value}: publish() before shutdown()"
            )
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._rank
        self._put(events)
        if self._state is not PublisherState.RUNNING and not self._send_queue.sending:
            # a shutdown ran meanwhile and its sender is gone: this batch is never sent
            raise PublisherStateError(
                f"publisher rank {self._rank} closed while this batch was published; it "
                "counts as unsent"
            )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every batch accepted before this call is sent; False if ``timeout`` passed first."""
        return self._send_queue.flush(timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """Send what was accepted (up to ``timeout`` seconds, default ``shutdown_timeout``), then close."""
        with self._lifecycle_lock:
            if self._state is not PublisherState.RUNNING:
                return
            self._state = PublisherState.DRAINING
            self._accepting = False
        deadline = time.monotonic() + (self._shutdown_timeout if timeout is None else timeout)
        self._unsent = self._send_queue.close(deadline)
        if self._replay is not None:
            self._replay.stop(timeout=1.0)
        if self._curve is not None:
            self._curve.close()
        self._state = PublisherState.CLOSED


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
        for key in [
            k for k, v in settings.items() if k.startswith(("curve_", "snapshot")) and v is None
        ]:
            settings.pop(
                key
            )  # a registered publisher without CURVE or snapshots need not know the keys
        if context is not None and ctor is ZmqEventPublisher:
            settings["context"] = context
        return ctor(attn_dp_rank=rank, **settings)
