"""A stream asks the replay socket what it missed when its connection comes up and while
it stays quiet, over real sockets: an engine started after its router loses no batch."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest
import zmq

from kvevents import (
    BlockStored,
    Holder,
    KVEventBatch,
    StreamSpec,
    Subscriber,
    ZmqEventPublisher,
)
from kvevents.wire.codec import encode_batch
from kvevents.wire.frames import (
    live_frames,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
)
from subscriber_support import Item, bind_local, collect, deliveries, signals, wait_subscribed

TOPIC = b"kv"

# Seconds from the subscriber's start to the engine's bind. With the default settings the
# subscriber's first replay requests (the join, then one tail probe) time out by then, and
# the SUB, backing off, connects only after the engine's first batch is sent.
LATE_BIND = 5.0


def batch(n: int) -> KVEventBatch:
    """A one-block batch whose hash is ``n``."""
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


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports the OS reports free (all held open until read)."""
    held = [socket.socket() for _ in range(n)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


def drain_until(sub: Subscriber, deadline: float) -> list[Item]:
    """Every item ``sub`` gives until the monotonic ``deadline``."""
    items: list[Item] = []
    while (remaining := deadline - time.monotonic()) > 0:
        item = sub.get(timeout=remaining)
        if item is not None:
            items.append(item)
    return items


def late_engine_run(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
    bind_after: float,
    *,
    then_live: bool,
    **options: float | None,
) -> list[Item]:
    """Subscribe to ports where nothing listens, bind a publisher there ``bind_after``
    seconds later and publish one batch at once, then (``then_live``) a second once the
    first arrived; the subscriber's items up to a quiet while after the last."""
    live, replay = (f"tcp://127.0.0.1:{port}" for port in free_ports(2))
    spec = StreamSpec(worker="late", dp_rank=0, endpoint=live, replay_endpoint=replay)
    start = time.monotonic()
    pub: ZmqEventPublisher | None = None
    with Subscriber(streams=[spec], **options) as sub:  # type: ignore[arg-type]
        try:
            items = drain_until(sub, start + bind_after)
            assert signals(items, "unreachable"), items  # nothing listened before the bind
            pub = ZmqEventPublisher(0, live, replay, bind=True, context=zmq_context)
            pub.publish(batch(0))
            items += collect(sub, until=lambda got: len(deliveries(got)) == 1, timeout=20.0)
            if then_live:
                pub.publish(batch(1))
                items += collect(sub, until=lambda got: len(deliveries(got)) == 1, timeout=20.0)
            # a quiet while longer than the tail probe: a duplicate would show here
            items += drain_until(sub, time.monotonic() + 1.5)
            assert sub.stats()[Holder("late", 0)].lost == 0
        finally:
            if pub is not None:
                pub.shutdown(timeout=1.0)
    return items


@pytest.mark.slow
def test_an_engine_started_after_the_subscriber_has_its_first_batch_delivered(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """With the default settings, an engine that binds well after the subscriber started
    and publishes one batch at once has that batch delivered, once, then the next one."""
    items = late_engine_run(zmq_context, LATE_BIND, then_live=True)
    assert [d.seq for d in deliveries(items)] == [0, 1]
    assert [d.batch.events[0].block_hashes for d in deliveries(items)] == [[0], [1]]  # type: ignore[union-attr]
    assert [s.kind for s in signals(items) if s.kind != "unreachable"] == []


@pytest.mark.slow
def test_the_connection_alone_asks_for_a_batch_sent_before_the_sub_connected(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """With quiet checks off, the check made when the connection comes up is what
    delivers a batch published before the SUB, backing off, connected, and only once.
    (No live batch follows: with quiet checks off, one sent before the subscription
    reached the publisher would be missed.)"""
    items = late_engine_run(
        zmq_context, 2.2, then_live=False, replay_timeout=0.5, tail_probe=None, idle_check=None
    )
    assert [d.seq for d in deliveries(items)] == [0]
    assert [s.kind for s in signals(items) if s.kind != "unreachable"] == []


def serve(
    sub: Subscriber,
    router: zmq.Socket[bytes],
    buffer: dict[int, bytes],
    *,
    answer: bool,
    until: Callable[[list[Item], list[int]], bool],
    timeout: float = 10.0,
) -> tuple[list[Item], list[int]]:
    """Play the publisher's replay socket (answering from ``buffer``, or not at all) while
    collecting the subscriber's items, until ``until(items, starts)``; the items and the
    start seqs asked for."""
    items: list[Item] = []
    starts: list[int] = []
    deadline = time.monotonic() + timeout
    while not until(items, starts):
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s: {items[-5:]}, asked {starts}")
        if router.poll(20):
            identity, start = parse_replay_request(router.recv_multipart())
            starts.append(start)
            if answer:
                for seq in sorted(s for s in buffer if s >= start):
                    router.send_multipart([identity, *replay_reply_frames(TOPIC, seq, buffer[seq])])
                router.send_multipart([identity, *replay_end_frames()])
        item = sub.get(timeout=0.02)
        if item is not None:
            items.append(item)
    return items, starts


@pytest.mark.slow
def test_a_quiet_stream_keeps_asking_and_recovers_a_batch_its_sub_missed(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A quiet stream whose checks go unanswered for a while keeps asking from the next
    expected seq, so a batch its SUB never received is delivered once the replay socket
    answers; its late live copy is not delivered twice."""
    xpub, live = bind_local(zmq_context, zmq.XPUB)
    router, replay = bind_local(zmq_context, zmq.ROUTER)
    buffer: dict[int, bytes] = {}  # the publisher's replay buffer
    spec = StreamSpec.from_endpoint(live, replay_endpoint=replay, topic=TOPIC.decode())
    sub = Subscriber(streams=[spec], replay_timeout=0.3, tail_probe=0.2, idle_check=0.4)
    try:
        wait_subscribed(xpub)
        buffer[0] = encode_batch(batch(0))
        xpub.send_multipart(live_frames(TOPIC, 0, buffer[0]))
        items, _ = serve(sub, router, buffer, answer=True, until=lambda i, _: bool(deliveries(i)))

        # The replay socket stops answering; the quiet stream's checks go on.
        more, starts = serve(sub, router, buffer, answer=False, until=lambda _, s: s.count(1) >= 3)
        items += more
        # Seq 1 is published, and the SUB misses it: no gap ever shows it.
        buffer[1] = encode_batch(batch(1))
        more, starts = serve(
            sub, router, buffer, answer=True, until=lambda i, _: len(deliveries(i)) == 1
        )
        items += more
        assert starts[-1] == 1

        buffer[2] = encode_batch(batch(2))
        for seq in (1, 2):  # the live copy of seq 1 comes late, then seq 2
            xpub.send_multipart(live_frames(TOPIC, seq, buffer[seq]))
        more, _ = serve(
            sub, router, buffer, answer=True, until=lambda i, _: len(deliveries(i)) == 1
        )
        items += more
        assert [d.seq for d in deliveries(items)] == [0, 1, 2]
        assert signals(items) == []
    finally:
        sub.close()
        xpub.close()
        router.close()
