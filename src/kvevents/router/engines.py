"""What the router asks each engine over HTTP: its ranks (once), then its load or health.

One :func:`watch_engine` task per engine, until the service stops:

1. Register the engine's holders with the router. A described engine
   (:attr:`EngineSpec.described <kvevents.subscribe.engine_spec.EngineSpec.described>`) has its ranks
   from the spec; its ``/server_info`` is then read once, best effort, only to cross-check
   a block size it may advertise (vLLM has none). A discovered engine is registered from
   its ``/server_info``, or a vLLM's ``/kv_event_sources`` (retried until one answers). A configured block size and the
   advertised one are both declared to the router, which checks them
   (:mod:`kvevents.subscribe.block_sizes`).
2. Every ``interval`` seconds: ``kvevents`` engines report per-rank load and
   availability at ``GET /load`` (a rank is routable exactly when that says so);
   ``vllm`` and ``sglang`` engines are asked ``GET /health`` (200 = every rank
   available), and ``vllm`` engines also ``GET /metrics``: the gauges
   ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, labelled
   ``engine="r"`` for data-parallel rank ``r``, are each rank's load. That load counts
   requests other routers and clients sent, which the router's own in-flight count
   cannot see. Metrics are best effort: a vLLM whose ``/metrics`` fails or lacks the
   gauges is still available, with only this router's requests as its load, and
   :attr:`EngineState.load_source` says which applies. The router's own in-flight
   requests count as load for every kind.

Errors never end the task: they mark the engine's ranks unavailable, are kept in
:attr:`EngineState.error` for ``/workers`` and logged (once per new error). An engine
that answers 401 or 403 (it requires an API key, and the router's ``--engine-api-key`` is
missing or wrong) is such an error, worded as one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvevents.errors import DiscoveryError
from kvevents.router.core import Router
from kvevents.subscribe.discovery import (
    StreamSpec,
    streams_from_kv_event_sources,
    streams_from_server_info,
)
from kvevents.subscribe.engine_spec import EngineSpec
from kvevents.types import Holder

__all__ = ["EngineState", "LoadSource", "vllm_rank_loads", "watch_engine"]

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


def vllm_rank_loads(text: str) -> list[dict[str, int]]:
    """Per-rank ``{"dp_rank", "running", "waiting"}`` from vLLM's Prometheus ``/metrics``.

    ValueError when the text does not parse; an empty list when it has no vLLM gauges.
    Samples of one rank (several models) are summed; a value that is not a finite
    non-negative number is skipped.
    """
    ranks: dict[int, dict[str, int]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = _VLLM_GAUGES.get(sample.name)
            engine = sample.labels.get("engine")
            if field is None or engine is None or not engine.isdigit():
                continue
            value = sample.value
            if not math.isfinite(value) or value < 0:
                continue
            entry = ranks.setdefault(
                int(engine), {"dp_rank": int(engine), "running": 0, "waiting": 0}
            )
            entry[field] += int(value)
    return [ranks[r] for r in sorted(ranks)]


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


def _check_authorized(response: httpx.Response) -> httpx.Response:
    """``response``, unless the engine refused the router's key (DiscoveryError saying so)."""
    if response.status_code in (401, 403):
        request = response.request
        raise DiscoveryError(
            f"{request.method} {request.url} answered HTTP {response.status_code}: the engine "
            "requires an API key and refused the router's (missing or wrong); start the router "
            "with --engine-api-key (or --engine-api-key-file) holding the engine's --api-key"
        )
    return response


async def _register(router: Router, state: EngineState, client: httpx.AsyncClient) -> None:
    spec = state.spec
    configured = f"--block-size of engine {spec.worker}"
    if spec.described:
        holders = [Holder(s.worker, s.dp_rank) for s in spec.streams()]
        for h in holders:
            router.add_holder(h, block_size=spec.block_size, source="configured", origin=configured)
        state.registered = True
        try:  # best effort: only to cross-check an advertised block size
            response = _check_authorized(await client.get(f"{spec.url}/server_info", timeout=5.0))
            advertised = _advertised_block_size(response.json()) if response.is_success else None
        except (httpx.HTTPError, ValueError, DiscoveryError):
            advertised = None  # a refused key shows in the /load poll's error
    else:
        streams = await _discover(spec, client)
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


async def _discover(spec: EngineSpec, client: httpx.AsyncClient) -> list[StreamSpec]:
    """The engine's streams from ``/server_info``, else (a vLLM) from ``/kv_event_sources``."""
    response = _check_authorized(await client.get(f"{spec.url}/server_info", timeout=5.0))
    try:
        return streams_from_server_info(response.json(), engine_url=spec.url, worker=spec.worker)
    except (DiscoveryError, ValueError):
        sources = await client.get(f"{spec.url}/kv_event_sources", timeout=5.0)
        if sources.status_code != 200:
            raise
    return streams_from_kv_event_sources(sources.json(), engine_url=spec.url, worker=spec.worker)


async def _poll_load(router: Router, state: EngineState, client: httpx.AsyncClient) -> None:
    spec = state.spec
    if spec.engine_kind == "kvevents":
        response = _check_authorized(await client.get(f"{spec.url}/load", timeout=5.0))
        # Each rank's availability is the engine's word for it (a dead, restarting or
        # stalled rank says available: false), so nothing here marks the worker available.
        router.update_load(spec.worker, response.json())
        state.load_source = "/load"
        return
    response = _check_authorized(await client.get(f"{spec.url}/health", timeout=5.0))
    if response.status_code != 200:
        raise DiscoveryError(f"GET {spec.url}/health answered HTTP {response.status_code}")
    router.set_worker_available(spec.worker, True)
    if spec.engine_kind != "vllm":
        state.load_source = "router"
        return
    # Every rank's load comes from this scrape, zero for a rank it does not mention, and
    # all zero when it fails: a load read earlier must not linger as phantom work.
    loads = {r: {"dp_rank": r, "running": 0, "waiting": 0} for r in range(spec.ranks)}
    try:
        metrics = await client.get(f"{spec.url}/metrics", timeout=5.0)
        metrics.raise_for_status()
        scraped = vllm_rank_loads(metrics.text)
    except Exception as exc:  # foreign text, best effort: any failure is only a metrics_error
        state.metrics_error = f"GET {spec.url}/metrics: {type(exc).__name__}: {exc}"
        scraped = []
    else:
        labels = [r["dp_rank"] for r in scraped]
        scraped = [r for r in scraped if r["dp_rank"] in loads]
        if not scraped:
            state.metrics_error = (
                f"GET {spec.url}/metrics has no vllm:num_requests_* gauges for engine "
                f"labels 0..{spec.ranks - 1} (found {labels or 'none'})"
            )
    for entry in scraped:
        loads[entry["dp_rank"]] = entry
    router.update_load(spec.worker, {"ranks": list(loads.values())})
    # Set once the poll is over, so /workers never shows a half-done poll.
    if scraped:
        state.load_source, state.metrics_error = "/metrics", None
    else:
        state.load_source = "router"


async def watch_engine(
    router: Router,
    state: EngineState,
    client: httpx.AsyncClient,
    interval: float,
    stopping: asyncio.Event,
) -> None:
    """Register the engine, then poll it every ``interval`` s until ``stopping`` is set.

    Each new error is logged once (a warning), and again only after it changed or cleared.
    """
    logged: str | None = None
    while not stopping.is_set():
        try:
            if not state.registered:
                await _register(router, state, client)
            await _poll_load(router, state, client)
            state.error = None
        except (httpx.HTTPError, ValueError, DiscoveryError) as exc:
            router.set_worker_available(state.spec.worker, False)
            state.error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a bug must not end the poller: it would freeze availability
            log.exception("polling engine %s failed unexpectedly", state.spec.url)
            router.set_worker_available(state.spec.worker, False)
            state.error = f"{type(exc).__name__}: {exc}"
        if state.error != logged:
            if state.error is not None:
                log.warning("engine %s is unavailable: %s", state.spec.url, state.error)
            logged = state.error
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stopping.wait(), interval)
