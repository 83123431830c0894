"""Replay through a real ROUTER: ranges, the buffer's edge, topics, bad requests, slow clients, gaps."""
# ruff: noqa: F811  (fixtures are shared by import; a test parameter naming one is not a redefinition)

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from kvevents.publisher import ZmqEventPublisher
from kvevents.replay import ReplayBuffer
from kvevents.wire import END_SEQ, decode_batch, parse_live_frames, parse_replay_reply
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
    """The ring answers get/since with exactly the stored seqs among the last `capacity` numbers."""
    buffer = ReplayBuffer(capacity)
    stored, seq = [], 0
    for skip in skips:  # `skip` seqs dropped before each stored one
        seq += skip
        buffer.put(seq, seq.to_bytes(8, "big"), b"p%d" % seq)
        stored.append(seq)
        seq += 1
    window = [s for s in stored if s >= buffer.next_seq - capacity]
    assert [e.seq for e in buffer.since(start)] == [s for s in window if s >= start]
    for s in range(buffer.next_seq + 2):
        entry = buffer.get(s)
        assert (entry is not None) == (s in window)
        if entry is not None:
            assert entry.payload == b"p%d" % s and entry.seq_frame == s.to_bytes(8, "big")


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
