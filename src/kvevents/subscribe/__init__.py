"""The consumer side's front door: every rank's stream, complete and in order.

* :mod:`~kvevents.subscribe.subscriber`: :class:`Subscriber`;
* :mod:`~kvevents.subscribe.items`: what it yields (:class:`Delivery` and the signals);
* :mod:`~kvevents.subscribe.discovery`: an engine URL to one :class:`StreamSpec` per
  rank, from :mod:`~kvevents.subscribe.server_info` (the ``kv_events`` block) or vLLM's
  :mod:`~kvevents.subscribe.kv_event_sources`; :mod:`~kvevents.subscribe.stream_spec`
  holds :class:`StreamSpec` and the endpoint resolution both share;
* :mod:`~kvevents.subscribe.engine_spec`: engines described by hand, or in a file;
* :mod:`~kvevents.subscribe.block_sizes`: block sizes configured against observed;
* :mod:`~kvevents.subscribe.stream`: per-stream sequence tracking, a pure state machine;
  :mod:`~kvevents.subscribe.snapshot_assembly`: a publisher's snapshot answer, whole or not;
* :mod:`~kvevents.subscribe.loop`, :mod:`~kvevents.subscribe.stream_sockets`,
  :mod:`~kvevents.subscribe.replay_client`: the socket thread, one stream's sockets,
  and the DEALER side of replay;
* :mod:`~kvevents.subscribe.curve_client`: CURVE client keys on a stream's sockets, and
  what a failed handshake means;
* :mod:`~kvevents.subscribe.engine_watcher`: finding an engine's streams, with backoff;
* :mod:`~kvevents.subscribe.handoff`: socket thread to consumer, sync or asyncio;
* :mod:`~kvevents.subscribe.stats`: per-stream counters and rates.

Nothing here imports the engine side (``publish``, ``engine``) or the index.
"""

from kvevents.subscribe.block_sizes import BlockSizeMismatch, BlockSizes
from kvevents.subscribe.discovery import StreamSpec, discover, streams_from_server_info
from kvevents.subscribe.engine_spec import ENGINE_KINDS, EngineKind, EngineSpec, load_engines_file
from kvevents.subscribe.engine_watcher import DiscoveryState, EngineStatus
from kvevents.subscribe.items import (
    Delivery,
    Gap,
    Item,
    Loss,
    Reset,
    Resync,
    Signal,
    Unreachable,
)
from kvevents.subscribe.stats import StreamStats, StreamStatus
from kvevents.subscribe.subscriber import Subscriber, SubscriberState

__all__ = [
    "ENGINE_KINDS",
    "BlockSizeMismatch",
    "BlockSizes",
    "Delivery",
    "DiscoveryState",
    "EngineKind",
    "EngineSpec",
    "EngineStatus",
    "Gap",
    "Item",
    "Loss",
    "Reset",
    "Resync",
    "Signal",
    "StreamSpec",
    "StreamStats",
    "StreamStatus",
    "Subscriber",
    "SubscriberState",
    "Unreachable",
    "discover",
    "load_engines_file",
    "streams_from_server_info",
]
