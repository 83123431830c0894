"""kvevents: the KV-cache event plane for data-parallel LLM serving.

One public surface: import from ``kvevents``; submodules may move.

* Publishing (engine side): :class:`ZmqEventPublisher`, :class:`EventPublisherFactory`,
  :class:`KVEventsConfig`, :func:`select_kv_publisher_dp_rank`, the wire structs.
* Consuming (router side): :class:`Subscriber` and its items (:class:`Delivery`,
  :class:`Gap`, :class:`Loss`, :class:`Reset`, :class:`Unreachable`),
  :class:`PrefixIndex`, :class:`Router`.
* The simulated engine lives in :mod:`kvevents.engine` (``kvevents engine`` on the
  command line).
"""

from kvevents.config import KVEventsConfig
from kvevents.endpoints import (
    Endpoint,
    PortPlan,
    RankEndpoints,
    free_port_range,
    offset_endpoint_port,
    select_kv_publisher_dp_rank,
)
from kvevents.errors import (
    ConfigError,
    DiscoveryError,
    EndpointError,
    KVEventsError,
    PublisherStateError,
    RouterNotReadyError,
    SubscriberStateError,
    WireError,
)
from kvevents.index.prefix_index import PrefixIndex
from kvevents.index.types import HolderMatch, IndexStats, PrefixMatch, Tier, TierCredits
from kvevents.publish.zmq_publisher import (
    EventPublisher,
    EventPublisherFactory,
    NullEventPublisher,
    PublisherState,
    PublisherStats,
    ZmqEventPublisher,
)
from kvevents.router import HolderLoad, HolderScore, RouteDecision, Router, ScoringWeights
from kvevents.subscribe.block_sizes import BlockSizeMismatch, BlockSizes
from kvevents.subscribe.discovery import StreamSpec, discover, streams_from_server_info
from kvevents.subscribe.engine_spec import EngineSpec, load_engines_file
from kvevents.subscribe.engine_watcher import EngineStatus
from kvevents.subscribe.items import Delivery, Gap, Loss, Reset, Signal, Unreachable
from kvevents.subscribe.stats import StreamStats
from kvevents.subscribe.subscriber import Subscriber, SubscriberState
from kvevents.types import Holder
from kvevents.wire.codec import decode_batch, encode_batch
from kvevents.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    event_to_dict,
    hash_to_int,
)
from kvevents.wire.hashing import content_keys, sglang_block_hashes, vllm_block_hashes

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockSizeMismatch",
    "BlockSizes",
    "BlockStored",
    "ConfigError",
    "Delivery",
    "DiscoveryError",
    "Endpoint",
    "EndpointError",
    "EngineSpec",
    "EngineStatus",
    "EventPublisher",
    "EventPublisherFactory",
    "Gap",
    "Holder",
    "HolderLoad",
    "HolderMatch",
    "HolderScore",
    "IndexStats",
    "KVCacheEvent",
    "KVEventBatch",
    "KVEventsConfig",
    "KVEventsError",
    "Loss",
    "NullEventPublisher",
    "PortPlan",
    "PrefixIndex",
    "PrefixMatch",
    "PublisherState",
    "PublisherStateError",
    "PublisherStats",
    "RankEndpoints",
    "Reset",
    "RouteDecision",
    "Router",
    "RouterNotReadyError",
    "ScoringWeights",
    "Signal",
    "StreamSpec",
    "StreamStats",
    "Subscriber",
    "SubscriberState",
    "SubscriberStateError",
    "Tier",
    "TierCredits",
    "Unreachable",
    "WireError",
    "ZmqEventPublisher",
    "content_keys",
    "decode_batch",
    "discover",
    "encode_batch",
    "event_to_dict",
    "free_port_range",
    "hash_to_int",
    "load_engines_file",
    "offset_endpoint_port",
    "select_kv_publisher_dp_rank",
    "sglang_block_hashes",
    "streams_from_server_info",
    "vllm_block_hashes",
]

__version__ = "0.1.0"
