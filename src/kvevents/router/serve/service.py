"""The router as a service: :class:`RouterService` owns what feeds the router.

It holds the in-process :class:`~kvevents.router.decide.router.Router`, the subscriber
that follows every engine's streams into its index, the engine pollers, the tokenizer
and the one HTTP client for the engines (:class:`~kvevents.http.upstream.Upstream`:
relays, load polls, registration, models, P/D bootstrap ports), which sends the
router's own engine key (``--engine-api-key``) on every request and never a client's.
The routes that answer over HTTP are :mod:`kvevents.router.serve.app` and
:mod:`kvevents.router.serve.openai`; both import this module, and it imports neither. It
also runs start-up's deferred work once the server serves (:meth:`RouterService.defer`:
the index's native mirror, then the FastAPI app). Start, stop and deferred work are one
lifecycle, kept in one module.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from kvevents import kernels
from kvevents.errors import KVEventsError, SubscriberStateError
from kvevents.http.auth import ClientCredentials
from kvevents.http.inline import HttpLimits
from kvevents.http.upstream import DEFAULT_HEAD_TIMEOUT_S, DEFAULT_MAX_HEAD_BYTES, Upstream
from kvevents.http.upstream_errors import MidwayError, UpstreamError
from kvevents.kernels import native
from kvevents.router.decide.router import POLICIES, Policy, Router
from kvevents.router.fleet.engines import MODELS_RECHECK_S, EngineState, watch_engine
from kvevents.router.fleet.peers import LoadNotes, SyncTransport
from kvevents.router.fleet.warm_start import WarmStart
from kvevents.router.prompts.token_body import (
    DEFAULT_TOP,
    BadRequest,
    TokensBody,
    decode_tokens_body,
)
from kvevents.router.prompts.tokenize import (
    ByteTextTokenizer,
    ChatError,
    EndpointTokenizer,
    TextTokenizer,
    TokenizeError,
)
from kvevents.router.serve.group_metrics import GroupMetrics
from kvevents.router.serve.group_readiness import GroupReadiness
from kvevents.router.serve.metrics import make_registry, render
from kvevents.router.serve.pd_mode import PDMode
from kvevents.router.serve.pd_stats import PDCollector
from kvevents.router.serve.request_stats import RequestStats
from kvevents.subscribe.engine_spec import EngineSpec
from kvevents.subscribe.subscriber import Subscriber
from kvevents.types import Holder

FORWARD_ERRORS = (UpstreamError, TimeoutError)
"""What forwarding to an engine raises when the engine cannot be reached or answer in time."""


def gateway_status(exc: BaseException) -> tuple[int, str]:
    """The status and error type a client gets for a forward that failed with ``exc``:
    504 ``gateway_timeout`` when a deadline passed, else 502 ``bad_gateway``."""
    cause = exc.cause if isinstance(exc, MidwayError) else exc
    if isinstance(cause, TimeoutError):
        return 504, "gateway_timeout"
    return 502, "bad_gateway"


APPLY_STEP_BLOCKS = 256
"""Blocks of a long stored or removed chain applied between two checks of the clock."""
APPLY_SLICE_S = 0.0005
"""Seconds of applying events after which the loop answers waiting requests. A batch of
an engine serving long prompts holds thousands of block operations (``kvevents bench
ingest`` feeds such batches), and a request arriving while it is applied in one piece
would wait for all of it."""
_JSON_BODY = {"content-type": "application/json"}

__all__ = [
    "DEFAULT_TOP",
    "FORWARD_ERRORS",
    "BadRequest",
    "RouterService",
    "TokenizeFailed",
    "TokensBody",
    "gateway_status",
]

log = logging.getLogger("kvevents.router")


class TokenizeFailed(KVEventsError):
    """Tokenizing failed (the engine's /tokenize is down, or refused); answered with ``status``."""

    def __init__(self, error: TokenizeError) -> None:
        super().__init__(str(error))
        self.status = error.status


FIRST_POLL_WAIT_S = 2.0
"""The longest :meth:`RouterService.start` waits for every engine's first poll (its
ranks, block size, load and models) before the server says it is serving."""

DEFERRED_AFTER_S = 2.0
"""The longest the work deferred past start-up waits for the server to say it is
serving (an app embedded without :meth:`RouterService.serving`) before it runs anyway."""


async def _run_deferred(
    service: RouterService, work: list[Callable[[], Awaitable[object]]]
) -> None:
    """Start-up's deferred work, once the server accepts requests; then settle the heap.

    The index's mirror for the native match is built first (a warm-started index's
    blocks copied once, not on the first request), then whatever was deferred with
    :meth:`RouterService.defer` (the router's FastAPI app). Done at start, that work
    would compete with the HTTP server's start and a warm start's catch-up with the
    streams; requests take the plain path meanwhile. Then every object alive so far
    (the imports, the app) moves out of the garbage collector's sight
    (``gc.freeze``): a full collection then walks only what requests and the index
    create, instead of pausing the hot path for the 100,000-odd objects of start-up.
    """
    await service.until_serving(DEFERRED_AFTER_S)
    service.router.index.sync_mirror()  # a warm-started index: not on the first request
    for item in work:
        try:
            await item()
        except Exception:  # the first request that needs it tries again, and says why
            log.exception("work deferred past the router's start-up failed")
    gc.collect()
    gc.freeze()
    service.settled = True


class RouterService:
    """The router plus what feeds it: the subscriber, the engine pollers, the engine client.

    ``engines``: URLs (discovered) or :class:`~kvevents.subscribe.engine_spec.EngineSpec` values.
    The subscriber is the caller's (``build_service`` adds every spec's streams to it).
    ``upstream``: the client that forwards requests to engines (default: one :meth:`start`
    opens with the engine credentials; a benchmark passes one that answers in process).
    """

    def __init__(
        self,
        router: Router,
        engines: Sequence[str | EngineSpec],
        *,
        subscriber: Subscriber | None = None,
        load_interval: float = 0.5,
        forward_timeout: float = 600.0,
        tokenizer: TextTokenizer | None = None,
        policy: Policy = "kv-aware",
        engine_credentials: ClientCredentials | None = None,
        models_interval: float = MODELS_RECHECK_S,
        upstream: Upstream | None = None,
        engine_max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
        engine_head_timeout: float = DEFAULT_HEAD_TIMEOUT_S,
        pd: PDMode | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.router = router
        specs = [e if isinstance(e, EngineSpec) else EngineSpec.create(e) for e in engines]
        self.states = {s.worker: EngineState(s) for s in specs}
        for spec in specs:  # before any event is handled: configured sizes come first
            if spec.block_size is None:
                continue
            origin = f"--block-size of engine {spec.worker}"
            if spec.described:
                for stream in spec.streams():
                    router.add_holder(
                        Holder(stream.worker, stream.dp_rank),
                        block_size=spec.block_size,
                        source="configured",
                        origin=origin,
                    )
            else:
                router.declare_block_size(
                    Holder(spec.worker, 0), spec.block_size, source="configured", origin=origin
                )
        self.engines = [s.url for s in specs]
        self.workers = frozenset(s.worker for s in specs)
        """The engines this router follows, as holders name them (a load note about
        another is not this router's: :class:`~kvevents.router.fleet.peers.LoadNotes`)."""
        self.subscriber = subscriber
        self.load_interval = load_interval
        self.models_interval = models_interval
        """Seconds between two reads of an engine's models (:mod:`kvevents.router.fleet.engines`)."""
        self.forward_timeout = forward_timeout
        self.engine_max_head_bytes = engine_max_head_bytes
        self.engine_head_timeout = engine_head_timeout
        """Bounds on an engine answer's head (:class:`~kvevents.http.upstream.Upstream`)."""
        self.http_limits = HttpLimits()
        """Bounds on this router's slow and idle clients (``--request-timeout``,
        ``--max-idle-connections``), for the server that serves it."""
        self.text_tokenizer: TextTokenizer = tokenizer or ByteTextTokenizer()
        self.policy = policy
        self.engine_credentials = engine_credentials or ClientCredentials()
        """The key the router sends every engine request with (never the client's), and the
        CA bundle ``https://`` engines are verified against."""
        self.requests = RequestStats()
        self.registry = make_registry(router, self._stream_stats, self.requests, self.process_info)
        self.pd = pd
        """Disaggregated prefill/decode serving (``--prefill``/``--decode``), or None."""
        if pd is not None:
            self.registry.register(PDCollector(pd.stats))
        self.process_index = 0
        """Which of ``process_count`` router processes this is (``--workers``)."""
        self.process_count = 1
        self.peers: LoadNotes | None = None
        """Load notes to and from the other processes and routers, when there are any."""
        self.group_metrics: GroupMetrics | None = None
        """The group's metrics when this is one of several processes (``--workers``)."""
        self.group_readiness: GroupReadiness | None = None
        """The group's readiness files then (``/ready`` answers for the group)."""
        self.sync: SyncTransport | None = None
        """The NATS transport of those notes (``--sync``), for ``/workers`` and ``/metrics``."""
        self.warm_start: WarmStart | None = None
        """How the index started when peers were given (``--peer``)."""
        self._upstream: Upstream | None = upstream
        """The client that forwards requests (``upstream``, else one :meth:`start` opens)."""
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self.applying = asyncio.Lock()
        """Held while an item is applied (in steps, the loop free between them): the
        index is whole only outside it (``/dump`` takes it to copy the index)."""
        self._serving = asyncio.Event()
        self._deferred: list[Callable[[], Awaitable[object]]] = []
        self.settled = False
        """True once start-up's deferred work is done and the heap frozen (``/workers``)."""

    def metrics_text(self) -> bytes:
        """``/metrics``: this process's registry, or its group's (``--workers``)."""
        if self.group_metrics is not None:
            return self.group_metrics.render()
        return render(self.registry)

    def spec(self, worker: str) -> EngineSpec:
        """The engine a holder's worker name belongs to."""
        state = self.states.get(worker)
        if state is not None:
            return state.spec
        return EngineSpec.create(worker)  # a holder learned from events of an unknown worker

    @property
    def upstream(self) -> Upstream:
        """The client that forwards requests to engines (see :meth:`start`)."""
        if self._upstream is None:
            raise RuntimeError(
                "RouterService.start() has not run: the forwarding client is not open"
            )
        return self._upstream

    def process_info(self) -> dict[str, Any]:
        """Which process answers, and its load notes (``/workers``, ``/metrics``)."""
        peers = self.peers
        return {
            "index": self.process_index,
            "workers": self.process_count,
            "pid": os.getpid(),
            "notes": None if peers is None else peers.summary(),
            "sync": None if self.sync is None else self.sync.status(),
            "kernels": kernels.status(),
            "native": {
                "status": native.status(),
                "built": native.built(),
                "loaded": native.status() == "loaded",
                "calls": kernels.calls(),
                "answered": self.router.native.answered,
                "chosen": self.router.native.chosen,
                "failures": self.router.native.failures,
            },
            "settled": self.settled,
        }

    def _stream_stats(self) -> dict[Holder, Any]:
        return {} if self.subscriber is None else dict(self.subscriber.stats())

    def serving(self) -> None:
        """Called by the server once it accepts requests: start-up's deferred work begins."""
        self._serving.set()

    def defer(self, work: Callable[[], Awaitable[object]]) -> None:
        """Run ``work`` once the server serves, after the mirror is built (see :meth:`start`)."""
        self._deferred.append(work)

    async def until_serving(self, timeout: float) -> None:
        """Return once :meth:`serving` has been called, or after ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._serving.wait(), timeout)

    async def start(self) -> None:
        """Open the engine client, start the consumer and one poller per engine, and return
        once every engine's first poll is done (at most :data:`FIRST_POLL_WAIT_S` seconds)."""
        self._tasks.append(asyncio.create_task(_run_deferred(self, self._deferred)))
        # Every request to an engine (forwarding, on every routed request, the load polls,
        # registration, models, the P/D bootstrap ports) goes through the router's own
        # client (kvevents.http.upstream, far cheaper per request than a general-purpose
        # client), with the engine key and the TLS context of --ssl-ca-certs. Idle
        # connections close after 2 s, before the engine's (uvicorn: 5 s) keep-alive
        # timeout, so a request never goes out on a connection the server is closing.
        # Bodies are relayed as they come (no decoding).
        creds = self.engine_credentials
        if self._upstream is None:
            self._upstream = Upstream(
                timeout=self.forward_timeout,
                connect_timeout=5.0,
                headers=creds.headers(),
                tls=creds.verify(),
                max_head_bytes=self.engine_max_head_bytes,
                head_timeout=self.engine_head_timeout,
            )
        if (
            isinstance(self.text_tokenizer, EndpointTokenizer)
            and self.text_tokenizer.upstream is None
        ):
            self.text_tokenizer.upstream = self._upstream
        if self.subscriber is not None:
            self._tasks.append(asyncio.create_task(self._consume(self.subscriber)))
        for state in self.states.values():
            self._tasks.append(
                asyncio.create_task(
                    watch_engine(
                        self.router,
                        state,
                        self.upstream,
                        self.load_interval,
                        self._stopping,
                        self.models_interval,
                    )
                )
            )
        if self.pd is not None:  # the engines' roles and the prefills' bootstrap ports
            self._tasks.append(asyncio.create_task(self.pd.watch(self.upstream, self._stopping)))
        # Serving before an engine's first poll answered would refuse /query (no block
        # size yet) and route without its models or load: wait for it, bounded, since an
        # engine that is down fails its poll at once and one that hangs must not hold the
        # router back. The subscriber discovers the same engines meanwhile, on its own.
        first_polls = [state.first_poll.wait() for state in self.states.values()]
        if first_polls:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*first_polls), FIRST_POLL_WAIT_S)

    async def stop(self) -> None:
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.pd is not None:
            await self.pd.close()
        if self._upstream is not None:
            await self._upstream.close()
        if self.subscriber is not None:
            await asyncio.to_thread(self.subscriber.close)

    async def _consume(self, subscriber: Subscriber) -> None:
        """Apply the subscriber's items, giving the loop a turn every
        :data:`APPLY_SLICE_S` of work: between items and inside long batches."""
        handle_steps, clock = self.router.handle_steps, time.perf_counter
        since = clock()
        while not self._stopping.is_set():
            try:
                item = await subscriber.aget(timeout=0.5)  # returns at once when items wait
            except SubscriberStateError:
                return
            if item is None:
                continue
            async with self.applying:
                for _ in handle_steps(item, APPLY_STEP_BLOCKS):
                    if clock() - since >= APPLY_SLICE_S:
                        await asyncio.sleep(0)
                        since = clock()
            if clock() - since >= APPLY_SLICE_S:
                await asyncio.sleep(0)
                since = clock()

    async def tokens(self, raw: bytes, *, chat: bool = True) -> tuple[Sequence[int], TokensBody]:
        """The body's token ids (tokenizing text or a chat) and the body; ``chat=False``
        is an engine's ``/generate`` body: ``messages`` refused (it takes no chat), and
        members the router does not know are the engine's, not refused."""
        tokens, body = decode_tokens_body(raw, chat=chat, strict=chat)
        if tokens is not None:
            return tokens, body
        try:
            if body.text is not None:
                return await self.text_tokenizer.encode(body.text), body
            whole = msgspec.json.decode(raw)  # an object: it decoded as a TokensBody
            return await self.text_tokenizer.encode_chat(whole), body
        except ChatError as exc:
            raise BadRequest(str(exc)) from None
        except TokenizeError as exc:
            raise TokenizeFailed(exc) from None

    async def forward(self, worker: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """POST ``body`` to the engine's ``/generate``: its status and answer bytes.

        Raises :data:`FORWARD_ERRORS` when the engine cannot be reached or answer in time.
        """
        answer = await self.upstream.post(
            self.spec(worker).url, "/generate", msgspec.json.encode(body), _JSON_BODY
        )
        try:
            return answer.status, await answer.read()
        finally:
            answer.release()
