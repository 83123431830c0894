"""A stream whose replay cannot fill a gap asks for the publisher's snapshot, if and only
if the publisher advertises snapshots: the state machine, then real sockets."""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq

from kvevents import (
    BlockStored,
    ConfigError,
    Delivery,
    EngineSpec,
    Holder,
    KVEventBatch,
    Loss,
    PrefixIndex,
    Reset,
    Resync,
    StreamSpec,
    Subscriber,
    ZmqEventPublisher,
    streams_from_server_info,
)
from kvevents.subscribe.stream import (
    Deliver,
    DeliverSnapshot,
    RequestReplay,
    RequestSnapshot,
    StreamTracker,
)
from kvevents.wire.codec import encode_batch
from kvevents.wire.frames import (
    SNAPSHOT_TAG,
    encode_seq,
    is_snapshot_request,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
    snapshot_end_frames,
    snapshot_part_frames,
    snapshot_unavailable_frames,
)
from subscriber_support import Item, bind_local, collect, deliveries, signals, wait_subscribed


def p(seq: int) -> bytes:
    return f"payload-{seq}".encode()


def tracker(snapshot: bool = True) -> StreamTracker:
    t = StreamTracker("w", 0, has_replay=True, has_snapshot=snapshot)
    assert t.start() == [RequestReplay(0)]
    return t


# --- the state machine ---------------------------------------------------------------------


def test_a_replay_that_starts_past_the_gap_asks_for_a_snapshot_not_a_loss() -> None:
    """A join whose replay starts at seq 50 asks for the snapshot; its answer at seq 59
    gives a Resync, the state at 59, then the live message that waited; nothing lost."""
    t = tracker()
    assert t.on_live(60, p(60)) == []  # waits for the replay
    assert t.on_replay_reply(50, p(50)) == [RequestSnapshot()]
    assert t.on_replay_reply(51, p(51)) == []  # the rest of that replay is not read
    out = t.on_snapshot(59)
    assert isinstance(out[0], Resync) and (out[0].last_seq, out[0].new_seq) == (-1, 59)
    assert isinstance(out[0], Reset) and out[0].kind == "resync"
    assert out[1:] == [DeliverSnapshot(59), Deliver(60, p(60), False)]
    assert (t.last, t.lost, t.snapshots) == (60, 0, 1)


def test_a_failed_snapshot_is_the_loss_replay_would_report_then_replay_resumes() -> None:
    """A snapshot that does not come reports the seqs replay lacked as lost, with the
    reason, and replays from the first seq buffered; no second snapshot is asked then."""
    t = tracker()
    assert t.on_replay_reply(50, p(50)) == [RequestSnapshot()]
    out = t.on_snapshot_failed("the publisher has none (over its bound)")
    assert isinstance(out[0], Loss) and (out[0].first_seq, out[0].last_seq) == (0, 49)
    assert "no snapshot: the publisher has none (over its bound)" in out[0].reason
    assert out[1:] == [RequestReplay(50)]
    out = t.on_replay_reply(55, p(55))  # the buffer moved on meanwhile
    assert isinstance(out[0], Loss) and (out[0].first_seq, out[0].last_seq) == (50, 54)
    assert t.snapshot_failures == 1


def test_a_timeout_or_a_replay_answer_to_the_request_is_a_failed_snapshot() -> None:
    """No answer within the replay timeout, or an end marker (a publisher that took the
    request for a replay), both fall back to the loss."""
    for finish in (StreamTracker.on_replay_timeout, StreamTracker.on_replay_end):
        t = tracker()
        t.on_replay_reply(5, p(5))
        out = finish(t)
        assert isinstance(out[0], Loss) and (out[0].first_seq, out[0].last_seq) == (0, 4)
        assert out[1:] == [RequestReplay(5)]


def test_without_snapshots_advertised_the_gap_is_a_loss_as_before() -> None:
    """A stream whose publisher does not advertise snapshots never asks for one."""
    t = tracker(snapshot=False)
    out = t.on_replay_reply(50, p(50))
    assert isinstance(out[0], Loss) and (out[0].first_seq, out[0].last_seq) == (0, 49)
    assert out[1] == Deliver(50, p(50), True)
    assert not any(isinstance(a, RequestSnapshot) for a in out)


# --- discovery -----------------------------------------------------------------------------


def test_discovery_carries_the_advertisement_to_streams_with_replay_only() -> None:
    """``snapshot: true`` in the kv_events block marks every stream that has a replay
    endpoint; a block without it (upstream SGLang's) marks none."""
    block: dict[str, Any] = {
        "publisher": "zmq",
        "endpoint_host": "127.0.0.1",
        "endpoint_port_base": 5557,
        "replay_endpoint_port_base": 5600,
        "dp_size": 2,
    }
    url = "http://127.0.0.1:30000"
    marked = streams_from_server_info({"kv_events": block | {"snapshot": True}}, engine_url=url)
    plain = streams_from_server_info({"kv_events": block}, engine_url=url)
    no_replay = {k: v for k, v in block.items() if k != "replay_endpoint_port_base"}
    unreplayed = streams_from_server_info(
        {"kv_events": no_replay | {"snapshot": True}}, engine_url=url
    )
    assert [s.snapshot for s in marked] == [True, True]
    assert [s.snapshot for s in plain] == [False, False]
    assert [s.snapshot for s in unreplayed] == [False, False]


def test_a_described_engine_says_it_serves_snapshots_beside_its_replay_endpoint() -> None:
    """``snapshot: true`` in an engine's description marks its streams; without a replay
    endpoint, or for an engine to discover, it is refused naming what is missing."""
    spec = EngineSpec.create(
        "http://127.0.0.1:8000",
        kv_endpoint="tcp://*:5557",
        replay_endpoint="tcp://*:5600",
        dp_size=2,
        snapshot=True,
    )
    assert [s.snapshot for s in spec.streams()] == [True, True]
    with pytest.raises(ConfigError, match="snapshot=true needs replay_endpoint"):
        EngineSpec.create("http://127.0.0.1:8000", kv_endpoint="tcp://*:5557", snapshot=True)
    with pytest.raises(ConfigError, match="snapshot given without kv_endpoint"):
        EngineSpec.create("http://127.0.0.1:8000", snapshot=True)


# --- real sockets --------------------------------------------------------------------------


def one_block(n: int) -> KVEventBatch:
    return KVEventBatch(
        ts=time.time(),
        events=[
            BlockStored(
                block_hashes=[n],
                parent_block_hash=None,
                token_ids=[n, n + 1],
                block_size=2,
                lora_id=None,
                medium=None,
            )
        ],
    )


def test_a_subscriber_that_joins_after_the_buffer_wrapped_gets_the_whole_state(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Against a publisher with snapshots whose buffer holds 5 of 40 batches, a late
    subscriber gets a Resync and the state at seq 39 in one delivery, then live batches:
    its index holds all 40 blocks and nothing is reported lost."""
    pub = ZmqEventPublisher(
        0,
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:0",
        bind=True,
        buffer_steps=5,
        snapshot=True,
        context=zmq_context,
    )
    try:
        for n in range(40):
            pub.publish(one_block(n))
        assert pub.flush(10)
        spec = StreamSpec.from_endpoint(
            pub.endpoint, replay_endpoint=pub.replay_endpoint, worker="late", snapshot=True
        )
        index = PrefixIndex()
        with Subscriber(streams=[spec], context=zmq_context) as sub:
            items = collect(sub, until=lambda got: len(deliveries(got)) == 1)
            pub.publish(one_block(40))
            items += collect(sub, until=lambda got: len(deliveries(got)) == 1)
            stats = sub.stats()[Holder("late", 0)]
        for item in items:
            if isinstance(item, Delivery):
                index.apply(item.holder, item.batch)
        assert [type(i).__name__ for i in items if type(i).__name__ != "Unreachable"] == [
            "Resync",
            "Delivery",
            "Delivery",
        ]
        assert [d.seq for d in deliveries(items)] == [39, 40]
        assert index.holder_hashes(Holder("late", 0)) == set(range(41))
        assert (stats.lost, stats.snapshots, stats.snapshot_failures) == (0, 1, 0)
        assert pub.stats.snapshots == 1
    finally:
        pub.shutdown()


def play_publisher(
    sub: Subscriber,
    router: zmq.Socket[bytes],
    buffer: dict[int, bytes],
    snapshot_answer: list[list[bytes]],
    *,
    until: Any,
    timeout: float = 15.0,
) -> tuple[list[Item], list[list[bytes]]]:
    """Play a publisher's replay socket whose buffer wrapped (it holds ``buffer``):
    answer replays from it, a snapshot request with ``snapshot_answer``; collect the
    subscriber's items until ``until(items)``. Returns the items and every request."""
    items: list[Item] = []
    requests: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while not until(items):
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {items[-5:]}"
        if router.poll(20):
            frames = router.recv_multipart()
            requests.append(frames)
            identity = frames[0]
            if is_snapshot_request(frames):
                for answer in snapshot_answer:
                    router.send_multipart([identity, *answer])
            else:
                _, start = parse_replay_request(frames)
                for seq in sorted(s for s in buffer if s >= start):
                    router.send_multipart([identity, *replay_reply_frames(b"", seq, buffer[seq])])
                router.send_multipart([identity, *replay_end_frames()])
        item = sub.get(timeout=0.02)
        if item is not None:
            items.append(item)
    return items, requests


def wrapped_publisher_run(
    zmq_context: zmq.Context[zmq.Socket[bytes]], snapshot: bool, answer: list[list[bytes]]
) -> tuple[list[Item], list[list[bytes]], Any]:
    """A subscriber joining a raw publisher whose replay buffer holds seqs 5 and 6 only."""
    xpub, live = bind_local(zmq_context, zmq.XPUB)
    router, replay = bind_local(zmq_context, zmq.ROUTER)
    buffer = {seq: encode_batch(one_block(seq)) for seq in (5, 6)}
    spec = StreamSpec.from_endpoint(live, replay_endpoint=replay, worker="w", snapshot=snapshot)
    try:
        with Subscriber(streams=[spec], context=zmq_context, replay_timeout=1.0) as sub:
            wait_subscribed(xpub)
            items, requests = play_publisher(
                sub,
                router,
                buffer,
                answer,
                until=lambda got: [d.seq for d in deliveries(got)] == [5, 6],
            )
            stats = sub.stats()[Holder("w", 0)]
    finally:
        xpub.close()
        router.close()
    return items, requests, stats


def test_a_publisher_that_does_not_advertise_snapshots_is_never_asked_for_one(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Against an upstream-like publisher whose buffer wrapped, every request the
    subscriber sends is a replay request of 8-byte seq, and the missed seqs are a Loss."""
    items, requests, stats = wrapped_publisher_run(zmq_context, False, [])
    assert requests and all(
        len(r) == 3 and r[1] == b"" and len(r[2]) == 8 and SNAPSHOT_TAG not in r for r in requests
    )
    (loss,) = signals(items, "loss")
    assert isinstance(loss, Loss) and (loss.first_seq, loss.last_seq) == (0, 4)
    assert (stats.lost, stats.snapshots) == (5, 0)


def test_malformed_snapshot_frames_are_counted_skipped_and_the_gap_is_lost(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A part that does not decode and a frame of an unknown kind are counted as malformed
    and skipped; the snapshot, short of its parts, is a failure: the gap is reported lost
    with the reason and replay goes on from the first seq buffered."""
    answer = [
        snapshot_part_frames(9, b"\xc1 not msgpack"),
        [b"", SNAPSHOT_TAG, b"bogus", encode_seq(9), b""],
        snapshot_end_frames(9, 2),
    ]
    items, requests, stats = wrapped_publisher_run(zmq_context, True, answer)
    assert sum(is_snapshot_request(r) for r in requests) == 1
    malformed = signals(items, "malformed")
    assert sum(m.count for m in malformed) == 2  # type: ignore[attr-defined]
    (loss,) = signals(items, "loss")
    assert (loss.first_seq, loss.last_seq) == (0, 4)  # type: ignore[attr-defined]
    assert "no snapshot" in loss.reason and "could not be decoded" in loss.reason  # type: ignore[attr-defined]
    assert not signals(items, "resync")
    assert (stats.malformed, stats.snapshot_failures, stats.snapshots) == (2, 1, 0)


def test_an_unavailable_snapshot_reports_the_publishers_reason(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A publisher that answers "unavailable" has its reason in the Loss the gap becomes."""
    answer = [snapshot_unavailable_frames("over its bound")]
    items, _, stats = wrapped_publisher_run(zmq_context, True, answer)
    (loss,) = signals(items, "loss")
    assert "the publisher has none (over its bound)" in loss.reason  # type: ignore[attr-defined]
    assert (stats.snapshot_failures, stats.malformed) == (1, 0)


def test_a_whole_snapshot_from_a_raw_publisher_is_delivered_as_one_batch(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Two parts and their end, at seq 6, become a Resync and one delivery holding both
    parts' events, in order; the replayed seqs 5 and 6 are not delivered again."""
    parts = [encode_batch(one_block(100)), encode_batch(one_block(101))]
    answer = [*(snapshot_part_frames(6, part) for part in parts), snapshot_end_frames(6, 2)]
    xpub, live = bind_local(zmq_context, zmq.XPUB)
    router, replay = bind_local(zmq_context, zmq.ROUTER)
    buffer = {seq: encode_batch(one_block(seq)) for seq in (5, 6)}
    spec = StreamSpec.from_endpoint(live, replay_endpoint=replay, worker="w", snapshot=True)
    try:
        with Subscriber(streams=[spec], context=zmq_context, replay_timeout=1.0) as sub:
            wait_subscribed(xpub)
            items, _ = play_publisher(
                sub, router, buffer, answer, until=lambda got: bool(deliveries(got))
            )
            xpub.send_multipart([b"", encode_seq(7), encode_batch(one_block(7))])
            more, _ = play_publisher(
                sub, router, buffer, answer, until=lambda got: bool(deliveries(got))
            )
    finally:
        xpub.close()
        router.close()
    (resync,) = signals(items, "resync")
    assert isinstance(resync, Resync) and resync.new_seq == 6
    (state,) = deliveries(items)
    assert state.seq == 6
    assert [e.block_hashes for e in state.batch.events] == [[100], [101]]  # type: ignore[union-attr]
    assert [d.seq for d in deliveries(more)] == [7]
    assert not signals(items + more, "loss")
