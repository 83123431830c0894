"""Discovery, consumer side: an engine's URL into one :class:`StreamSpec` per rank.

Two documents describe an engine's streams:

* ``GET /server_info`` with a ``kv_events`` block (SGLang, kvevents' simulated engine):
  :mod:`~kvevents.subscribe.server_info`, the block's schema in
  :mod:`~kvevents.wire.server_info`;
* ``GET /kv_event_sources`` (vLLM 0.32 and later, which has no such block):
  :mod:`~kvevents.subscribe.kv_event_sources`.

:func:`discover` tries ``/server_info`` first and falls back to ``/kv_event_sources``,
so a vLLM is discovered from its URL alone (its block size is then learned from its
events). This module is discovery's face: the names of both documents' modules and of
:mod:`~kvevents.subscribe.stream_spec` are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from kvevents.errors import DiscoveryError
from kvevents.subscribe.kv_event_sources import (
    fetch_kv_event_sources,
    streams_from_kv_event_sources,
)
from kvevents.subscribe.server_info import fetch_server_info, streams_from_server_info
from kvevents.subscribe.stream_spec import StreamSpec, normalize_engine_url

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
