"""kvevents: the KV-cache event plane for data-parallel LLM serving.

One public surface: import what a user of the library needs from ``kvevents``; the
modules behind it may move.

* Publishing (engine side): :class:`ZmqEventPublisher`, :class:`EventPublisherFactory`,
  :class:`KVEventsConfig`, :func:`select_kv_publisher_dp_rank`, the wire structs and
  their codec (:func:`encode_batch`, :func:`decode_batch`).
* Consuming (router side): :class:`Subscriber` and its items (:data:`Item`: a
  :class:`Delivery` or a :class:`Signal` such as :class:`Gap`, :class:`Loss`,
  :class:`Reset`, :class:`Resync`, :class:`Unreachable`, :class:`Malformed`, :class:`Removed`), :class:`PrefixIndex` and its match types,
  :class:`Router` with its :class:`RouteDecision` and :class:`Ticket`.
* Errors: :class:`KVEventsError` and the classes below it (see :mod:`kvevents.errors`).

Deployment helpers and internals stay in their subpackage and are imported from there:
port planning (:mod:`kvevents.transport.endpoints`: ``Endpoint``, ``PortPlan``, ``RankEndpoints``,
``free_port_range``), the subscriber's bookkeeping (:mod:`kvevents.subscribe`:
``BlockSizes``, ``BlockSizeMismatch``, ``EngineStatus``, ``StreamStats``), the HTTP
services (:mod:`kvevents.router`, :mod:`kvevents.engine`; ``kvevents router`` and
``kvevents engine`` on the command line).
"""

from importlib.metadata import version as _version

from kvevents.errors import (
    ConfigError,
    DiscoveryError,
    EndpointError,
    KVEventsError,
    PublisherStateError,
    RequestError,
    RouterNotReadyError,
    SubscriberStateError,
    WireError,
)
from kvevents.index.prefix_index import PrefixIndex, namespace_key
from kvevents.index.types import HolderMatch, IndexStats, PrefixMatch, Tier, TierCredits
from kvevents.publish.config import KVEventsConfig
from kvevents.publish.zmq_publisher import (
    EventPublisher,
    EventPublisherFactory,
    NullEventPublisher,
    PublisherState,
    PublisherStats,
    ZmqEventPublisher,
)
from kvevents.router import (
    HolderLoad,
    HolderScore,
    RouteDecision,
    Router,
    ScoringWeights,
    Ticket,
)
from kvevents.subscribe.discovery import StreamSpec, discover, streams_from_server_info
from kvevents.subscribe.engine_spec import EngineSpec, load_engines_file
from kvevents.subscribe.items import (
    Delivery,
    Gap,
    Item,
    Loss,
    Malformed,
    Removed,
    Reset,
    Resync,
    Signal,
    Unreachable,
)
from kvevents.subscribe.subscriber import Subscriber, SubscriberState
from kvevents.transport.curve_keys import CurveKeyPair
from kvevents.transport.endpoints import offset_endpoint_port, select_kv_publisher_dp_rank
from kvevents.types import Hash, Holder
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
    "BlockStored",
    "ConfigError",
    "CurveKeyPair",
    "Delivery",
    "DiscoveryError",
    "EndpointError",
    "EngineSpec",
    "EventPublisher",
    "EventPublisherFactory",
    "Gap",
    "Hash",
    "Holder",
    "HolderLoad",
    "HolderMatch",
    "HolderScore",
    "IndexStats",
    "Item",
    "KVCacheEvent",
    "KVEventBatch",
    "KVEventsConfig",
    "KVEventsError",
    "Loss",
    "Malformed",
    "NullEventPublisher",
    "PrefixIndex",
    "PrefixMatch",
    "PublisherState",
    "PublisherStateError",
    "PublisherStats",
    "Removed",
    "RequestError",
    "Reset",
    "Resync",
    "RouteDecision",
    "Router",
    "RouterNotReadyError",
    "ScoringWeights",
    "Signal",
    "StreamSpec",
    "Subscriber",
    "SubscriberState",
    "SubscriberStateError",
    "Ticket",
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
    "hash_to_int",
    "load_engines_file",
    "namespace_key",
    "offset_endpoint_port",
    "select_kv_publisher_dp_rank",
    "sglang_block_hashes",
    "streams_from_server_info",
    "vllm_block_hashes",
]

__version__: str = _version("kvevents")
"""The installed distribution's version (from the package metadata, i.e. pyproject.toml)."""
