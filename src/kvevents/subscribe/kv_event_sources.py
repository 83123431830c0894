"""vLLM's ``GET /kv_event_sources``: each rank's own publisher config, into streams.

vLLM (0.32 and later) has no ``kv_events`` block in ``/server_info``; instead it answers
``/kv_event_sources`` with every rank's publisher config, endpoints already offset per
rank::

    {"0": {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600",
           "topic": "kv", ...},
     "1": {"publisher": "zmq", "endpoint": "tcp://*:5558", ...}}

No block size is advertised there; the subscriber learns it from the events.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from kvevents.errors import DiscoveryError
from kvevents.subscribe.stream_spec import (
    HOW_TO_ENABLE,
    StreamSpec,
    normalize_engine_url,
    resolve_endpoint,
)

__all__ = ["fetch_kv_event_sources", "streams_from_kv_event_sources"]


def fetch_kv_event_sources(
    url: str, *, timeout: float = 2.0, client: httpx.Client | None = None
) -> Any:
    """GET ``{url}/kv_event_sources`` (vLLM's); the parsed JSON, or None when it has none."""
    target = f"{normalize_engine_url(url)}/kv_event_sources"
    try:
        response = (
            client.get(target, timeout=timeout) if client else httpx.get(target, timeout=timeout)
        )
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def streams_from_kv_event_sources(
    sources: Any, *, engine_url: str | None = None, worker: str | None = None
) -> list[StreamSpec]:
    """Per-rank stream descriptions from vLLM's parsed ``/kv_event_sources``, in rank order.

    ``engine_url`` supplies the host for wildcard endpoints and, unless ``worker`` is
    given, names the worker. No block size is advertised there.
    """
    where = f"engine {engine_url} /kv_event_sources" if engine_url else "kv_event_sources"
    if not isinstance(sources, Mapping) or not sources:
        raise DiscoveryError(f"{where} lists no publishers; {HOW_TO_ENABLE}")
    name = worker or (normalize_engine_url(engine_url) if engine_url else "engine")
    specs: list[StreamSpec] = []
    ranks: set[int] = set()
    for key, config in sources.items():
        at = f"{where}[{key!r}]"
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and str(int(key)) == key):
            raise DiscoveryError(f"{at}: the key must be a data-parallel rank (0, 1, ...)")
        if int(key) in ranks:
            raise DiscoveryError(f"{at}: rank {int(key)} is listed twice")
        ranks.add(int(key))
        if not isinstance(config, Mapping):
            raise DiscoveryError(f"{at} is {config!r}, expected a publisher config object")
        if config.get("publisher") != "zmq":
            raise DiscoveryError(
                f"{at}: publisher is {config.get('publisher')!r}, not 'zmq': KV-event "
                f"publishing looks off on that rank; {HOW_TO_ENABLE}"
            )
        live = _field(config, "endpoint", at)
        replay = _field(config, "replay_endpoint", at, required=False)
        specs.append(
            StreamSpec(
                worker=name,
                dp_rank=int(key),
                endpoint=resolve_endpoint(live, engine_url, at),
                replay_endpoint=None
                if replay is None
                else resolve_endpoint(replay, engine_url, at),
                topic=_field(config, "topic", at, required=False) or "",
            )
        )
    return sorted(specs, key=lambda s: s.dp_rank)


def _field(config: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> Any:
    """A string field of a rank's config; None when absent and not required."""
    value = config.get(key)
    if value is None:
        if required:
            raise DiscoveryError(
                f"{where}: kv_events has no {key!r}; the engine's block is incomplete"
            )
        return None
    if not isinstance(value, str):
        raise DiscoveryError(f"{where}: kv_events.{key} is {value!r}, expected str")
    return value
