"""The Subscriber against the real ZmqEventPublisher: order, replay, loss, reset, over tcp and ipc."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from kvevents import (
    BlockStored,
    Delivery,
    EndpointError,
    Holder,
    KVEventBatch,
    Loss,
    Reset,
    StreamSpec,
    Subscriber,
    SubscriberStateError,
    Unreachable,
    ZmqEventPublisher,
)
from kvevents.subscribe.stream_sockets import StreamSockets
from kvevents.wire.codec import encode_batch
from kvevents.wire.frames import live_frames
from subscriber_support import collect, deliveries, signals, wait_for

Factory = Callable[..., ZmqEventPublisher]


def batch(n: int, gen: int = 0) -> KVEventBatch:
    """A one-block batch whose hash encodes (generation, n), so content can be checked."""
    return KVEventBatch(
        ts=1.0 + n,
        events=[
            BlockStored(
                block_hashes=[gen * 1_000_000 + n],
                parent_block_hash=None,
                token_ids=[n, n + 1],
                block_size=2,
                lora_id=None,
                medium=None,
            )
        ],
    )


def hashes(items: list) -> list[int]:
    return [d.batch.events[0].block_hashes[0] for d in deliveries(items)]


@pytest.fixture(params=["tcp", "ipc"])
def endpoints(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A (live, replay) endpoint pair to bind: tcp on OS-chosen loopback ports, or ipc paths."""
    if request.param == "tcp":
        yield "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
    else:
        yield f"ipc://{tmp_path}/live", f"ipc://{tmp_path}/replay"


@pytest.fixture
def make_publisher(zmq_context: zmq.Context) -> Iterator[Factory]:
    """Builds publishers bound on the given endpoints; shuts every one down after the test."""
    made: list[ZmqEventPublisher] = []

    def make(endpoint: str, replay_endpoint: str | None, **kw: object) -> ZmqEventPublisher:
        pub = ZmqEventPublisher(0, endpoint, replay_endpoint, bind=True, context=zmq_context, **kw)
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.shutdown(timeout=1.0)


def rebind(make: Factory, old: ZmqEventPublisher, timeout: float = 10.0) -> ZmqEventPublisher:
    """A new publisher on a shut-down one's addresses (ZMQ frees a port asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return make(old.endpoint, old.replay_endpoint)
        except EndpointError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def spec_for(pub: ZmqEventPublisher, worker: str = "w", replay: bool = True) -> StreamSpec:
    return StreamSpec(
        worker=worker,
        dp_rank=0,
        endpoint=pub.endpoint,
        replay_endpoint=pub.replay_endpoint if replay else None,
    )


def test_slow_joiner_gets_everything_published_before_it_connected(
    endpoints: tuple[str, str], make_publisher: Factory
) -> None:
    """Batches published before the subscriber existed are replayed from seq 0, then live ones follow in order."""
    pub = make_publisher(*endpoints)
    for n in range(50):
        pub.publish(batch(n))
    # Sent, not just queued, before the subscriber exists: the PUB drops them, so only
    # replay can deliver them (a sender thread slow to start would send them live).
    assert pub.flush(timeout=10.0)
    with Subscriber(streams=[spec_for(pub)]) as sub:
        items = collect(sub, until=lambda got: len(deliveries(got)) == 50)
        for n in range(50, 80):
            pub.publish(batch(n))
        items += collect(sub, until=lambda got: len(deliveries(got)) == 30)
        assert [d.seq for d in deliveries(items)] == list(range(80))
        assert hashes(items) == list(range(80))
        assert signals(items) == []
        stats = sub.stats()[Holder("w", 0)]
        assert stats.replayed >= 50 and stats.lost == 0 and stats.last_seq == 79


@pytest.mark.slow
def test_burst_through_tiny_receive_hwm_is_delivered_exactly(
    endpoints: tuple[str, str], make_publisher: Factory
) -> None:
    """A burst of thousands of batches through 4-message high-water marks arrives as the published stream: every seq once, in order."""
    pub = make_publisher(*endpoints, hwm=4)
    # max_buffered=8: the socket thread stalls until the test reads, so the HWMs overflow
    with Subscriber(streams=[spec_for(pub)], rcvhwm=4, max_buffered=8) as sub:
        wait_for(lambda: sub.stats()[Holder("w", 0)].status == "connected", what="connection")
        total = 5000
        for n in range(total):
            pub.publish(batch(n))
        items = collect(sub, until=lambda got: len(deliveries(got)) == total, timeout=60)
        assert [d.seq for d in deliveries(items)] == list(range(total))
        assert hashes(items) == list(range(total))
        assert signals(items, "loss") == [] and signals(items, "reset") == []
        stats = sub.stats()[Holder("w", 0)]
        assert stats.lost == 0 and stats.batches == total
        assert stats.gaps > 0 and stats.replayed > 0, "the burst should have needed replay"
        assert len(signals(items, "gap")) == stats.gaps


@pytest.mark.slow
def test_burst_larger_than_replay_buffer_is_a_loss_then_following_resumes(
    endpoints: tuple[str, str], make_publisher: Factory
) -> None:
    """When a burst overruns the publisher's replay buffer, a Loss covers the unrecoverable seqs and later batches still arrive."""
    pub = make_publisher(*endpoints, buffer_steps=50, hwm=2)
    with Subscriber(streams=[spec_for(pub)], rcvhwm=2, max_buffered=8) as sub:
        wait_for(lambda: sub.stats()[Holder("w", 0)].status == "connected", what="connection")
        total = 4000
        for n in range(total):
            pub.publish(batch(n))

        def accounted(got: list) -> bool:
            covered = len(deliveries(got)) + sum(x.count for x in signals(got, "loss"))
            return covered >= total

        items = collect(sub, until=accounted, timeout=60)
        assert signals(items, "loss"), "a burst 80x the replay buffer through HWM 2 must lose some"
        # delivered and lost seqs partition 0..total-1, in order
        covered: list[int] = []
        for item in items:
            if isinstance(item, Delivery):
                covered.append(item.seq)
            elif isinstance(item, Loss):
                covered.extend(range(item.first_seq, item.last_seq + 1))
        assert covered == list(range(total))
        for d in deliveries(items):
            assert d.batch.events[0].block_hashes == [d.seq]
        for n in range(total, total + 10):
            pub.publish(batch(n))
        more = collect(sub, until=lambda got: len(deliveries(got)) == 10)
        assert [d.seq for d in deliveries(more)] == list(range(total, total + 10))


@pytest.mark.slow
def test_without_replay_endpoint_a_gap_is_reported_as_loss(
    endpoints: tuple[str, str], make_publisher: Factory
) -> None:
    """A stream with no replay endpoint reports what the tiny HWM dropped as Loss and keeps following."""
    pub = make_publisher(endpoints[0], None, hwm=2)
    with Subscriber(streams=[spec_for(pub, replay=False)], rcvhwm=2, max_buffered=8) as sub:
        wait_for(lambda: sub.stats()[Holder("w", 0)].status == "connected", what="connection")
        for n in range(2000):
            pub.publish(batch(n))
        items = []
        while (item := sub.get(timeout=0.5)) is not None:  # until the burst has drained
            items.append(item)
        pub.publish(batch(2000))  # without replay, only a later message reveals a lost tail
        items += collect(sub, until=lambda got: any(d.seq == 2000 for d in deliveries(got)))
        losses = signals(items, "loss")
        assert losses and all("no replay endpoint" in x.reason for x in losses)
        covered: list[int] = []
        for item in items:
            if isinstance(item, Delivery):
                covered.append(item.seq)
            elif isinstance(item, Loss):
                covered.extend(range(item.first_seq, item.last_seq + 1))
        assert covered == list(range(2001))


def test_restarted_publisher_gives_reset_for_that_stream_only(
    endpoints: tuple[str, str], make_publisher: Factory
) -> None:
    """Restarting one of two publishers on the same endpoints resets only its stream, which is then followed from seq 0."""
    a = make_publisher(*endpoints)
    other = make_publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    specs = [spec_for(a, "a"), spec_for(other, "other")]
    with Subscriber(streams=specs, retry_max=0.5) as sub:
        for n in range(6):
            a.publish(batch(n))
            other.publish(batch(n))
        items = collect(sub, until=lambda got: len(deliveries(got)) == 12)
        a.shutdown(timeout=1.0)
        b = rebind(make_publisher, a)  # the same addresses, a new stream
        wait_for(lambda: sub.stats()[Holder("a", 0)].status == "connected", what="reconnect")
        for n in range(3):
            b.publish(batch(n, gen=1))
        other.publish(batch(6))
        items = collect(
            sub,
            until=lambda got: (
                len([d for d in deliveries(got) if d.holder.worker == "a"]) == 3
                and len(deliveries(got)) == 4
            ),
        )
        resets = signals(items, "reset")
        assert [r.holder for r in resets] == [Holder("a", 0)]
        assert isinstance(resets[0], Reset) and resets[0].last_seq == 5
        new = [d for d in deliveries(items) if d.holder.worker == "a"]
        assert [d.seq for d in new] == [0, 1, 2]
        assert [d.batch.events[0].block_hashes[0] for d in new] == [1_000_000, 1_000_001, 1_000_002]
        assert items.index(resets[0]) < items.index(new[0])
        assert [d.seq for d in deliveries(items) if d.holder.worker == "other"] == [6]


def test_restart_that_already_published_past_our_seq_is_still_a_reset(
    endpoints: tuple[str, str], make_publisher: Factory
) -> None:
    """A restarted publisher whose new seqs already passed ours (looks like a forward gap) is detected by its replay and reset."""
    a = make_publisher(*endpoints)
    with Subscriber(streams=[spec_for(a)], retry_max=0.5) as sub:
        for n in range(3):
            a.publish(batch(n))
        collect(sub, until=lambda got: len(deliveries(got)) == 3)
        a.shutdown(timeout=1.0)
        b = rebind(make_publisher, a)
        for n in range(8):  # published before the subscriber reconnects: seqs 0..7
            b.publish(batch(n, gen=1))
        items = collect(sub, until=lambda got: len(deliveries(got)) == 8)
        assert len(signals(items, "reset")) == 1
        assert [d.seq for d in deliveries(items)] == list(range(8))
        assert hashes(items) == [1_000_000 + n for n in range(8)]
        assert signals(items, "loss") == []


def test_garbage_frames_are_counted_and_skipped(zmq_context: zmq.Context) -> None:
    """Malformed frames and an undecodable payload are counted; the stream continues in order."""
    xpub = zmq_context.socket(zmq.XPUB)
    xpub.bind("tcp://127.0.0.1:0")
    address = xpub.last_endpoint.decode()
    from kvevents.wire.codec import encode_batch
    from kvevents.wire.frames import live_frames

    try:
        with Subscriber(streams=[StreamSpec.from_endpoint(address, worker="g")]) as sub:
            assert xpub.poll(10_000)
            xpub.recv()
            for n in range(3):
                xpub.send_multipart(live_frames(b"", n, encode_batch(batch(n))))
            xpub.send_multipart([b"", b"\x00" * 8])  # two frames
            xpub.send_multipart([b"", b"\x00\x03", b"x"])  # 2-byte seq
            xpub.send_multipart([b"", b"a", b"b", b"c"])  # four frames
            xpub.send_multipart(live_frames(b"", 3, b"\xc1 not msgpack"))  # bad payload
            for n in range(4, 7):
                xpub.send_multipart(live_frames(b"", n, encode_batch(batch(n))))
            items = collect(sub, until=lambda got: len(deliveries(got)) == 6)
            assert [d.seq for d in deliveries(items)] == [0, 1, 2, 4, 5, 6]
            losses = signals(items, "loss")
            assert [(x.first_seq, x.last_seq) for x in losses] == [(3, 3)]
            assert "could not be decoded" in losses[0].reason
            stats = sub.stats()[Holder("g", 0)]
            assert stats.malformed == 3 and stats.decode_errors == 1
    finally:
        xpub.close(linger=0)


def test_unreachable_endpoint_is_reported_and_never_blocks_others(make_publisher: Factory) -> None:
    """A stream whose endpoint never comes up is reported Unreachable while the other stream delivers."""
    # a port bound and never listened on, held for the whole test: released, the OS
    # could hand it to the live publisher's port-0 bind below, and "dead" would answer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        live = make_publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        dead_spec = StreamSpec(worker="dead", dp_rank=0, endpoint=dead, replay_endpoint=dead)
        with Subscriber(streams=[dead_spec, spec_for(live, "live")], replay_timeout=0.5) as sub:
            for n in range(20):
                live.publish(batch(n))
            items = collect(
                sub,
                until=lambda got: len(deliveries(got)) == 20 and bool(signals(got, "unreachable")),
            )
            unreachable = signals(items, "unreachable")
            assert isinstance(unreachable[0], Unreachable) and unreachable[0].address == dead
            assert {d.holder for d in deliveries(items)} == {Holder("live", 0)}
            assert sub.stats()[Holder("dead", 0)].status == "unreachable"


@pytest.mark.slow
def test_replay_endpoint_given_as_live_is_refused_not_connected(make_publisher: Factory) -> None:
    """A publisher's replay (ROUTER) endpoint given as a stream's live one: ZMQ drops the
    connection mid-handshake, often without a handshake event. The stream is reported
    once, says why, never shows "connected", and retries at the retry pace, not in a
    loop; the other stream delivers."""
    pub = make_publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    assert pub.replay_endpoint is not None
    typo = StreamSpec(worker="typo", dp_rank=0, endpoint=pub.replay_endpoint)
    started = time.monotonic()
    with Subscriber(streams=[typo, spec_for(pub, "good")], retry_max=0.5) as sub:
        statuses: set[str] = set()

        def done(got: list) -> bool:
            statuses.add(sub.stats()[Holder("typo", 0)].status)
            return len(deliveries(got)) == 10 and bool(signals(got, "unreachable"))

        for n in range(10):
            pub.publish(batch(n))
        items = collect(sub, until=done)
        (unreachable,) = signals(items, "unreachable")
        assert unreachable.worker == "typo" and "not a PUB socket" in unreachable.reason
        assert {d.holder for d in deliveries(items)} == {Holder("good", 0)}
        time.sleep(1.5)
        statuses.add(sub.stats()[Holder("typo", 0)].status)
        stats = sub.stats()[Holder("typo", 0)]
        # attempts at most every 100 ms (libzmq's own reconnect interval; ours waits
        # retry_max): a loop that reconnected at once would make thousands
        assert 1 <= stats.handshake_failures <= 2 + (time.monotonic() - started) / 0.1
        assert "connected" not in statuses and stats.status == "refused"
        assert "not a PUB socket" in (stats.handshake_error or "")
        assert sub.get(timeout=0.2) is None  # reported once: no signal per retry


@pytest.mark.slow
def test_a_stream_recovered_after_a_refused_handshake_is_not_reconnected_later(
    make_publisher: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first connection is dropped mid-handshake (a listener that accepts and
    closes: a publisher restarting, a proxy whose upstream is not up), then the real
    publisher answers on that port and libzmq's own reconnect succeeds. The stream must
    keep that connection: a reconnect of ours at ``retry_max`` would drop it and lose
    what is published meanwhile (when a batch goes out during it)."""
    retried_while = []
    retry = StreamSockets.retry

    def watched(self: StreamSockets) -> None:
        retried_while.append(self.counters.status)
        retry(self)

    monkeypatch.setattr(StreamSockets, "retry", watched)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10.0)
    endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    spec = StreamSpec(worker="w", dp_rank=0, endpoint=endpoint)
    with Subscriber(streams=[spec], retry_max=1.0) as sub:
        conn, _ = listener.accept()
        conn.close()
        listener.close()
        deadline = time.monotonic() + 10.0
        while True:  # the port is free once the listener's close is through
            try:
                pub = make_publisher(endpoint, None)
                break
            except EndpointError:
                assert time.monotonic() < deadline, "the port never came free"
                time.sleep(0.02)
        items: list = []
        n = 0
        until = time.monotonic() + 2.5  # past retry_max after the refusal
        while time.monotonic() < until:  # a few hundred batches, none dropped on the way
            pub.publish(batch(n))
            n += 1
            while (item := sub.get(timeout=0.01)) is not None:
                items.append(item)
            time.sleep(0.005)
        items += collect(
            sub, until=lambda got: any(d.seq == n - 1 for d in deliveries(items + got))
        )
        seqs = [d.seq for d in deliveries(items)]
        assert sub.stats()[Holder("w", 0)].status == "connected"
        # joined late, it may miss a first few (no replay endpoint: one Loss at most, at
        # the start); once following, nothing is lost
        assert seqs == list(range(seqs[0], n))
        assert [s.kind for s in signals(items) if s.kind not in ("unreachable", "loss")] == []
        losses = signals(items, "loss")
        assert len(losses) <= 1 and all(loss.last_seq < seqs[0] for loss in losses)
        assert "connected" not in retried_while  # no reconnect of a working connection


@pytest.mark.slow
def test_a_publisher_of_an_older_zmq_protocol_is_connected_once_data_arrives() -> None:
    """A publisher speaking ZMTP 2.0 (libzmq 3.x) completes no handshake that libzmq
    reports: its stream says "connected" once its first batch arrives, not
    "connecting" for ever, and its batches are delivered."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10.0)
    frames = live_frames(b"", 0, encode_batch(batch(0)))

    def zmtp2_pub() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b"\xff" + bytes(8) + b"\x7f")  # the signature
            conn.recv(10)
            conn.sendall(b"\x01\x01")  # revision 1 (ZMTP 2.0), socket type PUB
            conn.sendall(b"\x00\x00")  # an empty identity
            time.sleep(0.3)  # the subscription comes in meanwhile
            for i, frame in enumerate(frames):
                more = 0 if i == len(frames) - 1 else 1
                conn.sendall(bytes([more, len(frame)]) + frame)  # short frames
            time.sleep(2.0)

    server = threading.Thread(target=zmtp2_pub, daemon=True)
    server.start()
    spec = StreamSpec(
        worker="old",
        dp_rank=0,
        endpoint=f"tcp://{listener.getsockname()[0]}:{listener.getsockname()[1]}",
    )
    try:
        with Subscriber(streams=[spec]) as sub:
            items = collect(sub, until=lambda got: len(deliveries(got)) == 1)
            assert deliveries(items)[0].seq == 0
            assert sub.stats()[Holder("old", 0)].status == "connected"
    finally:
        server.join(timeout=5.0)
        listener.close()


def test_stream_that_comes_up_later_is_followed_from_seq_0(make_publisher: Factory) -> None:
    """Subscribing before the publisher exists works once it starts: everything from seq 0 arrives."""
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    live, replay = (f"tcp://127.0.0.1:{p}" for p in ports)
    spec = StreamSpec(worker="late", dp_rank=0, endpoint=live, replay_endpoint=replay)
    with Subscriber(streams=[spec], replay_timeout=0.5, retry_max=0.5) as sub:
        collect(sub, until=lambda got: bool(signals(got, "unreachable")))
        pub = make_publisher(live, replay)
        for n in range(30):
            pub.publish(batch(n))
        items = collect(sub, until=lambda got: len(deliveries(got)) == 30)
        assert [d.seq for d in deliveries(items)] == list(range(30))
        assert signals(items, "loss") == []


def test_async_iteration_and_close(endpoints: tuple[str, str], make_publisher: Factory) -> None:
    """The async iterator yields the same ordered stream; after close the subscriber refuses use."""
    pub = make_publisher(*endpoints)
    for n in range(10):
        pub.publish(batch(n))

    async def consume(sub: Subscriber) -> list[int]:
        seqs: list[int] = []

        async def read() -> None:
            async for item in sub:
                if isinstance(item, Delivery):
                    seqs.append(item.seq)
                    if len(seqs) == 10:
                        return

        await asyncio.wait_for(read(), 20)
        return seqs

    sub = Subscriber(streams=[spec_for(pub)])
    try:
        assert asyncio.run(consume(sub)) == list(range(10))
    finally:
        sub.close()
    sub.close()  # idempotent
    with pytest.raises(SubscriberStateError):
        sub.get(timeout=0.1)
    with pytest.raises(SubscriberStateError):
        sub.add_stream("tcp://127.0.0.1:1")


def test_duplicate_stream_is_refused(make_publisher: Factory) -> None:
    """Adding the same (worker, dp_rank) twice is a ValueError naming the holder."""
    pub = make_publisher("tcp://127.0.0.1:0", None)
    with (
        Subscriber(streams=[spec_for(pub, replay=False)]) as sub,
        pytest.raises(ValueError, match="already followed"),
    ):
        sub.add_stream(spec_for(pub, replay=False))


def test_close_ends_the_threads_and_closes_every_socket(make_publisher: Factory) -> None:
    """close() ends the socket and discovery threads and closes all sockets, so the caller's context can terminate."""
    import threading

    pub = make_publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    ctx = zmq.Context()
    sub = Subscriber(
        engines=[f"http://127.0.0.1:{_free_port()}"],
        streams=[spec_for(pub)],
        context=ctx,
        retry_initial=0.1,
    )
    pub.publish(batch(0))
    collect(sub, until=lambda got: len(deliveries(got)) == 1)
    threads = [sub._loop.thread, *(w.thread for w in sub._engines.values())]
    assert all(t.is_alive() for t in threads) and len(threads) == 2
    sub.close()
    # this subscriber's threads (another test's may still be ending in a full run)
    assert [t.name for t in threads if t.is_alive()] == []
    terminated = threading.Thread(target=ctx.term, daemon=True)
    terminated.start()
    terminated.join(10)
    assert not terminated.is_alive(), "a socket of the subscriber was left open"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_address_zmq_refuses_is_reported_and_the_loop_carries_on(make_publisher: Factory) -> None:
    """A stream whose address ZMQ refuses (an ipc path that is too long) is reported, and other streams still deliver."""
    bad = StreamSpec(worker="bad", dp_rank=0, endpoint="ipc:///tmp/" + "x" * 200)
    pub = make_publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    with Subscriber(streams=[bad, spec_for(pub, "good")]) as sub:
        pub.publish(batch(0))
        items = collect(
            sub, until=lambda got: len(deliveries(got)) == 1 and bool(signals(got, "unreachable"))
        )
        (signal,) = signals(items, "unreachable")
        assert signal.worker == "bad" and "ZMQ refused the address" in signal.reason
        assert deliveries(items)[0].holder == Holder("good", 0)


def test_resumed_stream_replays_only_the_difference_and_reports_what_the_buffer_lost(
    endpoints: tuple[str, str], make_publisher: Factory
) -> None:
    """A stream resumed after seq 29 gets 30.. only; resumed after a seq the 20-step
    buffer no longer reaches, it reports exactly the seqs the buffer dropped as lost."""
    pub = make_publisher(*endpoints, buffer_steps=20)
    for n in range(60):
        pub.publish(batch(n))
    assert pub.flush(timeout=10.0)
    with Subscriber(streams=[spec_for(pub)], resume={Holder("w", 0): 49}) as sub:
        items = collect(sub, until=lambda got: len(deliveries(got)) == 10)
        assert [d.seq for d in deliveries(items)] == list(range(50, 60))
        assert signals(items) == []
    with Subscriber(streams=[spec_for(pub)], resume={Holder("w", 0): 29}) as sub:
        items = collect(sub, until=lambda got: len(deliveries(got)) == 20)
        assert [d.seq for d in deliveries(items)] == list(range(40, 60))
        (loss,) = signals(items)
        assert isinstance(loss, Loss) and (loss.first_seq, loss.last_seq) == (30, 39)
