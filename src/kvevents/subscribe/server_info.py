"""An engine's ``GET /server_info`` and its ``kv_events`` block, into one stream per rank.

The block is decoded into the same :class:`~kvevents.wire.server_info.KVEventsBlock`
the simulated engine writes (its fields are documented there). Rank ``r`` publishes on
``tcp://H:endpoint_port_base + r`` (replay likewise), where ``H`` is the engine URL's
host when ``endpoint_host`` is a wildcard (``*``, ``0.0.0.0``, ``::``) and
``endpoint_host`` otherwise. A ``publishers`` list, when present, wins over base + rank
(ports chosen by the OS are not consecutive; ranks may live on other hosts), and the
wildcard rule applies to its endpoints too. Upstream SGLang sends no such list.

A ``curve_public_key`` (kvevents engines with CURVE keys) becomes every stream's
``curve_server_key``; ``snapshot: true`` (kvevents engines whose publishers serve
snapshots) makes every stream with a replay endpoint ask for one when replay cannot fill
a gap. A block without it (upstream SGLang's) is never sent that request.

The block is absent when publishing is off, which is reported as a
:class:`~kvevents.errors.DiscoveryError` saying how to turn it on; a malformed block is
a DiscoveryError naming the engine and the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import httpx
import msgspec

from kvevents.errors import ConfigError, DiscoveryError
from kvevents.subscribe.stream_spec import (
    HOW_TO_ENABLE,
    StreamSpec,
    normalize_engine_url,
    resolve_endpoint,
    tcp_endpoint,
)
from kvevents.transport.curve_keys import parse_public_key
from kvevents.wire.server_info import KVEventsBlock, decode_kv_events_block

__all__ = ["fetch_server_info", "streams_from_server_info"]


def fetch_server_info(
    url: str, *, timeout: float = 2.0, client: httpx.Client | None = None
) -> dict[str, Any]:
    """GET ``{url}/server_info`` and return the parsed JSON object."""
    url = normalize_engine_url(url)
    target = f"{url}/server_info"
    try:
        response = (
            client.get(target, timeout=timeout) if client else httpx.get(target, timeout=timeout)
        )
    except httpx.HTTPError as exc:
        raise DiscoveryError(
            f"GET {target} failed ({type(exc).__name__}: {exc}): is the engine running at {url}?",
            reached=False,
        ) from None
    if response.status_code in (401, 403):
        raise DiscoveryError(
            f"GET {target} answered HTTP {response.status_code}: the engine requires an API "
            "key and refused this client's (missing or wrong); give the engine's key "
            "(kvevents router --engine-api-key, Subscriber(http_credentials=...))"
        )
    if response.status_code != 200:
        raise DiscoveryError(
            f"GET {target} answered HTTP {response.status_code}: is {url} an SGLang, vLLM or "
            "kvevents engine?"
        )
    try:
        info = response.json()
    except ValueError:
        raise DiscoveryError(f"GET {target} did not answer with JSON") from None
    if not isinstance(info, dict):
        raise DiscoveryError(f"GET {target} answered {type(info).__name__}, expected a JSON object")
    return info


_AT_PATH = re.compile(r"^(?P<detail>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)


def _decode_block(block: Mapping[str, Any], where: str) -> KVEventsBlock:
    """The block as a struct; msgspec's error reworded to name the engine and the field."""
    try:
        return decode_kv_events_block(block)
    except msgspec.ValidationError as exc:
        # msgspec says "Expected `int`, got `str` - at `$.endpoint_port_base`": lead with the
        # field, as every other discovery error does.
        found = _AT_PATH.match(str(exc))
        field, detail = (found["path"], found["detail"]) if found else ("", str(exc))
        raise DiscoveryError(
            f"{where}: kv_events{field}: {detail[:1].lower()}{detail[1:]}; "
            "the engine's block is malformed"
        ) from None


def _required(value: Any, key: str, where: str) -> Any:
    if value is None:
        raise DiscoveryError(f"{where}: kv_events has no {key!r}; the engine's block is incomplete")
    return value


def streams_from_server_info(
    info: Mapping[str, Any], *, engine_url: str | None = None, worker: str | None = None
) -> list[StreamSpec]:
    """Per-rank stream descriptions from a parsed ``/server_info`` document.

    ``engine_url`` supplies the host for wildcard endpoints and, unless ``worker`` is
    given, names the worker. Returned in rank order.

    >>> info = {"kv_events": {"publisher": "zmq", "endpoint_host": "*",
    ...                       "endpoint_port_base": 5557, "dp_size": 2}}
    >>> [s.endpoint for s in streams_from_server_info(info, engine_url="http://10.0.0.5:30000")]
    ['tcp://10.0.0.5:5557', 'tcp://10.0.0.5:5558']
    """
    where = f"engine {engine_url}" if engine_url else "server_info"
    raw = info.get("kv_events")
    if not isinstance(raw, Mapping) or raw.get("publisher") == "null":
        raise DiscoveryError(
            f"{where} advertises no kv_events block: KV-event publishing looks off on that "
            f"engine (or its endpoint is not routable tcp); {HOW_TO_ENABLE}"
        )
    publisher = raw.get("publisher")
    if publisher is not None and publisher != "zmq":
        raise DiscoveryError(
            f"{where}: kv_events.publisher is {publisher!r}: kvevents follows only 'zmq' "
            "publishers; start the engine with a zmq KV-event publisher"
        )
    block = _decode_block(raw, where)
    curve_key = None
    if isinstance(block.curve_public_key, str):
        try:
            curve_key = parse_public_key(block.curve_public_key, "kv_events.curve_public_key")
        except ConfigError as exc:
            raise DiscoveryError(f"{where}: {exc}; the engine's block is malformed") from None
    snapshot = block.snapshot is True
    name = worker or (normalize_engine_url(engine_url) if engine_url else "engine")
    topic = block.topic or ""
    block_size = block.block_size
    page_size = info.get("page_size")
    if block_size is None and isinstance(page_size, int) and not isinstance(page_size, bool):
        block_size = page_size
    if block_size is not None and block_size < 1:
        raise DiscoveryError(
            f"{where}: kv_events.block_size (or page_size) is {block_size!r}, expected a "
            "positive number of tokens per block; the engine's block is malformed"
        )
    dp_size = block.dp_size
    if dp_size is None:
        dp_size = info.get("dp_size", 1)
    if not isinstance(dp_size, int) or dp_size < 1:
        raise DiscoveryError(f"{where}: dp_size is {dp_size!r}, expected a positive int")

    specs: list[StreamSpec] = []
    if block.publishers is not None:
        for i, entry in enumerate(block.publishers):
            at = f"{where}: kv_events.publishers[{i}]"
            replay = entry.replay_endpoint
            specs.append(
                StreamSpec(
                    worker=name,
                    dp_rank=entry.dp_rank,
                    endpoint=resolve_endpoint(entry.endpoint, engine_url, at),
                    replay_endpoint=None
                    if replay is None
                    else resolve_endpoint(replay, engine_url, at),
                    topic=topic,
                    block_size=block_size,
                    curve_server_key=curve_key,
                    snapshot=snapshot and replay is not None,
                )
            )
        ranks = sorted(s.dp_rank for s in specs)
        if ranks != list(range(dp_size)):
            raise DiscoveryError(
                f"{where}: kv_events.publishers lists ranks {ranks} but dp_size is {dp_size}: "
                f"every rank 0..{dp_size - 1} must appear exactly once"
            )
        return sorted(specs, key=lambda s: s.dp_rank)

    host: str = _required(block.endpoint_host, "endpoint_host", where)
    base: int = _required(block.endpoint_port_base, "endpoint_port_base", where)
    unset_or_base = block.replay_endpoint_port_base
    replay_base = unset_or_base if isinstance(unset_or_base, int) else None  # absent or null
    for r in range(dp_size):
        specs.append(
            StreamSpec(
                worker=name,
                dp_rank=r,
                endpoint=tcp_endpoint(host, base + r, engine_url, where),
                replay_endpoint=None
                if replay_base is None
                else tcp_endpoint(host, replay_base + r, engine_url, where),
                topic=topic,
                block_size=block_size,
                curve_server_key=curve_key,
                snapshot=snapshot and replay_base is not None,
            )
        )
    return specs
