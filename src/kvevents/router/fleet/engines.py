"""What the router asks each engine over HTTP: its ranks (once), then its load or health.

One :func:`watch_engine` task per engine, until the service stops:

1. Register the engine's holders. A described engine
   (:attr:`EngineSpec.described <kvevents.subscribe.engine_spec.EngineSpec.described>`)
   has its ranks from the spec, its ``/server_info`` read once only to cross-check a
   block size; a discovered one is registered from its ``/server_info`` or a vLLM's
   ``/kv_event_sources``, retried until one answers. Block sizes are declared to the
   router, which checks them (:mod:`kvevents.subscribe.block_sizes`).
2. Every ``interval`` seconds, poll its load: ``kvevents`` engines answer ``GET /load``
   per rank; ``vllm`` and ``sglang`` engines ``GET /health`` (200: every rank available),
   and ``vllm`` engines also ``GET /metrics`` (``vllm:num_requests_running`` and
   ``_waiting`` per ``engine="r"`` label, best effort, which counts the requests other
   routers sent; :attr:`EngineState.load_source` says which applies; its
   ``vllm:cache_config_info`` declares the block size, so a restart at another is followed).
3. Read its models (:mod:`kvevents.router.decide.models`) at registration, every
   :data:`MODELS_RECHECK_S`, and when it answers again after failing; a failed read keeps
   what was known (:attr:`EngineState.models_error`) and never makes it unavailable.

Failures: a poll unanswered for the stall watch's ``engine_after_s``
(:mod:`kvevents.router.decide.stalls`) stalls the engine's ranks, since a stopped engine
still accepts connections; a read timeout after the engine accepted the request keeps
the ranks as last known for up to :data:`SLOW_POLLS_TOLERATED` polls in a row
(:attr:`EngineState.slow`), as a loaded engine is slow, not dead; any other error (a
refused connection, a 401 or 403 for a missing ``--engine-api-key``) marks the ranks
unavailable at once, is kept in :attr:`EngineState.error` and logged once. Errors never
end the task.

Every request here goes through the router's one engine client
(:class:`~kvevents.http.upstream.Upstream`, the relays' own, with their key and TLS
context): the polls run on the event loop that answers ``/route``, where a
general-purpose client's per-request cost would show, and registration and the models,
read rarely, share its kept-alive connections rather than keep a second client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families

from kvevents.errors import DiscoveryError
from kvevents.http.upstream import Upstream
from kvevents.http.upstream_answers import FullResponse
from kvevents.http.upstream_errors import MidwayError, UpstreamError
from kvevents.router.decide.models import (
    EngineModels,
    models_from_names,
    models_from_server_info,
    models_from_v1_models,
)
from kvevents.router.decide.router import Router
from kvevents.subscribe.discovery import (
    StreamSpec,
    streams_from_kv_event_sources,
    streams_from_server_info,
)
from kvevents.subscribe.engine_spec import EngineSpec
from kvevents.types import Holder

__all__ = [
    "LOAD_TIMEOUT_S",
    "MODELS_RECHECK_S",
    "SLOW_POLLS_TOLERATED",
    "EngineState",
    "LoadSource",
    "cache_config_block_size",
    "vllm_rank_loads",
    "vllm_scrape",
    "watch_engine",
]

MODELS_RECHECK_S = 10.0
"""Seconds between two reads of an engine's models while it answers."""

LOAD_TIMEOUT_S = 5.0
"""Seconds a load poll (``/load``, ``/health``) waits for the engine's answer."""

SLOW_POLLS_TOLERATED = 3
"""Load polls in a row that may time out waiting for an answer before the engine's ranks
are marked unavailable (until then they keep their last known state)."""

LoadSource = Literal["/load", "/metrics", "router"]
"""Where an engine's rank loads come from (see :attr:`EngineState.load_source`)."""

log = logging.getLogger("kvevents.router")

_VLLM_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}


@dataclass
class EngineState:
    """What the router knows of one engine (read by ``/workers``)."""

    spec: EngineSpec
    registered: bool = False
    error: str | None = None
    advertised_block_size: int | None = None
    load_source: LoadSource | None = None
    """Where the ranks' load last came from: ``/load``, ``/metrics``, or ``router``
    (this router's in-flight requests only); ``metrics_error`` says why not metrics."""
    metrics_error: str | None = None
    models: EngineModels | None = None
    """The models the engine serves, when known (see the module docstring)."""
    models_error: str | None = None
    models_read_at: float | None = None
    """Monotonic time of the last attempt to read the models."""
    slow_polls: int = 0
    """Load polls in a row that timed out waiting for the answer (0 once one answers)."""
    slow: str | None = None
    """Why the last known state is kept, while ``slow_polls`` is tolerated."""
    first_poll: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the first poll has been tried (registration, load and models; answered or
    failed): the router waits for it, bounded, before it says it is serving."""


def vllm_rank_loads(text: str) -> list[dict[str, int]]:
    """Per-rank ``{"dp_rank", "running", "waiting"}`` from vLLM's Prometheus ``/metrics``.

    ValueError when the text does not parse; an empty list when it has no vLLM gauges.
    Samples of one rank (several models) are summed; a value that is not a finite
    non-negative number is skipped.
    """
    return vllm_scrape(text)[0]


def vllm_scrape(text: str) -> tuple[list[dict[str, int]], dict[int, int]]:
    """:func:`vllm_rank_loads`, and per rank the block size its ``vllm:cache_config_info``
    states (:func:`cache_config_block_size`; ranks that state none are left out), from
    one parse of the text."""
    ranks: dict[int, dict[str, int]] = {}
    sizes: dict[int, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = _VLLM_GAUGES.get(sample.name)
            engine = sample.labels.get("engine")
            if engine is None or not engine.isdigit():
                continue
            if field is None:
                if sample.name == "vllm:cache_config_info":
                    size = cache_config_block_size(sample.labels)
                    if size is not None:
                        sizes[int(engine)] = size
                continue
            value = sample.value
            if not math.isfinite(value) or value < 0:
                continue
            entry = ranks.setdefault(
                int(engine), {"dp_rank": int(engine), "running": 0, "waiting": 0}
            )
            entry[field] += int(value)
    return [ranks[r] for r in sorted(ranks)], sizes


def cache_config_block_size(labels: Mapping[str, str]) -> int | None:
    """The block size a vLLM's ``vllm:cache_config_info`` labels state for its KV events,
    when they state it plainly: ``effective_attention_block_size`` (the size of its
    full-attention managers' blocks, context parallelism included: what ``BlockStored``
    carries), with ``hash_block_size``, ``prefix_match_unit`` and ``mamba_block_size``
    unset or equal to it. None otherwise, and when the label is missing (an older vLLM:
    its ``block_size`` label is the page size before context parallelism multiplies
    it): a wrong declaration would have the router skip every event, while none leaves
    the size to the events, as before."""
    size = labels.get("effective_attention_block_size", "")
    if not size.isdigit() or int(size) < 1:
        return None
    for other in ("hash_block_size", "prefix_match_unit", "mamba_block_size"):
        if labels.get(other, "None") not in ("None", size):
            return None
    return int(size)


def _advertised_block_size(info: Any) -> int | None:
    if not isinstance(info, dict):
        return None
    block = info.get("kv_events")
    for value in (
        block.get("block_size") if isinstance(block, dict) else None,
        info.get("page_size"),
        info.get("block_size"),
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def key_refused(request: str, status: int) -> DiscoveryError:
    """The error of an engine that refused the router's key (``request``: ``"GET URL"``)."""
    return DiscoveryError(
        f"{request} answered HTTP {status}: the engine requires an API key and refused the "
        "router's (missing or wrong); start the router with --engine-api-key (or "
        "--engine-api-key-file) holding the engine's --api-key"
    )


async def _register(
    router: Router, state: EngineState, upstream: Upstream, timeout: float = LOAD_TIMEOUT_S
) -> None:
    spec = state.spec
    configured = f"--block-size of engine {spec.worker}"
    if spec.described:
        holders = [Holder(s.worker, s.dp_rank) for s in spec.streams()]
        for h in holders:
            router.add_holder(h, block_size=spec.block_size, source="configured", origin=configured)
        state.registered = True
        try:  # best effort: only to cross-check an advertised block size
            response = await _polled(upstream, spec.url, "/server_info", timeout)
            success = 200 <= response.status < 300
            advertised = _advertised_block_size(response.json()) if success else None
        except (UpstreamError, TimeoutError, ValueError, DiscoveryError):
            advertised = None  # a refused key shows in the /load poll's error
    else:
        streams = await _discover(spec, upstream, timeout)
        holders = [Holder(s.worker, s.dp_rank) for s in streams]
        advertised = streams[0].block_size if streams else None
        for h in holders:
            router.add_holder(h, block_size=spec.block_size, source="configured", origin=configured)
        state.registered = True
    state.advertised_block_size = advertised
    if advertised is not None:
        for h in holders:
            router.add_holder(
                h, block_size=advertised, source="server_info", origin=f"/server_info of {spec.url}"
            )


async def _discover(
    spec: EngineSpec, upstream: Upstream, timeout: float = LOAD_TIMEOUT_S
) -> list[StreamSpec]:
    """The engine's streams from ``/server_info``, else (a vLLM) from ``/kv_event_sources``."""
    response = await _polled(upstream, spec.url, "/server_info", timeout)
    try:
        return streams_from_server_info(response.json(), engine_url=spec.url, worker=spec.worker)
    except (DiscoveryError, ValueError):
        sources = await _polled(upstream, spec.url, "/kv_event_sources", timeout)
        if sources.status != 200:
            raise
    return streams_from_kv_event_sources(sources.json(), engine_url=spec.url, worker=spec.worker)


async def _polled(
    upstream: Upstream,
    url: str,
    path: str,
    timeout: float,
    on_head: Callable[[], None] | None = None,
) -> FullResponse:
    """``GET url + path`` whole (:func:`key_refused` for a 401 or 403;
    ``on_head`` as :meth:`Upstream.get` takes it). An answer that began but was not
    whole within ``timeout`` is a TimeoutError (a slow engine), as one that never began is."""
    try:
        response = await upstream.get(url, path, timeout=timeout, on_head=on_head)
    except MidwayError as exc:
        if isinstance(exc.cause, TimeoutError):
            raise TimeoutError(f"GET {url}{path}: {exc}") from exc
        raise
    if response.status in (401, 403):
        raise key_refused(f"GET {url}{path}", response.status)
    return response


async def _poll_load(
    router: Router, state: EngineState, upstream: Upstream, timeout: float
) -> None:
    """One load poll of the engine, its ranks stalled while it has no answer for the stall
    watch's ``engine_after_s`` (see the module docstring)."""
    watch = router.stall_watch
    if watch is None:
        await _poll_load_once(router, state, upstream, timeout, lambda: None)
        return
    worker = state.spec.worker
    silent = asyncio.get_running_loop().call_later(
        watch.engine_after_s, router.engine_silent, worker
    )

    def heard() -> None:
        silent.cancel()
        router.engine_heard(worker)

    try:
        await _poll_load_once(router, state, upstream, timeout, heard)
    finally:
        silent.cancel()


async def _poll_load_once(
    router: Router,
    state: EngineState,
    upstream: Upstream,
    timeout: float,
    heard: Callable[[], None],
) -> None:
    """The poll itself; ``heard`` is called once the engine's first answer is in (any status)."""
    spec = state.spec
    # What had ended when the engine's answer began to arrive: it counted before it
    # answered, so a request that ended before then (its answer came first) is not in the
    # count, and one that ends while the rest of the answer comes (or waits for the poll
    # to resume) may be, though it has left the router's count (Router.update_load).
    ended: dict[int, float] = {}

    def answered() -> None:
        ended.update(router.requests_ended(spec.worker))

    if spec.engine_kind == "kvevents":
        response = await _polled(upstream, spec.url, "/load", timeout, answered)
        heard()
        if response.status != 200:
            raise DiscoveryError(f"GET {spec.url}/load answered HTTP {response.status}")
        # Each rank's availability is the engine's word for it (a dead, restarting or
        # stalled rank says available: false), so nothing here marks the worker available.
        router.update_load(spec.worker, json.loads(response.body), ended_before=ended)
        state.load_source = "/load"
        return
    response = await _polled(upstream, spec.url, "/health", timeout)
    heard()
    if response.status != 200:
        raise DiscoveryError(f"GET {spec.url}/health answered HTTP {response.status}")
    router.set_worker_available(spec.worker, True)
    if spec.engine_kind != "vllm":
        state.load_source = "router"
        return
    # Every rank's load comes from this scrape, zero for a rank it does not mention, and
    # all zero when it fails: a load read earlier must not linger as phantom work.
    # The ranks: those configured and those discovered (a vLLM given by URL alone says
    # how many it runs only through /kv_event_sources: its spec knows of rank 0).
    ranks = sorted(
        {*range(spec.ranks), *(h.dp_rank for h in router.holders() if h.worker == spec.worker)}
    )
    loads = {r: {"dp_rank": r, "running": 0, "waiting": 0} for r in ranks}
    try:
        metrics = await upstream.get(spec.url, "/metrics", timeout=5.0, on_head=answered)
        if metrics.status != 200:
            raise DiscoveryError(f"answered HTTP {metrics.status}")
        scraped, sizes = vllm_scrape(metrics.body.decode("utf-8", "replace"))
    except Exception as exc:  # foreign text, best effort: any failure is only a metrics_error
        state.metrics_error = f"GET {spec.url}/metrics: {type(exc).__name__}: {exc}"
        scraped = []
    else:
        _declare_stated_sizes(router, state, sizes, ranks)
        labels = [r["dp_rank"] for r in scraped]
        scraped = [r for r in scraped if r["dp_rank"] in loads]
        if not scraped:
            state.metrics_error = (
                f"GET {spec.url}/metrics has no vllm:num_requests_* gauges for engine "
                f"labels {ranks} (found {labels or 'none'})"
            )
    for entry in scraped:
        loads[entry["dp_rank"]] = entry
    router.update_load(spec.worker, {"ranks": list(loads.values())}, ended_before=ended)
    # Set once the poll is over, so /workers never shows a half-done poll.
    if scraped:
        state.load_source, state.metrics_error = "/metrics", None
    else:
        state.load_source = "router"


def _declare_stated_sizes(
    router: Router, state: EngineState, sizes: dict[int, int], ranks: list[int]
) -> None:
    """Declare the block size each known rank's ``vllm:cache_config_info`` states, unless
    the rank's standing declaration already says it (so a size the router does not expect
    is counted once, not on every poll): as a ``/server_info`` declaration is, it is
    checked against the router's size, and a router whose size came from the engines
    follows every rank to a new one (:mod:`kvevents.subscribe.block_sizes`)."""
    origin = f"vllm:cache_config_info of {state.spec.url}"
    declared = router.block_sizes.declared
    for rank in ranks:
        size = sizes.get(rank)
        holder = Holder(state.spec.worker, rank)
        # declared again after a reset forgot it (a restarted engine), else only on change
        if size is not None and declared.get(holder) != size:
            router.declare_block_size(holder, size, source="metrics", origin=origin)


async def read_models(spec: EngineSpec, upstream: Upstream) -> EngineModels | None:
    """The engine's models: described, else (see :mod:`kvevents.router.decide.models`) from its
    ``/v1/models`` or its ``/server_info``; a ``kvevents`` engine's from ``/server_info``
    only (one started without model flags says ``served_model_names: null``: it takes
    any model). None when it names none; :class:`~kvevents.http.upstream_errors.UpstreamError`
    or TimeoutError when none answers.
    """
    if spec.models:
        return models_from_names(spec.models)
    paths = ["/server_info"] if spec.engine_kind == "kvevents" else ["/v1/models", "/server_info"]
    failure: UpstreamError | TimeoutError | None = None
    for path in paths:
        try:
            _, body = await upstream.get_json(spec.url, path, timeout=5.0)
        except UpstreamError as exc:
            failure = exc
            continue
        except TimeoutError:
            failure = TimeoutError(f"GET {spec.url}{path}: no answer within 5 s")
            continue
        except ValueError:
            continue
        found = (
            models_from_v1_models(body) if path == "/v1/models" else models_from_server_info(body)
        )
        if found is not None:
            return found
        failure = None
    if failure is not None:
        raise failure
    return None


async def _refresh_models(
    router: Router, state: EngineState, upstream: Upstream, now: float
) -> None:
    state.models_read_at = now
    try:
        models = await read_models(state.spec, upstream)
    except (UpstreamError, TimeoutError) as exc:
        state.models_error = f"{type(exc).__name__}: {exc}"
        return
    state.models, state.models_error = models, None
    if router.models.set(state.spec.worker, models):
        names = "none" if models is None else ", ".join(models.names())
        log.info("engine %s serves models: %s", state.spec.url, names)


async def watch_engine(
    router: Router,
    state: EngineState,
    upstream: Upstream,
    interval: float,
    stopping: asyncio.Event,
    models_interval: float = MODELS_RECHECK_S,
    load_timeout: float = LOAD_TIMEOUT_S,
) -> None:
    """Register the engine, then poll it every ``interval`` s until ``stopping`` is set
    (its models every ``models_interval`` s; each load poll waits ``load_timeout`` s).
    ``upstream`` (the router's engine client) registers it, polls its load and reads its
    models.

    Each new error is logged once (a warning), and again only after it changed or cleared.
    """
    logged: str | None = None
    loop = asyncio.get_running_loop()
    while not stopping.is_set():
        try:
            if not state.registered:
                await _register(router, state, upstream, load_timeout)
            await _poll_load(router, state, upstream, load_timeout)
            state.slow_polls, state.slow = 0, None
            now = loop.time()
            if (
                state.models_read_at is None
                or state.error is not None  # back after failing: it may have restarted
                or now - state.models_read_at >= models_interval
            ):
                await _refresh_models(router, state, upstream, now)
            state.error = None
        except TimeoutError as exc:
            # The engine took the connection and is slow to answer (a vLLM busy on CPU can
            # take seconds over /server_info too): slow, not down, registered or not yet.
            state.slow_polls += 1
            if state.slow_polls <= SLOW_POLLS_TOLERATED:
                what = "the load poll" if state.registered else "discovery"
                state.slow = (
                    f"{what} got no answer within {load_timeout:g} s "
                    f"({state.slow_polls} in a row, {SLOW_POLLS_TOLERATED} tolerated): "
                    "the ranks keep their last known state"
                )
                if state.slow_polls == 1:
                    log.warning("engine %s is slow to answer: %s", state.spec.url, state.slow)
            else:
                router.set_worker_available(state.spec.worker, False)
                state.slow = None
                state.error = (
                    f"{type(exc).__name__}: no answer to {state.slow_polls} load polls in a "
                    f"row within {load_timeout:g} s each"
                )
        except (UpstreamError, ValueError, DiscoveryError) as exc:
            state.slow_polls, state.slow = 0, None
            router.set_worker_available(state.spec.worker, False)
            state.error = f"{type(exc).__name__}: {exc}"
            state.registered = False  # back, it may have restarted (another block size)
        except Exception as exc:  # a bug must not end the poller: it would freeze availability
            log.exception("polling engine %s failed unexpectedly", state.spec.url)
            router.set_worker_available(state.spec.worker, False)
            state.error = f"{type(exc).__name__}: {exc}"
        state.first_poll.set()
        if state.error != logged:
            if state.error is not None:
                log.warning("engine %s is unavailable: %s", state.spec.url, state.error)
            logged = state.error
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stopping.wait(), interval)
