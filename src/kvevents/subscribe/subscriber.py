"""Subscriber: every rank's stream of every engine, in order, nothing missed silently.

A router's loop, against a publisher on ports the OS picked (with engines, give their
URLs instead: ``Subscriber(engines=["http://127.0.0.1:30000"])``):

>>> import time
>>> from kvevents import (BlockStored, Delivery, Holder, KVEventBatch, PrefixIndex, Reset,
...                       StreamSpec, Subscriber, ZmqEventPublisher)
>>> pub = ZmqEventPublisher(
...     endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True)
>>> pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
...     block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(32)),
...     block_size=16, lora_id=None, medium=None)]))
>>> index = PrefixIndex()
>>> spec = StreamSpec.from_endpoint(pub.endpoint, replay_endpoint=pub.replay_endpoint, worker="a")
>>> with Subscriber(streams=[spec]) as sub:
...     while (item := sub.get(timeout=5)) is not None:  # None: nothing for 5 s
...         if isinstance(item, Delivery):
...             index.apply(item.holder, item.batch)
...             break
...         elif isinstance(item, Reset):  # the engine restarted: forget what it held
...             index.clear_holder(item.holder)
>>> index.match(list(range(40))).by_holder()[Holder("a", 0)].gpu
2
>>> pub.shutdown()

Streams come from engines (``/server_info``, retried with backoff and read again every
``rediscover_interval``) and from explicit :class:`~kvevents.subscribe.discovery.StreamSpec`
values, one per holder. Items are :class:`~kvevents.subscribe.items.Delivery` values in seq
order per holder, or the signals of :mod:`kvevents.subscribe.items`.

Guarantees, per stream: each seq is delivered at most once, in increasing order; a seq
never delivered is covered by a ``Loss``; a gap is replayed (with a replay endpoint) and
delivered before anything newer; a restarted publisher gives ``Reset`` first. A batch a
SUB missed while it was not yet listening (pods start in any order; ZMQ's slow joiner)
reaches nobody live and leaves no gap to notice, so a stream asks its replay socket for
what follows its last seq whenever its connection comes up and while it is quiet
(``tail_probe``, ``idle_check``). Past the replay buffer, a publisher that advertises
snapshots is asked for the rank's whole state (``Resync``); from any other, what replay
no longer holds is a ``Loss``. Without a replay endpoint a missed lone batch goes
unnoticed until a later one arrives. Restart detection's limits: :mod:`kvevents.subscribe.stream`.

A consumer behind by ``max_buffered`` items pauses the socket thread; ZMQ's high-water
marks then drop live messages, which come back through replay: memory stays bounded.

Threads: one socket thread (:mod:`kvevents.subscribe.loop`) and one discovery thread per
engine (:mod:`kvevents.subscribe.engine_watcher`). Consume from one thread or one asyncio
task at a time; from asyncio, close with ``await sub.aclose()``.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from types import TracebackType

import msgspec
import zmq

from kvevents.errors import SubscriberStateError
from kvevents.http.auth import ClientCredentials
from kvevents.subscribe.discovery import StreamSpec, normalize_engine_url
from kvevents.subscribe.engine_watcher import EngineStatus, EngineWatcher
from kvevents.subscribe.handoff import Handoff, HandoffClosed
from kvevents.subscribe.items import Item
from kvevents.subscribe.loop import Command, SubscriberLoop
from kvevents.subscribe.stats import StreamStats
from kvevents.transport.curve_keys import CurveKeyPair, parse_public_key
from kvevents.types import Holder

__all__ = ["DEFAULT_MAX_MESSAGE_SIZE", "EngineStatus", "Subscriber", "SubscriberState"]


DEFAULT_MAX_MESSAGE_SIZE = 64 << 20
"""The default largest live or replay frame a :class:`Subscriber` accepts: 64 MiB."""


class SubscriberState(enum.Enum):
    RUNNING = "running"
    CLOSED = "closed"


class Subscriber:
    """Follow streams of engines and explicit endpoints; see the module docstring.

    Parameters:

    * ``engines``: engine URLs (each one's worker name is its URL); ``streams``: specs or
      endpoint strings (a bare string means no replay, rank 0).
    * ``replay_timeout``: seconds without a replay reply before the rest of that replay
      counts as lost (asked again, at most twice, when it stopped midway).
    * ``tail_probe``: seconds of quiet after which a stream with a replay endpoint asks
      for anything it may have missed (the end of a burst, a batch published while it
      connected); ``idle_check``: seconds between further asks while it stays quiet,
      each one round trip to the publisher's replay socket (None: never; with
      ``tail_probe`` None too, a quiet stream never asks). A stream also asks each time
      its connection is established, whatever these are.
    * ``rcvhwm``: live receive high-water mark per stream (0: unlimited).
    * ``max_buffered``: items waiting for the consumer before the socket thread pauses.
    * ``max_pending``: live messages buffered per stream while a replay runs.
    * ``max_message_size``: the largest frame, in bytes, a live or replay socket accepts
      (ZMQ's ``MAXMSGSIZE``; default 64 MiB, -1: no limit). A larger frame makes ZMQ drop
      that connection before the frame is buffered; the subscriber reconnects, and the
      frame's seq is reported as a :class:`~kvevents.subscribe.items.Loss` once replay
      fails to bring it (replay sockets have the same limit).
    * ``discovery_timeout``: seconds per ``/server_info`` request; ``retry_initial`` and
      ``retry_max``: the backoff between discovery attempts, ``retry_max`` also caps
      ZMQ's reconnect interval.
    * ``rediscover_interval``: seconds between rereads of a discovered engine's
      ``/server_info``, to follow it to new endpoints after a whole restart (None:
      discover once).
    * ``resume``: per holder, the seq up to which the consumer already holds the
      stream's effect (an index restored from a peer's snapshot, ``applied_seqs``): that
      holder's stream, when it is added, continues from there instead of from its start
      (see :meth:`kvevents.subscribe.stream.StreamTracker.start`). Used once per holder;
      a stream replaced later (the engine moved) starts over; -1 holds state but no
      batch (from the start). A resumed holder of a discovered engine that its discovery
      does not list is dropped with a ``Removed`` signal.
    * ``http_credentials``: the API key discovery requests carry and the CA bundle
      ``https://`` engines are verified against (:class:`~kvevents.http.auth.ClientCredentials`;
      default: no key, the default trust store).
    * ``curve_key_pair``: this subscriber's CURVE key pair
      (:meth:`kvevents.CurveKeyPair.load` of a ``kvevents keygen`` secret key file), used
      on every stream that has a server key; ``curve_server_key``: the publishers' public
      key for streams that bring none of their own (an engine that advertises its key in
      ``/server_info`` needs none here). Streams without a server key connect in the
      clear, as SGLang's and vLLM's publish. A refused handshake shows as the status
      ``refused`` with ``handshake_error`` in :meth:`stats`, and as an ``Unreachable``.
    * ``context``: a ZMQ context to use (not terminated here); ``clock``: monotonic
      seconds, for tests.
    """

    def __init__(
        self,
        engines: Iterable[str] = (),
        streams: Iterable[StreamSpec | str] = (),
        *,
        replay_timeout: float = 2.0,
        tail_probe: float | None = 1.0,
        idle_check: float | None = 5.0,
        rcvhwm: int = 100_000,
        max_buffered: int = 100_000,
        max_pending: int = 50_000,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        discovery_timeout: float = 2.0,
        retry_initial: float = 0.25,
        retry_max: float = 5.0,
        rediscover_interval: float | None = 5.0,
        resume: Mapping[Holder, int] | None = None,
        http_credentials: ClientCredentials | None = None,
        curve_key_pair: CurveKeyPair | None = None,
        curve_server_key: str | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if curve_server_key is not None:
            curve_server_key = parse_public_key(curve_server_key, "Subscriber: curve_server_key")
        if curve_key_pair is not None and not isinstance(curve_key_pair, CurveKeyPair):
            raise TypeError(
                f"Subscriber: curve_key_pair must be a CurveKeyPair, not "
                f"{type(curve_key_pair).__name__}: load one with CurveKeyPair.load(path, ...)"
            )
        for name, value in (
            ("replay_timeout", replay_timeout),
            ("discovery_timeout", discovery_timeout),
            ("retry_initial", retry_initial),
            ("retry_max", retry_max),
        ):
            if not value > 0:
                raise ValueError(
                    f"Subscriber: {name}={value!r} must be a positive number of seconds"
                )
        for name, quiet in (("tail_probe", tail_probe), ("idle_check", idle_check)):
            if quiet is not None and not quiet > 0:
                raise ValueError(
                    f"Subscriber: {name}={quiet!r} must be a positive number of seconds, "
                    "or None to turn it off"
                )
        if max_message_size != -1 and not max_message_size > 0:
            raise ValueError(
                f"Subscriber: max_message_size={max_message_size!r} must be a positive number "
                "of bytes, or -1 for no limit"
            )
        if rediscover_interval is not None and not rediscover_interval > 0:
            raise ValueError(
                f"Subscriber: rediscover_interval={rediscover_interval!r} must be a positive "
                "number of seconds, or None to discover each engine once"
            )
        self.rediscover_interval = rediscover_interval
        self.discovery_timeout = discovery_timeout
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.http_credentials = http_credentials or ClientCredentials()
        self._clock = clock
        self._own_context = context is None
        self._context = zmq.Context() if context is None else context
        self._handoff: Handoff[Item] = Handoff(max_buffered)
        self._loop = SubscriberLoop(
            self._handoff,
            context=self._context,
            replay_timeout=replay_timeout,
            rcvhwm=rcvhwm,
            max_pending=max_pending,
            max_message_size=max_message_size,
            reconnect_max_ms=int(retry_max * 1000),
            tail_probe=tail_probe,
            idle_check=idle_check,
            curve_key_pair=curve_key_pair,
            curve_server_key=curve_server_key,
            clock=clock,
        )
        self._lock = threading.Lock()
        self._specs: dict[Holder, StreamSpec] = {}
        self._resume = {Holder(*h): seq for h, seq in (resume or {}).items()}
        self._engines: dict[str, EngineWatcher] = {}
        self._closing = threading.Event()
        self.state = SubscriberState.RUNNING
        self._loop.thread.start()
        try:
            for url in engines:
                self.add_engine(url)
            for spec in streams:
                self.add_stream(spec)
        except BaseException:
            self.close()
            raise

    # --- adding streams ------------------------------------------------------------------

    def add_engine(
        self, url: str, *, worker: str | None = None, curve_server_key: str | None = None
    ) -> None:
        """Follow every rank the engine at ``url`` advertises (discovered in the background).

        ``curve_server_key``: the engine's CURVE public key, for streams whose discovery
        document does not advertise one (an advertised key wins).
        """
        self._check_open("add_engine")
        url = normalize_engine_url(url)
        add_spec, replace_spec = self._add_spec, self._replace_spec
        if curve_server_key is not None:
            key = parse_public_key(
                curve_server_key, f"Subscriber.add_engine({url}): curve_server_key"
            )

            def keyed(spec: StreamSpec) -> StreamSpec:
                if spec.curve_server_key is not None:
                    return spec
                return msgspec.structs.replace(spec, curve_server_key=key)

            def add_spec(spec: StreamSpec) -> None:
                self._add_spec(keyed(spec))

            def replace_spec(spec: StreamSpec) -> None:
                self._replace_spec(keyed(spec))

        with self._lock:
            if url in self._engines:
                raise ValueError(f"Subscriber.add_engine: {url} is already followed")
            watcher = EngineWatcher(
                url,
                worker or url,
                timeout=self.discovery_timeout,
                retry_initial=self.retry_initial,
                retry_max=self.retry_max,
                closing=self._closing,
                add_spec=add_spec,
                report=lambda signal: self._loop.submit(Command.SIGNAL, signal),
                replace_spec=replace_spec,
                remove_holder=self._remove_spec,
                resumed_ranks=self._resumed_ranks,
                recheck=self.rediscover_interval,
                credentials=self.http_credentials,
            )
            self._engines[url] = watcher
        watcher.thread.start()

    def add_stream(self, spec: StreamSpec | str) -> None:
        """Follow one explicit stream (an endpoint string means no replay, rank 0)."""
        self._check_open("add_stream")
        if isinstance(spec, str):
            spec = StreamSpec.from_endpoint(spec)
        self._add_spec(spec)

    def _add_spec(self, spec: StreamSpec) -> None:
        holder = Holder(spec.worker, spec.dp_rank)
        with self._lock:
            if holder in self._specs and holder not in self._loop.refused:
                raise ValueError(
                    f"Subscriber: stream {holder} is already followed; give distinct workers "
                    "or dp_ranks to distinct endpoints"
                )
            self._specs[holder] = spec
            after = self._resume.pop(holder, None)
        self._loop.submit(Command.ADD, (spec, after))

    def _remove_spec(self, holder: Holder, reason: str) -> None:
        """Stop following ``holder``'s stream (its engine no longer has the rank)."""
        with self._lock:
            self._specs.pop(holder, None)
            self._resume.pop(holder, None)
        self._loop.submit(Command.REMOVE, (holder, reason))

    def _resumed_ranks(self, worker: str) -> list[int]:
        """Ranks of ``worker`` the consumer holds state for (``resume``) and that are not
        followed: once discovery has added the engine's ranks, ones it does not have."""
        with self._lock:
            return [h.dp_rank for h in self._resume if h.worker == worker]

    def _replace_spec(self, spec: StreamSpec) -> None:
        """Follow ``spec`` instead of the holder's current stream (the engine moved)."""
        with self._lock:
            self._specs[Holder(spec.worker, spec.dp_rank)] = spec
        self._loop.submit(Command.REPLACE, spec)

    # --- consuming -----------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> Item | None:
        """The next item, or None after ``timeout`` seconds; raises once closed."""
        try:
            return self._handoff.get(timeout)
        except HandoffClosed as exc:
            raise self._closed_error(exc) from exc.error

    async def aget(self, timeout: float | None = None) -> Item | None:
        """Like :meth:`get`, for asyncio."""
        try:
            return await self._handoff.aget(timeout)
        except HandoffClosed as exc:
            raise self._closed_error(exc) from exc.error

    def __iter__(self) -> Iterator[Item]:
        """Every item until :meth:`close` (called from another thread) ends the iteration."""
        self._check_open("iterate")
        while True:
            try:
                item = self._handoff.get()
            except HandoffClosed as exc:
                if exc.error is not None:
                    raise self._closed_error(exc) from exc.error
                return
            if item is not None:
                yield item

    def __aiter__(self) -> AsyncIterator[Item]:
        self._check_open("iterate")
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[Item]:
        while True:
            try:
                item = await self._handoff.aget()
            except HandoffClosed as exc:
                if exc.error is not None:
                    raise self._closed_error(exc) from exc.error
                return
            if item is not None:
                yield item

    # --- state ---------------------------------------------------------------------------

    def stats(self) -> dict[Holder, StreamStats]:
        """A snapshot of every stream's statistics (streams just added show "connecting")."""
        out = {Holder(s.worker, s.dp_rank): s for s in self._loop.snapshot(self._clock())}
        with self._lock:
            waiting = [(h, spec) for h, spec in self._specs.items() if h not in out]
        for holder, spec in waiting:
            out[holder] = StreamStats.empty(
                spec.worker, spec.dp_rank, spec.endpoint, spec.replay_endpoint
            )
        return out

    def engines(self) -> dict[str, EngineStatus]:
        """Discovery state of every engine URL followed."""
        with self._lock:
            watchers = list(self._engines.values())
        return {w.url: w.status() for w in watchers}

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads and close every socket. Idempotent."""
        with self._lock:
            if self.state is SubscriberState.CLOSED:
                return
            self.state = SubscriberState.CLOSED
            watchers = list(self._engines.values())
        self._closing.set()
        self._loop.submit(Command.STOP)
        self._handoff.close()
        self._loop.thread.join(timeout)
        for w in watchers:
            w.thread.join(timeout)
        if self._own_context and not self._loop.thread.is_alive():
            self._context.term()

    async def aclose(self, timeout: float = 5.0) -> None:
        """:meth:`close` for asyncio: the threads are joined in a worker thread, so the
        event loop keeps running other tasks meanwhile. Idempotent."""
        if self.state is SubscriberState.CLOSED:
            return
        await asyncio.to_thread(self.close, timeout)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Subscriber:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _check_open(self, what: str) -> None:
        if self.state is SubscriberState.CLOSED:
            raise SubscriberStateError(
                f"Subscriber.{what}: the subscriber is closed; create a new one"
            )

    def _closed_error(self, exc: HandoffClosed) -> SubscriberStateError:
        if exc.error is not None:
            return SubscriberStateError(f"the subscriber's socket thread failed: {exc.error!r}")
        return SubscriberStateError("the subscriber is closed")
