"""Discovery, consumer side: an engine's ``/server_info`` into one stream per rank.

The engine advertises a ``kv_events`` block (DESIGN §3)::

    {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557,
     "replay_endpoint_port_base": 5600,          # only when replay is on
     "topic": "", "block_size": 16, "dp_size": 4,
     "publishers": [{"dp_rank": 0, "endpoint": "tcp://*:5557",
                     "replay_endpoint": "tcp://*:5600"}, ...]}   # optional

Rank ``r`` publishes on ``tcp://H:endpoint_port_base + r`` (replay likewise), where ``H``
is the engine URL's host when ``endpoint_host`` is a wildcard (``*``, ``0.0.0.0``,
``::``) and ``endpoint_host`` otherwise. A ``publishers`` list, when present, wins over
base + rank (ports chosen by the OS are not consecutive; ranks may live on other hosts),
and the wildcard rule applies to its endpoints too. The block is absent when publishing
is off, which is reported as a :class:`~kvevents.errors.DiscoveryError` saying how to
turn it on.

vLLM (0.32 and later) has no such block but answers ``GET /kv_event_sources`` with each
rank's own publisher config, endpoints already offset per rank::

    {"0": {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600",
           "topic": "kv", ...},
     "1": {"publisher": "zmq", "endpoint": "tcp://*:5558", ...}}

:func:`discover` tries ``/server_info`` first and falls back to that, so a vLLM is
discovered from its URL alone (its block size is then learned from its events).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import msgspec

from kvevents.endpoints import WILDCARD_HOSTS, Endpoint
from kvevents.errors import DiscoveryError, EndpointError

__all__ = [
    "StreamSpec",
    "discover",
    "fetch_kv_event_sources",
    "fetch_server_info",
    "normalize_engine_url",
    "streams_from_kv_event_sources",
    "streams_from_server_info",
    "streams_of_engine",
]

_HOW_TO_ENABLE = (
    "start the engine with --kv-events-config "
    '\'{"publisher":"zmq","endpoint":"tcp://*:5557"}\' '
    '(add "replay_endpoint":"tcp://*:5600" so consumers can recover gaps)'
)


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Where one rank's stream is: connectable endpoints, topic, block size.

    ``worker`` and ``dp_rank`` name the holder (the KV cache) the stream describes.
    ``endpoint`` and ``replay_endpoint`` are ZMQ addresses to connect to (never wildcards).
    """

    worker: str
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int | None = None

    @classmethod
    def from_endpoint(
        cls,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        worker: str | None = None,
        dp_rank: int = 0,
        block_size: int | None = None,
    ) -> StreamSpec:
        """An explicit stream; ``worker`` defaults to the endpoint string.

        Raises :class:`~kvevents.errors.EndpointError` for an invalid endpoint or one
        that can only be bound (a wildcard host).
        """
        live = _connectable(endpoint, "endpoint")
        replay = (
            None if replay_endpoint is None else _connectable(replay_endpoint, "replay endpoint")
        )
        return cls(
            worker=worker if worker is not None else endpoint,
            dp_rank=dp_rank,
            endpoint=live,
            replay_endpoint=replay,
            topic=topic,
            block_size=block_size,
        )


def _connectable(text: str, what: str) -> str:
    parsed = Endpoint.parse(text)
    if parsed.is_wildcard:
        raise EndpointError(
            f"{what} {text!r} has a wildcard host, which a publisher binds but a subscriber "
            f"cannot connect to: give the engine's host, e.g. tcp://127.0.0.1:{parsed.port}"
        )
    if parsed.is_tcp and parsed.port == 0:
        raise EndpointError(f"{what} {text!r} has port 0: give the port the publisher bound")
    return str(parsed)


def normalize_engine_url(url: str) -> str:
    """``host:port`` -> ``http://host:port``; trailing slashes dropped."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url


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


def discover(
    url: str,
    *,
    worker: str | None = None,
    timeout: float = 2.0,
    client: httpx.Client | None = None,
) -> list[StreamSpec]:
    """Every rank's stream of the engine at ``url``: its ``/server_info``, else (a vLLM)
    its ``/kv_event_sources``; each request ``timeout`` seconds.

    DiscoveryError when neither describes any stream; its ``reached`` says whether the
    engine answered at all.
    """
    url = normalize_engine_url(url)
    try:
        info = fetch_server_info(url, timeout=timeout, client=client)
    except DiscoveryError as exc:
        if not exc.reached:
            raise
        sources = fetch_kv_event_sources(url, timeout=timeout, client=client)
        if not sources:
            raise
        return streams_from_kv_event_sources(sources, engine_url=url, worker=worker)
    return streams_of_engine(info, url, worker=worker, timeout=timeout, client=client)


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


def streams_of_engine(
    info: Mapping[str, Any],
    url: str,
    *,
    worker: str | None = None,
    timeout: float = 2.0,
    client: httpx.Client | None = None,
) -> list[StreamSpec]:
    """The streams ``info`` (the engine's ``/server_info``) advertises or, when it has no
    kv_events block, those of ``/kv_event_sources`` (vLLM); the ``/server_info``
    DiscoveryError when neither has any."""
    try:
        return streams_from_server_info(info, engine_url=url, worker=worker)
    except DiscoveryError:
        sources = fetch_kv_event_sources(url, timeout=timeout, client=client)
        if not sources:  # not a vLLM, or one without KV events: the first error says more
            raise
    return streams_from_kv_event_sources(sources, engine_url=url, worker=worker)


def streams_from_kv_event_sources(
    sources: Any, *, engine_url: str | None = None, worker: str | None = None
) -> list[StreamSpec]:
    """Per-rank stream descriptions from vLLM's parsed ``/kv_event_sources``, in rank order.

    ``engine_url`` supplies the host for wildcard endpoints and, unless ``worker`` is
    given, names the worker. No block size is advertised there.
    """
    where = f"engine {engine_url} /kv_event_sources" if engine_url else "kv_event_sources"
    if not isinstance(sources, Mapping) or not sources:
        raise DiscoveryError(f"{where} lists no publishers; {_HOW_TO_ENABLE}")
    name = worker or (normalize_engine_url(engine_url) if engine_url else "engine")
    specs: list[StreamSpec] = []
    for key, config in sources.items():
        at = f"{where}[{key!r}]"
        if not isinstance(key, str) or not key.isdigit():
            raise DiscoveryError(f"{at}: the key must be a data-parallel rank (0, 1, ...)")
        if not isinstance(config, Mapping):
            raise DiscoveryError(f"{at} is {config!r}, expected a publisher config object")
        if config.get("publisher") != "zmq":
            raise DiscoveryError(
                f"{at}: publisher is {config.get('publisher')!r}, not 'zmq': KV-event "
                f"publishing looks off on that rank; {_HOW_TO_ENABLE}"
            )
        live = _field(config, "endpoint", str, at)
        replay = _field(config, "replay_endpoint", str, at, required=False)
        specs.append(
            StreamSpec(
                worker=name,
                dp_rank=int(key),
                endpoint=_resolve(live, engine_url, at),
                replay_endpoint=None if replay is None else _resolve(replay, engine_url, at),
                topic=_field(config, "topic", str, at, required=False) or "",
            )
        )
    return sorted(specs, key=lambda s: s.dp_rank)


def _field(
    block: Mapping[str, Any], key: str, kind: type, where: str, *, required: bool = True
) -> Any:
    value = block.get(key)
    if value is None:
        if required:
            raise DiscoveryError(
                f"{where}: kv_events has no {key!r}; the engine's block is incomplete"
            )
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DiscoveryError(f"{where}: kv_events.{key} is {value!r}, expected {kind.__name__}")
    return value


def _engine_host(engine_url: str | None, where: str) -> str:
    if engine_url is None:
        raise DiscoveryError(
            f"{where}: the kv_events host is a wildcard, so the engine's URL is needed to "
            "know where to connect: pass engine_url="
        )
    host = httpx.URL(normalize_engine_url(engine_url)).host
    if not host:
        raise DiscoveryError(f"{where}: cannot read a host from engine URL {engine_url!r}")
    return host


def _resolve(text: str, engine_url: str | None, where: str) -> str:
    """A publisher-side endpoint as a consumer connects to it (wildcard -> engine host)."""
    try:
        parsed = Endpoint.parse(text)
    except EndpointError as exc:
        raise DiscoveryError(f"{where}: {exc}") from None
    if parsed.is_wildcard:
        parsed = Endpoint(scheme="tcp", host=_engine_host(engine_url, where), port=parsed.port)
    if parsed.is_tcp and parsed.port == 0:
        raise DiscoveryError(f"{where}: endpoint {text!r} advertises port 0, not the bound port")
    return str(parsed)


def _tcp(host: str, port: int, engine_url: str | None, where: str) -> str:
    if not 0 < port <= 65535:
        raise DiscoveryError(f"{where}: port {port} is outside 1..65535")
    host = host.strip("[]")  # an IPv6 host may come bracketed
    if host in WILDCARD_HOSTS:
        host = _engine_host(engine_url, where)
    return str(Endpoint(scheme="tcp", host=host, port=port))


def streams_from_server_info(
    info: Mapping[str, Any], *, engine_url: str | None = None, worker: str | None = None
) -> list[StreamSpec]:
    """Per-rank stream descriptions from a parsed ``/server_info`` document.

    ``engine_url`` supplies the host for wildcard endpoints and, unless ``worker`` is
    given, names the worker. Returned in rank order.
    """
    where = f"engine {engine_url}" if engine_url else "server_info"
    block = info.get("kv_events")
    if not isinstance(block, Mapping) or block.get("publisher") == "null":
        raise DiscoveryError(
            f"{where} advertises no kv_events block: KV-event publishing looks off on that "
            f"engine (or its endpoint is not routable tcp); {_HOW_TO_ENABLE}"
        )
    name = worker or (normalize_engine_url(engine_url) if engine_url else "engine")
    topic = _field(block, "topic", str, where, required=False) or ""
    block_size = _field(block, "block_size", int, where, required=False)
    if block_size is None and isinstance(info.get("page_size"), int):
        block_size = info["page_size"]
    dp_size = _field(block, "dp_size", int, where, required=False)
    if dp_size is None:
        dp_size = info.get("dp_size", 1)
    if not isinstance(dp_size, int) or dp_size < 1:
        raise DiscoveryError(f"{where}: dp_size is {dp_size!r}, expected a positive int")

    publishers = block.get("publishers")
    specs: list[StreamSpec] = []
    if publishers is not None:
        if not isinstance(publishers, list):
            raise DiscoveryError(
                f"{where}: kv_events.publishers must be a list of {{dp_rank, endpoint, replay_endpoint}}"
            )
        for i, entry in enumerate(publishers):
            at = f"{where}: kv_events.publishers[{i}]"
            if not isinstance(entry, Mapping):
                raise DiscoveryError(f"{at} is {entry!r}, expected an object")
            rank = _field(entry, "dp_rank", int, at)
            live = _field(entry, "endpoint", str, at)
            replay = _field(entry, "replay_endpoint", str, at, required=False)
            specs.append(
                StreamSpec(
                    worker=name,
                    dp_rank=rank,
                    endpoint=_resolve(live, engine_url, at),
                    replay_endpoint=None if replay is None else _resolve(replay, engine_url, at),
                    topic=topic,
                    block_size=block_size,
                )
            )
        ranks = sorted(s.dp_rank for s in specs)
        if ranks != list(range(dp_size)):
            raise DiscoveryError(
                f"{where}: kv_events.publishers lists ranks {ranks} but dp_size is {dp_size}: "
                f"every rank 0..{dp_size - 1} must appear exactly once"
            )
        return sorted(specs, key=lambda s: s.dp_rank)

    host = _field(block, "endpoint_host", str, where)
    base = _field(block, "endpoint_port_base", int, where)
    replay_base = _field(block, "replay_endpoint_port_base", int, where, required=False)
    for r in range(dp_size):
        specs.append(
            StreamSpec(
                worker=name,
                dp_rank=r,
                endpoint=_tcp(host, base + r, engine_url, where),
                replay_endpoint=None
                if replay_base is None
                else _tcp(host, replay_base + r, engine_url, where),
                topic=topic,
                block_size=block_size,
            )
        )
    return specs
