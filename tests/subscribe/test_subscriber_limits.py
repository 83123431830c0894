"""What a subscriber refuses: oversized frames, impossible seqs, malformed frames, as signals."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
import zmq

from kvevents.publish.zmq_publisher import ZmqEventPublisher
from kvevents.subscribe.discovery import StreamSpec
from kvevents.subscribe.items import Malformed
from kvevents.subscribe.subscriber import DEFAULT_MAX_MESSAGE_SIZE, Subscriber
from kvevents.types import Holder
from kvevents.wire.codec import encode_batch
from kvevents.wire.events import BlockStored, KVEventBatch
from kvevents.wire.frames import live_frames
from subscriber_support import (
    bind_local,
    collect,
    deliveries,
    signals,
    wait_for,
    wait_subscribed,
)


def batch(n: int, tokens: int = 2) -> KVEventBatch:
    return KVEventBatch(
        ts=1.0 + n,
        events=[
            BlockStored(
                block_hashes=[n],
                parent_block_hash=None,
                token_ids=[7] * tokens,
                block_size=tokens,
                lora_id=None,
                medium=None,
            )
        ],
    )


@pytest.mark.slow
def test_an_oversized_frame_is_dropped_and_reported_lost_while_the_stream_goes_on(
    zmq_context: zmq.Context,
) -> None:
    """With max_message_size=64 KiB, a ~400 KB batch is never taken in, live or replayed:
    its seq is one Loss, and the batches after it arrive."""
    pub = ZmqEventPublisher(
        0, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", bind=True, context=zmq_context
    )
    try:
        spec = StreamSpec(
            worker="w", dp_rank=0, endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint
        )
        with Subscriber(streams=[spec], max_message_size=64 << 10, replay_timeout=0.5) as sub:
            for n in range(3):
                pub.publish(batch(n))
            collect(sub, until=lambda got: len(deliveries(got)) == 3)
            pub.publish(batch(3, tokens=100_000))
            # The frame ends the live connection; the subscriber reconnects and its
            # verifying replay meets the same frame, which ends that socket too.
            wait_for(lambda: sub.stats()[Holder("w", 0)].replay_timeouts >= 1, 20, "a replay")
            for n in range(4, 7):
                pub.publish(batch(n))
            items = collect(sub, until=lambda got: len(deliveries(got)) == 3)
            assert [d.seq for d in deliveries(items)] == [4, 5, 6]
            assert [(x.first_seq, x.last_seq) for x in signals(items, "loss")] == [(3, 3)]
            assert not signals(items, "reset")
            assert sub.stats()[Holder("w", 0)].lost == 1
    finally:
        pub.shutdown(timeout=1.0)


def test_max_message_size_is_checked() -> None:
    """0 or a negative size other than -1 (no limit) is refused naming the option; 64 MiB by default."""
    assert DEFAULT_MAX_MESSAGE_SIZE == 64 << 20
    for bad in (0, -2):
        with pytest.raises(ValueError, match="max_message_size"):
            Subscriber(max_message_size=bad)


def test_an_impossible_seq_is_malformed_not_a_loss_of_1e19_batches(
    zmq_context: zmq.Context,
) -> None:
    """seq 2**64-1 (the replay end marker) and a jump past 2**40 on the live stream are skipped
    as Malformed; the next real seq follows with no Loss and no Reset."""
    xpub, address = bind_local(zmq_context, zmq.XPUB)
    try:
        with Subscriber(streams=[StreamSpec.from_endpoint(address, worker="g")]) as sub:
            wait_subscribed(xpub)
            xpub.send_multipart(live_frames(b"", 0, encode_batch(batch(0))))
            xpub.send_multipart(live_frames(b"", 2**64 - 1, encode_batch(batch(9))))
            xpub.send_multipart(live_frames(b"", 2**41, encode_batch(batch(9))))
            xpub.send_multipart([b"", b"\x00" * 8])  # two frames
            xpub.send_multipart(live_frames(b"", 1, encode_batch(batch(1))))
            items = collect(sub, until=lambda got: len(deliveries(got)) == 2)
            assert [d.seq for d in deliveries(items)] == [0, 1]
            bad = [s for s in signals(items) if isinstance(s, Malformed)]
            assert sum(s.count for s in bad) == 3 and {s.source for s in bad} == {"live"}
            assert "cannot follow seq 0" in bad[0].reason
            assert not signals(items, "loss") and not signals(items, "reset")
            stats = sub.stats()[Holder("g", 0)]
            assert stats.malformed == 3 and stats.lost == 0 and stats.last_seq == 1
    finally:
        xpub.close(linger=0)


def test_a_stream_zmq_refuses_shows_refused_and_its_holder_can_be_added_again(
    zmq_context: zmq.Context,
) -> None:
    """An address ZMQ will not take is an Unreachable item, and the stream's stats say
    ``refused`` with the reason (they said ``connecting`` for ever); the same holder can
    then be followed at a working address (it was "already followed")."""
    bad = StreamSpec(worker="w", dp_rank=0, endpoint="tcp://a b:5557", replay_endpoint=None)
    pub = ZmqEventPublisher(0, "tcp://127.0.0.1:0", None, bind=True, context=zmq_context)
    try:
        with Subscriber(streams=[bad], tail_probe=None) as sub:
            items = collect(sub, until=lambda got: bool(signals(got, "unreachable")))
            assert "not followed" in signals(items, "unreachable")[0].reason  # type: ignore[attr-defined]
            stats = sub.stats()[Holder("w", 0)]
            assert stats.status == "refused" and "ZMQ refused" in (stats.error or "")
            sub.add_stream(StreamSpec(worker="w", dp_rank=0, endpoint=pub.endpoint))
            # given again, maybe before the loop took the first: then the later wins, and
            # nothing leaks (two streams for one holder kept the context from closing);
            # after, it is "already followed"
            with contextlib.suppress(ValueError):
                sub.add_stream(StreamSpec(worker="w", dp_rank=0, endpoint=pub.endpoint))
            wait_for(lambda: sub.stats()[Holder("w", 0)].status == "connected", 20, "it")

            def published(got: list[object]) -> bool:
                pub.publish(batch(len(got)))
                return bool(deliveries(got))  # type: ignore[arg-type]

            collect(sub, until=published)
            assert sub.stats()[Holder("w", 0)].error is None
    finally:
        pub.shutdown(timeout=1.0)


def test_a_newer_engines_event_type_is_counted_and_the_rest_delivered(
    zmq_context: zmq.Context,
) -> None:
    """A batch with an event type this subscriber does not know is delivered without it
    (no Loss, so the router keeps the holder's entries), and the stream's stats count it
    and name the type."""
    xpub, address = bind_local(zmq_context, zmq.XPUB)
    try:
        with Subscriber(streams=[StreamSpec.from_endpoint(address, worker="g")]) as sub:
            wait_subscribed(xpub)
            stored = msgspec.to_builtins(batch(0).events[0]) | {"type": "BlockStored"}
            future = {"type": "BlockPinned", "block_hashes": [0]}
            payload = msgspec.msgpack.encode([1.0, [stored, future], 0])
            xpub.send_multipart(live_frames(b"", 0, payload))
            items = collect(sub, until=lambda got: len(deliveries(got)) == 1)
            assert deliveries(items)[0].batch.events == batch(0).events
            assert not signals(items, "loss")
            stats = sub.stats()[Holder("g", 0)]
            assert (stats.unknown_events, stats.unknown_event_type) == (1, "BlockPinned")
            assert stats.decode_errors == 0
    finally:
        xpub.close(linger=0)
