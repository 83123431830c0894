"""Building the ``kv_events`` block of ``/server_info`` from what the ranks really bound.

The block is a :class:`~kvevents.wire.server_info.KVEventsBlock` (its schema and JSON
are documented there and in docs/architecture.md, "Discovery"); it tells a consumer
where every rank's stream is.

Ports are the ones the publishers actually bound, so a configured port 0 ("the OS
picks") is advertised as real ports. OS-picked ports are usually not consecutive; then
``ports_consecutive`` is false and the base of each range that is not ``base + r`` is
``null`` rather than a number that would send a consumer to the wrong port for every
rank but 0. The ``publishers`` list is always present and always exact; consumers that
know it should prefer it.

``snapshot`` is true when every rank's replay socket serves snapshots (each rank says so
in its hello), absent otherwise.

The block is absent (``None``) when publishing is off, or when the endpoint is not TCP
(ipc and inproc are not reachable from another host).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from msgspec import UNSET, UnsetType

from kvevents.publish.config import KVEventsConfig
from kvevents.transport.curve_keys import CurveKeyPair
from kvevents.transport.endpoints import Endpoint
from kvevents.wire.server_info import (
    AdvertisedPublisher,
    KVEventsBlock,
    kv_events_block_to_builtins,
)

__all__ = ["BoundPublisher", "build_kv_events_block", "kv_events_block"]


@dataclass(frozen=True, slots=True)
class BoundPublisher:
    """A rank's publisher as started: its live and replay endpoints, ports resolved, and
    whether its replay socket serves snapshots."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None
    snapshot: bool = False


def _ports(endpoints: Sequence[str]) -> list[int]:
    ports = []
    for text in endpoints:
        port = Endpoint.parse(text).port
        assert port is not None
        ports.append(port)
    return ports


def _advertised(host: str | None, port: int) -> str:
    return str(Endpoint(scheme="tcp", host=host, port=port))


def kv_events_block(
    config: KVEventsConfig,
    bound_publishers: Sequence[BoundPublisher],
    dp_size: int,
    page_size: int,
) -> KVEventsBlock | None:
    """The ``kv_events`` block, or None when publishing is off or the endpoint is not TCP.

    ``bound_publishers`` must hold exactly ranks ``0..dp_size-1`` (any order), with the
    endpoints as bound (port 0 already resolved).
    """
    if not config.enabled:
        return None
    live = Endpoint.parse(config.endpoint)
    if not live.is_tcp:
        return None
    pubs = sorted(bound_publishers, key=lambda p: p.dp_rank)
    ranks = [p.dp_rank for p in pubs]
    if ranks != list(range(dp_size)):
        raise ValueError(
            f"build_kv_events_block: bound publishers have ranks {ranks}, expected 0..{dp_size - 1}"
        )
    live_ports = _ports([p.endpoint for p in pubs])
    live_consecutive = live_ports == list(range(live_ports[0], live_ports[0] + dp_size))
    consecutive = live_consecutive
    replay = Endpoint.parse(config.replay_endpoint) if config.replay_endpoint else None
    replay_ports: list[int] | None = None
    replay_base: int | UnsetType | None = UNSET
    if replay is not None and replay.is_tcp:
        missing = [p.dp_rank for p in pubs if p.replay_endpoint is None]
        if missing:
            raise ValueError(
                f"build_kv_events_block: replay is configured but ranks {missing} bound none"
            )
        replay_ports = _ports([p.replay_endpoint for p in pubs if p.replay_endpoint])
        replay_consecutive = replay_ports == list(range(replay_ports[0], replay_ports[0] + dp_size))
        replay_base = replay_ports[0] if replay_consecutive else None
        consecutive = consecutive and replay_consecutive
    public_key = _curve_public_key(config.curve_secret_key_file, config.curve_secret_key)
    snapshot = replay_ports is not None and all(p.snapshot for p in pubs)
    return KVEventsBlock(
        snapshot=True if snapshot else UNSET,
        curve_public_key=UNSET if public_key is None else public_key,
        publisher=config.publisher,
        endpoint_host=live.host,
        endpoint_port_base=live_ports[0] if live_consecutive else None,
        replay_endpoint_port_base=replay_base,
        topic=config.topic,
        block_size=page_size,
        dp_size=dp_size,
        ports_consecutive=consecutive,
        publishers=[
            AdvertisedPublisher(
                dp_rank=p.dp_rank,
                endpoint=_advertised(live.host, live_ports[i]),
                replay_endpoint=(
                    None
                    if replay_ports is None or replay is None
                    else _advertised(replay.host, replay_ports[i])
                ),
            )
            for i, p in enumerate(pubs)
        ],
    )


@functools.lru_cache(maxsize=8)
def _curve_public_key(secret_key_file: str | None, secret_key: str | None) -> str | None:
    """The publishers' CURVE public key, read once (a key file moved later still serves)."""
    if secret_key_file is not None:
        return CurveKeyPair.load(
            secret_key_file, "kv-events config key 'curve_secret_key_file'"
        ).public
    if secret_key is not None:
        return CurveKeyPair.from_secret(
            secret_key, "kv-events config key 'curve_secret_key'"
        ).public
    return None


def build_kv_events_block(
    config: KVEventsConfig,
    bound_publishers: Sequence[BoundPublisher],
    dp_size: int,
    page_size: int,
) -> dict[str, Any] | None:
    """:func:`kv_events_block` in its JSON form, as ``/server_info`` serves it."""
    block = kv_events_block(config, bound_publishers, dp_size, page_size)
    return None if block is None else kv_events_block_to_builtins(block)
