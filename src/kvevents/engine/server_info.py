"""Building the ``kv_events`` block of ``/server_info`` from what the ranks really bound.

The block (DESIGN §3) tells a consumer where every rank's stream is::

    {
      "publisher": "zmq",
      "endpoint_host": "*",                 # as configured; a wildcard means "the engine's host"
      "endpoint_port_base": 5557,           # rank r publishes on base + r
      "replay_endpoint_port_base": 5600,    # only when replay is on
      "topic": "",
      "block_size": 16,
      "dp_size": 4,
      "ports_consecutive": true,
      "publishers": [{"dp_rank": 0, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"}, ...]
    }

Ports are the ones the publishers actually bound, so a configured port 0 ("the OS
picks") is advertised as real ports. OS-picked ports are usually not consecutive; then
``ports_consecutive`` is false and the base of each range that is not ``base + r`` is
``null`` rather than a number that would send a consumer to the wrong port for every
rank but 0. The ``publishers`` list is always present and always exact; consumers that
know it should prefer it.

The block is absent (``None``) when publishing is off, or when the endpoint is not TCP
(ipc and inproc are not reachable from another host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvevents.config import KVEventsConfig
from kvevents.endpoints import Endpoint

__all__ = ["BoundPublisher", "build_kv_events_block"]


@dataclass(frozen=True, slots=True)
class BoundPublisher:
    """A rank's publisher as started: its live and replay endpoints, ports resolved."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None


def _ports(endpoints: Sequence[str]) -> list[int]:
    ports = []
    for text in endpoints:
        port = Endpoint.parse(text).port
        assert port is not None
        ports.append(port)
    return ports


def _advertised(host: str | None, port: int) -> str:
    return str(Endpoint(scheme="tcp", host=host, port=port))


def build_kv_events_block(
    config: KVEventsConfig,
    bound_publishers: Sequence[BoundPublisher],
    dp_size: int,
    page_size: int,
) -> dict[str, Any] | None:
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
    consecutive = live_ports == list(range(live_ports[0], live_ports[0] + dp_size))
    block: dict[str, Any] = {
        "publisher": config.publisher,
        "endpoint_host": live.host,
        "endpoint_port_base": live_ports[0] if consecutive else None,
    }
    replay = Endpoint.parse(config.replay_endpoint) if config.replay_endpoint else None
    replay_ports: list[int] | None = None
    if replay is not None and replay.is_tcp:
        missing = [p.dp_rank for p in pubs if p.replay_endpoint is None]
        if missing:
            raise ValueError(
                f"build_kv_events_block: replay is configured but ranks {missing} bound none"
            )
        replay_ports = _ports([p.replay_endpoint for p in pubs if p.replay_endpoint])
        replay_consecutive = replay_ports == list(range(replay_ports[0], replay_ports[0] + dp_size))
        block["replay_endpoint_port_base"] = replay_ports[0] if replay_consecutive else None
        consecutive = consecutive and replay_consecutive
    block.update(
        topic=config.topic,
        block_size=page_size,
        dp_size=dp_size,
        ports_consecutive=consecutive,
        publishers=[
            {
                "dp_rank": p.dp_rank,
                "endpoint": _advertised(live.host, live_ports[i]),
                "replay_endpoint": (
                    None
                    if replay_ports is None or replay is None
                    else _advertised(replay.host, replay_ports[i])
                ),
            }
            for i, p in enumerate(pubs)
        ],
    )
    return block
