"""Where one rank's stream is (:class:`StreamSpec`), and turning advertised endpoints
into ones a consumer can connect to.

Engines advertise endpoints as their publishers bind them, often with a wildcard host
(``*``, ``0.0.0.0``, ``::``): a consumer connects to the engine URL's host instead.
Both discovery documents (:mod:`~kvevents.subscribe.server_info`, vLLM's
:mod:`~kvevents.subscribe.kv_event_sources`) resolve endpoints with the helpers here.
"""

from __future__ import annotations

import httpx
import msgspec

from kvevents.errors import ConfigError, DiscoveryError, EndpointError
from kvevents.transport.curve_keys import parse_public_key
from kvevents.transport.endpoints import WILDCARD_HOSTS, Endpoint

__all__ = [
    "HOW_TO_ENABLE",
    "MISSED_WITHOUT_REPLAY",
    "StreamSpec",
    "engine_host",
    "normalize_engine_url",
    "resolve_endpoint",
    "tcp_endpoint",
]

HOW_TO_ENABLE = (
    "start the engine with --kv-events-config "
    '\'{"publisher":"zmq","endpoint":"tcp://*:5557"}\' '
    '(add "replay_endpoint":"tcp://*:5600" so consumers can recover gaps)'
)
"""The hint every "publishing looks off" error ends with."""

MISSED_WITHOUT_REPLAY = (
    "batches this subscriber misses (while disconnected, or published before it joined) "
    "cannot be fetched again; each is reported as a loss, and the blocks they stored stay "
    "unknown until stored again"
)
"""What following a stream without a replay endpoint costs: the middle of every warning
that says so (discovered engines and engines described by hand alike)."""


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Where one rank's stream is: connectable endpoints, topic, block size.

    ``worker`` and ``dp_rank`` name the holder (the KV cache) the stream describes.
    ``endpoint`` and ``replay_endpoint`` are ZMQ addresses to connect to (never wildcards).
    ``curve_server_key``: the publisher's CURVE public key (Z85), when its sockets are
    CURVE servers; None connects in the clear (:mod:`kvevents.subscribe.curve_client`).
    ``snapshot``: the publisher serves snapshots on its replay socket (a kvevents
    publisher that advertises them): a gap replay cannot fill is then asked for as the
    rank's whole state (:class:`~kvevents.subscribe.items.Resync`) instead of reported
    lost. Never true for SGLang's and vLLM's own publishers, which are never asked.

    >>> StreamSpec.from_endpoint("tcp://127.0.0.1:5557", topic="kv").worker
    'tcp://127.0.0.1:5557'
    """

    worker: str
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int | None = None
    curve_server_key: str | None = None
    snapshot: bool = False

    def __post_init__(self) -> None:
        if self.snapshot and self.replay_endpoint is None:
            raise ConfigError(
                f"stream {self.endpoint} (dp {self.dp_rank}) has snapshot=True but no "
                "replay_endpoint: snapshots are asked on the replay socket; give it, or "
                "drop snapshot"
            )

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
        curve_server_key: str | None = None,
        snapshot: bool = False,
    ) -> StreamSpec:
        """An explicit stream; ``worker`` defaults to the endpoint string.

        Raises :class:`~kvevents.errors.EndpointError` for an invalid endpoint or one
        that can only be bound (a wildcard host); ConfigError for a malformed server key.
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
            curve_server_key=None
            if curve_server_key is None
            else parse_public_key(curve_server_key, "curve_server_key"),
            snapshot=snapshot,
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
    """``host:port`` -> ``http://host:port``; trailing slashes dropped.

    >>> normalize_engine_url("127.0.0.1:30000/")
    'http://127.0.0.1:30000'
    """
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url


def engine_host(engine_url: str | None, where: str) -> str:
    """The host of ``engine_url``, to replace a wildcard; ``where`` prefixes errors."""
    if engine_url is None:
        raise DiscoveryError(
            f"{where}: the kv_events host is a wildcard, so the engine's URL is needed to "
            "know where to connect: pass engine_url="
        )
    host = httpx.URL(normalize_engine_url(engine_url)).host
    if not host:
        raise DiscoveryError(f"{where}: cannot read a host from engine URL {engine_url!r}")
    return host


def resolve_endpoint(text: str, engine_url: str | None, where: str) -> str:
    """A publisher-side endpoint as a consumer connects to it (wildcard -> engine host)."""
    try:
        parsed = Endpoint.parse(text)
    except EndpointError as exc:
        raise DiscoveryError(f"{where}: {exc}") from None
    if parsed.is_wildcard:
        parsed = Endpoint(scheme="tcp", host=engine_host(engine_url, where), port=parsed.port)
    if parsed.is_tcp and parsed.port == 0:
        raise DiscoveryError(f"{where}: endpoint {text!r} advertises port 0, not the bound port")
    return str(parsed)


def tcp_endpoint(host: str, port: int, engine_url: str | None, where: str) -> str:
    """``tcp://host:port`` to connect to, a wildcard ``host`` replaced by the engine's."""
    if not 0 < port <= 65535:
        raise DiscoveryError(f"{where}: port {port} is outside 1..65535")
    host = host.strip("[]")  # an IPv6 host may come bracketed
    if host in WILDCARD_HOSTS:
        host = engine_host(engine_url, where)
    return str(Endpoint(scheme="tcp", host=host, port=port))
