"""The KV-event wire format, shared by SGLang, vLLM and kvevents.

* :mod:`~kvevents.wire.events`: the event structs and the batch of one scheduler step;
* :mod:`~kvevents.wire.codec`: a batch as msgpack bytes and back, in both encodings;
* :mod:`~kvevents.wire.frames`: the ZMQ frames of live, replay and snapshot messages;
* :mod:`~kvevents.wire.hashing`: the engines' block hash schemes and our content key;
* :mod:`~kvevents.wire.server_info`: the ``kv_events`` block of ``/server_info``.

Everything here is pure (bytes in, values out); sockets live in ``publish`` and
``subscribe``.
"""

from kvevents.wire.codec import decode_batch, encode_batch
from kvevents.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVCacheEvent,
    KVEventBatch,
    event_to_dict,
    hash_to_int,
)
from kvevents.wire.frames import (
    END_SEQ,
    SNAPSHOT_TAG,
    LiveMessage,
    ReplayReply,
    SnapshotReply,
    decode_seq,
    encode_seq,
    is_snapshot_reply,
    is_snapshot_request,
    live_frames,
    parse_live_frames,
    parse_replay_reply,
    parse_replay_request,
    parse_snapshot_reply,
    replay_end_frames,
    replay_reply_frames,
    replay_request_frames,
    snapshot_end_frames,
    snapshot_part_frames,
    snapshot_request_frames,
    snapshot_unavailable_frames,
)
from kvevents.wire.server_info import (
    AdvertisedPublisher,
    KVEventsBlock,
    decode_kv_events_block,
    encode_kv_events_block,
)

__all__ = [
    "END_SEQ",
    "SNAPSHOT_TAG",
    "AdvertisedPublisher",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "KVCacheEvent",
    "KVEventBatch",
    "KVEventsBlock",
    "LiveMessage",
    "ReplayReply",
    "SnapshotReply",
    "decode_batch",
    "decode_kv_events_block",
    "decode_seq",
    "encode_batch",
    "encode_kv_events_block",
    "encode_seq",
    "event_to_dict",
    "hash_to_int",
    "is_snapshot_reply",
    "is_snapshot_request",
    "live_frames",
    "parse_live_frames",
    "parse_replay_reply",
    "parse_replay_request",
    "parse_snapshot_reply",
    "replay_end_frames",
    "replay_reply_frames",
    "replay_request_frames",
    "snapshot_end_frames",
    "snapshot_part_frames",
    "snapshot_request_frames",
    "snapshot_unavailable_frames",
]
