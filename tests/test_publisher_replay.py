"""Replay through a real ROUTER: ranges, the buffer's edge, topics, bad requests, slow clients, gaps."""
# ruff: noqa: F811  (fixtures are shared by import; a test parameter naming one is not a redefinition)

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from kvevents import ZmqEventPublisher, decode_batch
from kvevents.publish.replay_server import ReplayBuffer
from kvevents.wire.frames import END_SEQ, parse_live_frames, parse_replay_reply
from test_publisher import (  # noqa: F401  (fixtures are shared by importing them)
    TIMEOUT_MS,
    bases,
    batch,
    dealer,
    make_publisher,
    recv_live,
    replay,
    subscribe,
    sync_subscriber,
    transport,
)

Make = Callable[..., ZmqEventPublisher]


def replayed(client: zmq.Socket[bytes], start: int) -> list[tuple[bytes | None, int, float]]:
    """(topic, seq, ts) of every batch in a replay answer; checks that it ends with the end marker."""
    replies = [parse_replay_reply(frames) for frames in replay(client, start)]
    assert replies[-1].is_end and replies[-1].payload == b""
    return [(r.topic, r.seq, decode_batch(r.payload).ts) for r in replies[:-1]]


@given(
    capacity=st.integers(1, 12),
    skips=st.lists(st.integers(0, 3), max_size=40),
    start=st.integers(0, 200),
)
def test_replay_buffer_keeps_the_newest_stored_seqs(
    capacity: int, skips: list[int], start: int
) -> None:
    """The ring answers get/since with exactly the last `capacity` seqs stored (seqs
    dropped in between take no room: slots by seq held fewer after each drop)."""
    buffer = ReplayBuffer(capacity)
    stored, seq = [], 0
    for skip in skips:  # `skip` seqs dropped before each stored one
        seq += skip
        buffer.put(seq, seq.to_bytes(8, "big"), b"p%d" % seq)
        stored.append(seq)
        seq += 1
    window = stored[-capacity:]
    assert [e.seq for e in buffer.since(start)] == [s for s in window if s >= start]
    for s in range(buffer.next_seq + 2):
        entry = buffer.get(s)
        assert (entry is not None) == (s in window)
        if entry is not None:
            assert entry.payload == b"p%d" % s and entry.seq_frame == s.to_bytes(8, "big")


class _Hooked(list[Any]):
    """A ring list that runs ``hook`` after every load or store, as a thread switch could."""

    hook: Callable[[], None] = staticmethod(lambda: None)

    def __getitem__(self, index: Any) -> Any:
        value = super().__getitem__(index)
        type(self).hook()
        return value

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        type(self).hook()


def _whole(entry: Any) -> bool:
    return entry is None or (
        entry.seq_frame == entry.seq.to_bytes(8, "big") and entry.payload == b"p%d" % entry.seq
    )


def _put(buffer: ReplayBuffer, seq: int) -> None:
    buffer.put(seq, seq.to_bytes(8, "big"), b"p%d" % seq)


def test_replay_buffer_readers_never_see_a_torn_entry() -> None:
    """A read interleaved anywhere with a write gets a whole entry (one batch's fields) or none.

    Between any two list operations of ``put`` another thread may read, and between any
    two of a read the writer may store: both are simulated by hooking the ring's lists.
    """
    buffer = ReplayBuffer(2)
    for seq in range(2):
        _put(buffer, seq)
    hooked = [_Hooked(ring) for ring in (buffer._seqs, buffer._frames, buffer._payloads)]  # type: ignore[attr-defined]
    buffer._seqs, buffer._frames, buffer._payloads = hooked  # type: ignore[attr-defined]
    seen: list[Any] = []
    busy = [False]

    def read_now() -> None:  # the writer paused: a reader looks at every seq
        if busy[0]:
            return
        busy[0] = True
        try:
            seen.extend(buffer.get(s) for s in range(buffer.next_seq + 2))
        finally:
            busy[0] = False

    _Hooked.hook = staticmethod(read_now)
    try:
        for seq in range(2, 8):
            _put(buffer, seq)  # overwrites slot seq % 2 while readers look in between
    finally:
        _Hooked.hook = staticmethod(lambda: None)
    assert seen and all(_whole(entry) for entry in seen)

    writes = iter(range(8, 10_000))

    def write_now() -> None:  # the reader paused: the writer overwrites the ring
        if busy[0]:
            return
        busy[0] = True
        try:
            _put(buffer, next(writes))
        finally:
            busy[0] = False

    _Hooked.hook = staticmethod(write_now)
    try:
        reads = [buffer.get(buffer.next_seq - 1) for _ in range(20)]
    finally:
        _Hooked.hook = staticmethod(lambda: None)
    assert all(_whole(entry) for entry in reads)
    assert all(entry is None for entry in reads)  # each was overwritten while it was read


def test_publishing_allocates_nothing_the_garbage_collector_tracks(make_publisher: Make) -> None:
    """Filling the replay ring (and sending) adds nothing to the cyclic GC's allocation count.

    Objects the collector tracks count towards its thresholds; a publisher that made one
    per batch would set off collections of the host's whole heap from its hot path.
    """
    pub = make_publisher(
        0, "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=5_000
    )
    batches = [batch(i) for i in range(64)]  # made before counting: the caller's objects
    assert pub.flush(timeout=5.0)
    gc.collect()
    gc.disable()
    try:
        before = gc.get_count()[0]
        for i in range(5_000):  # fills the ring from empty: every batch is a new entry
            pub.publish(batches[i % 64])
        assert pub.flush(timeout=10.0)
        allocated = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert pub.stats.published >= 5_000
    assert allocated < 100, f"{allocated} GC-tracked objects for 5,000 batches"


def test_replay_from_the_middle(
    transport: tuple[str, str], make_publisher: Make, dealer: Any
) -> None:
    """A request from seq 7 gets batches 7..19 in order, each with its topic, then the end marker."""
    live, replay_base = transport
    pub = make_publisher(0, live, replay_base, topic="kv")
    for i in range(20):
        pub.publish(batch(i))
    assert pub.flush(timeout=5.0)
    got = replayed(dealer(str(pub.replay_endpoint)), 7)
    assert got == [(b"kv", i, float(i)) for i in range(7, 20)]
    assert pub.stats.replay_requests == 1
    assert pub.stats.replayed == 13


def test_replay_older_than_the_buffer_starts_at_the_oldest(
    transport: tuple[str, str], make_publisher: Make, dealer: Any
) -> None:
    """With 10 batches kept, a request from seq 3 after 25 batches gets 15..24, so the client sees the gap."""
    live, replay_base = transport
    pub = make_publisher(0, live, replay_base, buffer_steps=10)
    for i in range(25):
        pub.publish(batch(i))
    assert pub.flush(timeout=5.0)
    client = dealer(str(pub.replay_endpoint))
    assert [seq for _, seq, _ in replayed(client, 3)] == list(range(15, 25))
    assert [seq for _, seq, _ in replayed(client, 0)] == list(range(15, 25))


def test_replay_from_beyond_the_newest_is_the_end_marker_alone(
    make_publisher: Make, dealer: Any
) -> None:
    """A request from a seq not yet published gets only the end marker."""
    pub = make_publisher(0, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    for i in range(3):
        pub.publish(batch(i))
    assert pub.flush(timeout=5.0)
    assert replayed(dealer(str(pub.replay_endpoint)), 3) == []
    assert replayed(dealer(str(pub.replay_endpoint)), END_SEQ - 1) == []


def test_topic_filtering_live_and_replay(
    transport: tuple[str, str], tmp_path: Path, make_publisher: Make, subscribe: Any, dealer: Any
) -> None:
    """A SUB filtering on one topic gets only that publisher's batches, and its replay carries the topic."""
    live, replay_base = transport
    pub_a = make_publisher(0, live, replay_base, topic="kv-a")
    pub_b = make_publisher(1, live, replay_base, topic="kv-b")
    sub = subscribe(pub_a.endpoint, b"kv-a")
    sub.connect(pub_b.endpoint)
    first = sync_subscriber(pub_a, sub)
    for i in range(5):
        pub_b.publish(batch(100 + i))
        pub_a.publish(batch(i))
    assert pub_b.flush(timeout=5.0)
    got = [recv_live(sub) for _ in range(5)]
    assert [(m.topic, m.seq) for m in got] == [(b"kv-a", first + i) for i in range(5)]
    assert not sub.poll(100)  # nothing of topic kv-b arrives
    got_b = replayed(dealer(str(pub_b.replay_endpoint)), 0)
    assert got_b == [(b"kv-b", i, float(100 + i)) for i in range(5)]


@pytest.mark.parametrize(
    "request_frames",
    [
        [b"\x00" * 8],  # no delimiter
        [b"", b"\x00" * 7],  # seq of 7 bytes
        [b"", b"\x00" * 8, b"extra"],  # a frame too many
        [b"x", b"\x00" * 8],  # delimiter not empty
    ],
    ids=["no-delimiter", "short-seq", "extra-frame", "non-empty-delimiter"],
)
def test_malformed_request_gets_the_end_marker_alone(
    request_frames: list[bytes], transport: tuple[str, str], make_publisher: Make, dealer: Any
) -> None:
    """A malformed request is counted and answered with the end marker alone; later requests still work."""
    live, replay_base = transport
    pub = make_publisher(0, live, replay_base)
    pub.publish(batch(0))
    assert pub.flush(timeout=5.0)
    client = dealer(str(pub.replay_endpoint))
    client.send_multipart(request_frames)
    assert client.poll(TIMEOUT_MS)
    reply = parse_replay_reply(client.recv_multipart())
    assert reply.is_end and reply.payload == b""
    assert pub.stats.malformed_requests == 1
    assert pub.stats.replay_requests == 0
    assert [seq for _, seq, _ in replayed(client, 0)] == [0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tcp", "inproc"])
def test_stalled_replay_client_never_delays_live_publishing(
    kind: str, tmp_path: Path, make_publisher: Make, subscribe: Any, dealer: Any
) -> None:
    """While a replay client stops reading, live batches and other clients' replays keep flowing, and its answers are cut short."""
    live, replay_base = bases(kind, tmp_path)
    pub = make_publisher(0, live, replay_base, buffer_steps=20)
    sub = subscribe(pub.endpoint)
    first = sync_subscriber(pub, sub)
    for i in range(20):
        pub.publish(batch(i, tokens=40_000))  # ~120 KB each: an answer is ~2.4 MB
    stalled = dealer(str(pub.replay_endpoint), rcvhwm=1)
    healthy = dealer(str(pub.replay_endpoint))
    next_seq = first
    for _ in range(20):
        assert recv_live(sub).seq == next_seq
        next_seq += 1
    for round_ in range(40):  # socket buffers hold a few MB: a handful of answers fill them
        stalled.send_multipart([b"", (0).to_bytes(8, "big")])
        assert len(replayed(healthy, 0)) == 20
        pub.publish(batch(1000 + round_, tokens=40_000))
        assert sub.poll(TIMEOUT_MS), (round_, pub.stats)
        assert recv_live(sub).seq == next_seq
        next_seq += 1
        if pub.stats.replay_truncated:
            break
    assert pub.stats.replay_truncated > 0, f"no answer cut short after {round_ + 1} rounds"
    # The stalled client reads what it was sent before the test ends, so no pipe is still
    # full when the context is destroyed: CI once hung 120 s in zmq_ctx_term there.
    while stalled.poll(200):
        stalled.recv_multipart()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tcp", "ipc", "inproc"])
def test_tiny_receive_queue_sees_gaps_and_replay_fills_every_one(
    kind: str, tmp_path: Path, make_publisher: Make, subscribe: Any, dealer: Any
) -> None:
    """A subscriber with RCVHWM=1 that reads after a burst misses batches, and one replay recovers every missing seq."""
    live, replay_base = bases(kind, tmp_path)
    burst = 1500
    pub = make_publisher(0, live, replay_base, hwm=10, buffer_steps=burst + 100)
    sub = subscribe(pub.endpoint, rcvhwm=1)
    first = sync_subscriber(pub, sub)
    for i in range(burst):
        pub.publish(batch(i, tokens=8000))  # ~24 KB each: 36 MB, more than any socket buffer
    assert pub.flush(timeout=30.0)
    seen: dict[int, float] = {}
    while sub.poll(500):
        msg = parse_live_frames(sub.recv_multipart())
        seen[msg.seq] = decode_batch(msg.payload).ts
    wanted = set(range(first, first + burst))
    missing = sorted(wanted - seen.keys())
    assert missing, "the burst should have overflowed the subscriber's queue"
    for _topic, seq, ts in replayed(dealer(str(pub.replay_endpoint)), missing[0]):
        seen.setdefault(seq, ts)
    assert wanted <= seen.keys()
    assert all(seen[seq] == float(seq - first) for seq in wanted)
