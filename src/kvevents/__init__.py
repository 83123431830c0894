"""kvevents: the KV-cache event plane for data-parallel LLM serving.

One public surface: import from ``kvevents``; submodules may move.
"""

from kvevents.errors import (
    ConfigError,
    DiscoveryError,
    EndpointError,
    KVEventsError,
    PublisherStateError,
    SubscriberStateError,
    WireError,
)
from kvevents.hashing import content_keys
from kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    hash_to_int,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "ConfigError",
    "DiscoveryError",
    "EndpointError",
    "KVCacheEvent",
    "KVEventBatch",
    "KVEventsError",
    "PublisherStateError",
    "SubscriberStateError",
    "WireError",
    "content_keys",
    "decode_batch",
    "encode_batch",
    "hash_to_int",
]

__version__ = "0.1.0"
