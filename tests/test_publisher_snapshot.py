"""The publisher's block set and its snapshot: what a consumer rebuilds from it, its
bound, its frames on the replay socket, and its config keys."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import zmq

from kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ConfigError,
    EventPublisherFactory,
    Holder,
    KVEventBatch,
    KVEventsConfig,
    PrefixIndex,
    WireError,
    ZmqEventPublisher,
    decode_batch,
)
from kvevents.engine.cache import PrefixCache
from kvevents.index.types import Tier
from kvevents.publish.block_state import BlockState
from kvevents.publish.snapshot import PART_BLOCKS, snapshot_events
from kvevents.wire.frames import (
    END_SEQ,
    SNAPSHOT_TAG,
    SnapshotReply,
    encode_seq,
    is_snapshot_reply,
    is_snapshot_request,
    parse_replay_reply,
    parse_replay_request,
    parse_snapshot_reply,
    replay_end_frames,
    replay_request_frames,
    snapshot_end_frames,
    snapshot_part_frames,
    snapshot_request_frames,
    snapshot_unavailable_frames,
)
from kvevents.wire.hashing import get_hash_scheme

H = Holder("engine", 0)
PAGE = 4


def batch(*events: Any) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=0)


def stored(
    hashes: list[int], tokens: list[int], parent: int | None = None, **kw: Any
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=kw.pop("block_size", PAGE),
        lora_id=kw.pop("lora_id", None),
        medium=kw.pop("medium", None),
        **kw,
    )


def rebuilt(state: BlockState) -> PrefixIndex:
    """A fresh index fed the snapshot of ``state`` as one batch."""
    view = state.view()
    assert not isinstance(view, str), view
    index = PrefixIndex()
    index.apply(H, batch(*snapshot_events(view)))
    return index


def workload(seed: int, scheme: str, window: int | None, tiers: bool) -> list[KVEventBatch]:
    """Batches a small simulated cache publishes under a random workload: evictions,
    adapters, salts, image keys (vLLM), flushes, and CPU copies added and removed."""
    rng = random.Random(seed)
    cache = PrefixCache(PAGE, 40, get_hash_scheme(scheme, seed="0"), sliding_window=window)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 30))] for _ in range(12)]
    group = 1 if window else None
    copied: set[int | bytes] = set()
    out = []
    for _ in range(rng.randrange(20, 80)):
        if rng.random() < 0.03:
            cache.flush()
            copied.clear()
        else:
            tokens = rng.choice(prompts) + [rng.randrange(1, 50) for _ in range(rng.randrange(9))]
            keys: dict[str, Any] = {}
            if rng.random() < 0.2:
                keys |= {"lora_name": rng.choice(["a", "b"]), "lora_id": 1}
            if rng.random() < 0.2:
                keys["cache_salt"] = rng.choice(["s1", "s2"])
            if scheme == "vllm" and rng.random() < 0.2:
                keys["extra_keys"] = [
                    None if rng.random() < 0.5 else [f"img{rng.randrange(3)}", 0]
                    for _ in range(len(tokens) // PAGE)
                ]
            cache.release(cache.admit(tokens, **keys))
        events: list[Any] = cache.take_events()
        held = cache.block_hashes()
        if tiers and held and rng.random() < 0.5:
            some = rng.sample(held, min(len(held), rng.randrange(1, 4)))
            events.append(stored(some, [], medium="CPU", group_idx=group))
            copied.update(some)
        if tiers and copied and rng.random() < 0.3:
            gone = rng.choice(sorted(copied, key=str))
            events.append(BlockRemoved(block_hashes=[gone], medium="CPU", group_idx=group))
            copied.discard(gone)
        if events:
            out.append(batch(*events))
    return out


@pytest.mark.parametrize(
    ("scheme", "window", "tiers"),
    [("sglang", None, False), ("sglang", None, True), ("vllm", None, True), ("vllm", 8, True)],
)
def test_a_snapshot_rebuilds_what_the_live_stream_built(
    scheme: str, window: int | None, tiers: bool
) -> None:
    """Applied to an empty holder, the snapshot gives the index the live stream gave: the
    same content keys and engine hashes per tier, and the same blocks per KV-cache group."""
    for seed in range(40):
        live, state = PrefixIndex(), BlockState(10_000)
        for seq, b in enumerate(workload(seed, scheme, window, tiers)):
            live.apply(H, b)
            state.apply(seq, b)
        snap = rebuilt(state)
        for tier in (Tier.GPU, Tier.CPU, None):
            assert snap.holder_keys(H, tier) == live.holder_keys(H, tier), (seed, tier)
            assert snap.holder_hashes(H, tier) == live.holder_hashes(H, tier), (seed, tier)
        keys = sorted(live.holder_keys(H))
        assert snap.held_by_group(H, keys) == live.held_by_group(H, keys), seed


def test_a_parent_removed_under_a_kept_child_is_relearnt_then_forgotten() -> None:
    """A block removed while its child stays is stored and removed again in the snapshot,
    so the child keeps the key its chain gives it and the parent is not held."""
    live, state = PrefixIndex(), BlockState(100)
    for seq, b in enumerate(
        [
            batch(stored([1, 2, 3], list(range(12)))),
            batch(BlockRemoved(block_hashes=[1, 2])),
        ]
    ):
        live.apply(H, b)
        state.apply(seq, b)
    snap = rebuilt(state)
    assert snap.holder_hashes(H) == live.holder_hashes(H) == {3}
    assert snap.holder_keys(H) == live.holder_keys(H)
    assert snap.match(list(range(12))).by_holder().get(H) is None  # its prefix is gone
    # the ghosts go with their last child
    state.apply(2, batch(BlockRemoved(block_hashes=[3])))
    assert state.blocks == 0


def test_copies_in_a_tier_are_counted_as_a_consumer_counts_them() -> None:
    """A block copied twice into CPU and removed there once is still held in CPU."""
    state = BlockState(100)
    state.apply(0, batch(stored([7], [1, 2, 3, 4])))
    copy = stored([7], [], medium="CPU")
    state.apply(1, batch(copy, copy, BlockRemoved(block_hashes=[7], medium="CPU")))
    state.apply(2, batch(BlockRemoved(block_hashes=[7], medium="GPU")))
    snap = rebuilt(state)
    assert snap.holder_hashes(H, Tier.CPU) == {7}
    assert snap.holder_hashes(H, Tier.GPU) == set()


def test_the_snapshot_starts_with_a_clear_and_names_every_held_block_once() -> None:
    """The events begin with AllBlocksCleared and store each held block exactly once."""
    state = BlockState(100)
    state.apply(0, batch(stored([1, 2], list(range(8))), stored([3], [9, 9, 9, 9], parent=1)))
    view = state.view()
    assert not isinstance(view, str) and view.seq == 0
    events = list(snapshot_events(view))
    assert type(events[0]) is AllBlocksCleared
    named = [h for e in events[1:] for h in e.block_hashes]  # type: ignore[union-attr]
    assert sorted(named) == [1, 2, 3]


def test_past_its_bound_the_set_is_unavailable_until_the_cache_is_cleared() -> None:
    """More blocks than max_blocks make view() say why; an AllBlocksCleared makes it exact again."""
    state = BlockState(3)
    state.apply(0, batch(stored([1, 2, 3, 4], list(range(16)))))
    reason = state.view()
    assert isinstance(reason, str) and "more than 3 blocks" in reason
    assert "snapshot_max_blocks" in reason and state.blocks == 0
    state.apply(1, batch(stored([5], [1, 1, 1, 1])))  # ignored: not exact
    assert isinstance(state.view(), str)
    state.apply(2, batch(AllBlocksCleared(), stored([6], [2, 2, 2, 2])))
    view = state.view()
    assert not isinstance(view, str) and view.seq == 2 and list(view.groups[None].parents) == [6]


def test_a_batch_that_cannot_be_tracked_makes_the_set_unavailable() -> None:
    """A stored chain whose tokens do not fit 64 bits is refused as untracked, not guessed."""
    state = BlockState(100)
    state.apply(0, batch(stored([1], [2**70, 0, 0, 0])))
    reason = state.view()
    assert isinstance(reason, str) and "batch seq 0 could not be tracked" in reason


def test_nothing_published_yet_is_no_snapshot() -> None:
    """A publisher that has sent no batch has no seq to continue from: no snapshot."""
    assert BlockState(10).view() == "nothing was published yet"


# --- on the replay socket ------------------------------------------------------------------


def _ask(endpoint: str, frames: list[bytes], timeout_ms: int = 10_000) -> list[list[bytes]]:
    """Send ``frames`` on a DEALER and read replies until an end or unavailable frame."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart(frames)
        replies = []
        while True:
            assert dealer.poll(timeout_ms), "no reply in time"
            reply = dealer.recv_multipart()
            replies.append(reply)
            if len(reply) == 5 and reply[2] in (b"end", b"unavailable"):
                return replies
            if len(reply) == 4 and reply[2] == b"\xff" * 8:
                return replies
    finally:
        dealer.close()


def _publisher(**kw: Any) -> ZmqEventPublisher:
    return ZmqEventPublisher(
        endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True, **kw
    )


def test_the_replay_socket_answers_a_snapshot_in_parts_at_the_last_seq() -> None:
    """A snapshot request gets parts of at most PART_BLOCKS blocks, then an end frame with
    their count, all at the seq of the last batch; the parts rebuild every block."""
    with _publisher(buffer_steps=5, snapshot=True) as pub:
        for i in range(60):
            hashes = list(range(i * 100, i * 100 + 100))
            pub.publish(batch(stored(hashes, list(range(400)), parent=None, lora_id=i)))
        assert pub.flush(10)
        replies = [
            parse_snapshot_reply(r) for r in _ask(pub.replay_endpoint, snapshot_request_frames())
        ]
        parts, end = replies[:-1], replies[-1]
        assert end.kind == "end" and end.seq == 59 and end.parts == len(parts) == 2
        assert all(p.kind == "part" and p.seq == 59 for p in parts)
        batches = [decode_batch(p.body) for p in parts]
        assert all(
            sum(len(getattr(e, "block_hashes", ())) for e in b.events) <= PART_BLOCKS
            for b in batches
        )
        named = {h for b in batches for e in b.events for h in getattr(e, "block_hashes", ())}
        assert named == set(range(6000))
        assert pub.stats.snapshots == 1 and pub.stats.snapshot_blocks == 6000


def test_a_publisher_without_snapshots_says_so_and_replays_as_before() -> None:
    """Snapshots off, a snapshot request gets one "unavailable" frame saying how to turn
    them on, and a replay request gets the same bytes as with snapshots on."""
    answers = []
    for snapshot in (False, True):
        with _publisher(buffer_steps=5, snapshot=snapshot) as pub:
            pub.publish(
                KVEventBatch(ts=1.5, events=[stored([1], [1, 2, 3, 4])], data_parallel_rank=0)
            )
            assert pub.flush(10)
            answers.append(_ask(pub.replay_endpoint, replay_request_frames(0)))
            if not snapshot:
                (only,) = _ask(pub.replay_endpoint, snapshot_request_frames())
                reply = parse_snapshot_reply(only)
                assert reply == SnapshotReply("unavailable", END_SEQ, reply.body)
                assert '"snapshot": true' in reply.reason
                assert pub.stats.snapshots_unavailable == 1
    assert answers[0] == answers[1]
    assert [parse_replay_reply(r).seq for r in answers[0]] == [0, END_SEQ]


def test_a_dropped_batch_makes_the_publisher_answer_unavailable() -> None:
    """A batch dropped on a full queue leaves the set inexact: the answer says so."""
    with _publisher(buffer_steps=5, snapshot=True, max_queue_size=1) as pub:
        with pub._send_queue.hold():  # a frozen sender: the queue fills
            pub.publish(batch(stored([1], [1, 2, 3, 4])))
            pub.publish(batch(stored([2], [5, 6, 7, 8])))
        assert pub.flush(10)
        assert pub.stats.dropped == 1
        (only,) = _ask(pub.replay_endpoint, snapshot_request_frames())
        reply = parse_snapshot_reply(only)
        assert reply.kind == "unavailable" and "dropped 1 batch" in reply.reason


# --- configuration -------------------------------------------------------------------------


def test_snapshots_need_a_replay_endpoint() -> None:
    """Turning snapshots on without a replay endpoint is refused, naming the missing key."""
    with pytest.raises(ConfigError, match="no 'replay_endpoint'"):
        KVEventsConfig.from_dict({"publisher": "zmq", "snapshot": True})
    with pytest.raises(ConfigError, match="'snapshot_max_blocks' is 0"):
        KVEventsConfig.from_dict(
            {"publisher": "zmq", "replay_endpoint": "tcp://*:0", "snapshot_max_blocks": 0}
        )
    with pytest.raises(ConfigError, match="needs a replay_endpoint"):
        ZmqEventPublisher(endpoint="tcp://127.0.0.1:0", bind=True, snapshot=True)


def test_either_key_turns_snapshots_on_and_false_keeps_them_off() -> None:
    """``snapshot: true`` or ``snapshot_max_blocks`` turn snapshots on; ``snapshot: false`` wins."""
    base = {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
        "bind": True,
    }
    cases = [({}, False), ({"snapshot": True}, True), ({"snapshot_max_blocks": 10}, True)]
    cases.append(({"snapshot": False, "snapshot_max_blocks": 10}, False))
    for extra, on in cases:
        config = KVEventsConfig.from_dict(base | extra)
        assert config.snapshot_enabled is on
        pub = EventPublisherFactory.create(config)
        try:
            assert isinstance(pub, ZmqEventPublisher) and pub.snapshot_enabled is on, extra
        finally:
            pub.shutdown()


def test_a_registered_publisher_without_snapshots_is_not_given_their_keys() -> None:
    """A config without the snapshot keys constructs a registered publisher that knows none."""
    seen: dict[str, Any] = {}

    class Plain(ZmqEventPublisher):
        def __init__(self, attn_dp_rank: int | None = None, **settings: Any) -> None:
            seen.update(settings)
            super().__init__(attn_dp_rank, **settings)

    name = f"plain-{id(seen)}"
    EventPublisherFactory.register_publisher(name, Plain)
    try:
        pub = EventPublisherFactory.create(
            {"publisher": name, "endpoint": "tcp://127.0.0.1:0", "bind": True}
        )
        pub.shutdown()
    finally:
        EventPublisherFactory._registry.pop(name)
    assert not any(key.startswith("snapshot") for key in seen)


# --- frames --------------------------------------------------------------------------------


def test_a_snapshot_request_cannot_be_read_as_a_replay_request() -> None:
    """The request's second frame is never an 8-byte seq: a replay parser refuses it, and
    only the exact ``[identity, b"", SNAPSHOT_TAG]`` is a snapshot request."""
    frames = snapshot_request_frames()
    assert frames == [b"", SNAPSHOT_TAG] and len(SNAPSHOT_TAG) != 8
    with pytest.raises(WireError):
        parse_replay_request([b"id", *frames])
    assert is_snapshot_request([b"id", *frames])
    assert not is_snapshot_request([b"id", *replay_request_frames(0)])
    assert not is_snapshot_request([b"id", b"", SNAPSHOT_TAG, b"more"])


def test_snapshot_replies_are_checked_before_they_are_read() -> None:
    """A reply of the wrong shape, an unknown kind or a short end count is a WireError
    naming what was wrong; the three kinds round-trip."""
    for bad, what in [
        ([b"", SNAPSHOT_TAG, b"part", encode_seq(1)], "has 4 frames"),
        ([b"", SNAPSHOT_TAG, b"bogus", encode_seq(1), b""], "is not one of"),
        ([b"", SNAPSHOT_TAG, b"end", encode_seq(1), b"\x01"], "count has 1 bytes"),
        ([b"", SNAPSHOT_TAG, b"part", b"\x01", b""], "sequence frame has 1 bytes"),
    ]:
        with pytest.raises(WireError, match=what):
            parse_snapshot_reply(bad)
    assert parse_snapshot_reply(snapshot_part_frames(3, b"x")) == SnapshotReply("part", 3, b"x")
    assert parse_snapshot_reply(snapshot_end_frames(3, 2)).parts == 2
    gone = parse_snapshot_reply(snapshot_unavailable_frames("why"))
    assert (gone.kind, gone.seq, gone.reason) == ("unavailable", END_SEQ, "why")
    assert not is_snapshot_reply(replay_end_frames())
