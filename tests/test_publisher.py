"""ZmqEventPublisher with real sockets: live frames, endpoints, drops, lifecycle, factory, wire bytes."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvevents import (
    BlockStored,
    ConfigError,
    EndpointError,
    EventPublisher,
    EventPublisherFactory,
    KVEventBatch,
    KVEventsConfig,
    NullEventPublisher,
    PublisherState,
    PublisherStateError,
    ZmqEventPublisher,
    decode_batch,
)
from kvevents.wire.frames import (
    LiveMessage,
    parse_live_frames,
    parse_replay_reply,
    replay_request_frames,
)
from wire_samples import load_wire_samples

TIMEOUT_MS = 5000


def batch(i: int, rank: int | None = None, tokens: int = 4) -> KVEventBatch:
    """A one-event batch whose hash and timestamp identify it as number ``i``."""
    event = BlockStored(
        block_hashes=[i],
        parent_block_hash=None,
        token_ids=list(range(i, i + tokens)),
        block_size=tokens,
        lora_id=None,
        medium=None,
    )
    return KVEventBatch(ts=float(i), events=[event], data_parallel_rank=rank)


def bases(kind: str, tmp_path: Path) -> tuple[str, str]:
    """Live and replay base endpoints on one transport, loopback or local only."""
    if kind == "tcp":
        return "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
    if kind == "ipc":
        return f"ipc://{tmp_path}/live", f"ipc://{tmp_path}/replay"
    tag = uuid.uuid4().hex[:8]
    return f"inproc://live-{tag}", f"inproc://replay-{tag}"


@pytest.fixture(params=["tcp", "ipc", "inproc"])
def transport(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    return bases(request.param, tmp_path)


@pytest.fixture
def make_publisher(
    zmq_context: zmq.Context[Any],
) -> Iterator[Callable[..., ZmqEventPublisher]]:
    """Build publishers on the test's context; every one is shut down after the test."""
    made: list[ZmqEventPublisher] = []

    def make(*args: Any, **kwargs: Any) -> ZmqEventPublisher:
        kwargs.setdefault("bind", True)
        kwargs.setdefault("context", zmq_context)
        pub = ZmqEventPublisher(*args, **kwargs)
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.shutdown(timeout=1.0)


@pytest.fixture
def subscribe(zmq_context: zmq.Context[Any]) -> Iterator[Callable[..., zmq.Socket[bytes]]]:
    """Open SUB sockets (unbounded receive queue unless ``rcvhwm``) that are closed after the test."""
    opened: list[zmq.Socket[bytes]] = []

    def open_sub(endpoint: str, topic: bytes = b"", rcvhwm: int = 0) -> zmq.Socket[bytes]:
        sub = zmq_context.socket(zmq.SUB)
        opened.append(sub)
        sub.setsockopt(zmq.RCVHWM, rcvhwm)
        sub.setsockopt(zmq.RCVBUF, 4096 if rcvhwm else -1)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.connect(endpoint)
        return sub

    yield open_sub
    for sock in opened:
        sock.close(linger=0)


@pytest.fixture
def dealer(zmq_context: zmq.Context[Any]) -> Iterator[Callable[..., zmq.Socket[bytes]]]:
    """Open replay DEALER sockets that are closed after the test."""
    opened: list[zmq.Socket[bytes]] = []

    def open_dealer(endpoint: str, rcvhwm: int = 1000) -> zmq.Socket[bytes]:
        sock = zmq_context.socket(zmq.DEALER)
        opened.append(sock)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.connect(endpoint)
        return sock

    yield open_dealer
    for sock in opened:
        sock.close(linger=0)


def recv_live(sock: zmq.Socket[bytes], timeout_ms: int = TIMEOUT_MS) -> LiveMessage:
    if not sock.poll(timeout_ms):
        raise AssertionError(f"no live message within {timeout_ms} ms")
    return parse_live_frames(sock.recv_multipart())


def sync_subscriber(pub: EventPublisher, sub: zmq.Socket[bytes], deadline_s: float = 10.0) -> int:
    """Publish empty probe batches until ``sub`` receives them; return the next batch's seq.

    A SUB only gets messages published after its subscription reached the PUB (the
    slow-joiner rule), so tests wait for a probe instead of sleeping.
    """
    sent = 0
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        pub.publish(KVEventBatch(ts=0.0, events=[]))
        sent += 1
        if sub.poll(20):
            last = recv_live(sub).seq
            while last < sent - 1:
                last = recv_live(sub).seq
            return sent
    raise AssertionError(f"subscriber did not receive any of {sent} probes in {deadline_s} s")


def replay(dealer: zmq.Socket[bytes], start: int) -> list[list[bytes]]:
    """Every reply to a replay request from ``start``, end marker included."""
    dealer.send_multipart(replay_request_frames(start))
    out = []
    while True:
        if not dealer.poll(TIMEOUT_MS):
            raise AssertionError(f"replay from {start}: no end marker within {TIMEOUT_MS} ms")
        frames = dealer.recv_multipart()
        out.append(frames)
        if parse_replay_reply(frames).is_end:
            return out


# --- live publishing ----------------------------------------------------------------------


def test_live_frames_in_order_with_rank_and_topic(
    transport: tuple[str, str], make_publisher: Callable[..., ZmqEventPublisher], subscribe: Any
) -> None:
    """Every batch arrives as [topic, seq, payload] with dense seqs and the publisher's rank filled in."""
    live, replay_base = transport
    pub = make_publisher(2, live, replay_base, topic="kv")
    sub = subscribe(pub.endpoint)
    first = sync_subscriber(pub, sub)
    for i in range(50):
        pub.publish(batch(i))
    for i in range(50):
        msg = recv_live(sub)
        assert msg.topic == b"kv"
        assert msg.seq == first + i
        got = decode_batch(msg.payload)
        assert got.ts == float(i)
        assert got.data_parallel_rank == 2


def test_rank_already_set_is_kept(
    transport: tuple[str, str], make_publisher: Callable[..., ZmqEventPublisher], subscribe: Any
) -> None:
    """A batch that already carries a rank is published with that rank, not the publisher's."""
    pub = make_publisher(1, transport[0])
    sub = subscribe(pub.endpoint)
    sync_subscriber(pub, sub)
    pub.publish(batch(0, rank=7))
    assert decode_batch(recv_live(sub).payload).data_parallel_rank == 7


@pytest.mark.slow
def test_burst_from_a_tight_loop_loses_nothing(
    transport: tuple[str, str], make_publisher: Callable[..., ZmqEventPublisher], subscribe: Any
) -> None:
    """A caller publishing 20,000 batches back to back gets every one delivered in order, none dropped."""
    pub = make_publisher(0, transport[0], handoff_backlog=16)
    sub = subscribe(pub.endpoint)
    first = sync_subscriber(pub, sub)
    n = 20_000
    for i in range(n):
        pub.publish(batch(i))
    for i in range(n):
        msg = recv_live(sub)
        assert msg.seq == first + i
    assert pub.stats.dropped == 0
    assert pub.stats.published == first + n
    assert pub.stats.handoffs > 0  # the caller outran the sender and handed it the GIL


@pytest.mark.slow
def test_a_sender_slower_than_the_caller_cuts_each_handoff_and_loses_nothing(
    transport: tuple[str, str], make_publisher: Callable[..., ZmqEventPublisher], subscribe: Any
) -> None:
    """A sender that cannot empty the backlog within a hand-off (an encoder holding the GIL
    ~100 us a batch) ends every hand-off with batches still queued; the caller goes on,
    and every batch is still delivered, in order, none dropped."""
    pub = make_publisher(0, transport[0], handoff_backlog=64)
    sub = subscribe(pub.endpoint)
    first = sync_subscriber(pub, sub)
    queue = pub._send_queue
    encode = queue._encode

    def slow_encode(item: KVEventBatch) -> bytes:
        until = time.perf_counter() + 100e-6
        while time.perf_counter() < until:  # busy: the GIL stays with the sender
            pass
        return encode(item)

    queue._encode = slow_encode  # type: ignore[method-assign]
    n = 2_000
    for i in range(n):
        pub.publish(batch(i))
    assert [recv_live(sub).seq for _ in range(n)] == list(range(first, first + n))
    stats = pub.stats
    assert stats.dropped == 0
    assert stats.handoffs >= n // (2 * 64) - 1  # one per backlog cut short, then a pause


def test_encoding_array_sends_positional_events(
    transport: tuple[str, str], make_publisher: Callable[..., ZmqEventPublisher], subscribe: Any
) -> None:
    """With encoding="array" events go out as positional arrays, as older engines sent them."""
    pub = make_publisher(0, transport[0], encoding="array")
    sub = subscribe(pub.endpoint)
    sync_subscriber(pub, sub)
    pub.publish(batch(5))
    payload = recv_live(sub).payload
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][0] == "BlockStored"
    assert decode_batch(payload).events == batch(5).events


# --- endpoints ----------------------------------------------------------------------------


def test_port_zero_is_resolved_for_every_rank(
    make_publisher: Callable[..., ZmqEventPublisher],
) -> None:
    """Port 0 lets the OS pick for any rank, and the publisher reports the real ports."""
    pub = make_publisher(3, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    live_port = int(pub.endpoint.rsplit(":", 1)[1])
    replay_port = int(str(pub.replay_endpoint).rsplit(":", 1)[1])
    assert pub.endpoint.startswith("tcp://127.0.0.1:")
    assert live_port != 0 and replay_port != 0 and live_port != replay_port


def test_wildcard_endpoint_keeps_its_host(make_publisher: Callable[..., ZmqEventPublisher]) -> None:
    """A wildcard endpoint is bound by default and reported with its wildcard host and real port."""
    pub = make_publisher(0, "tcp://*:0", bind=None)
    assert pub.endpoint.startswith("tcp://*:")
    assert not pub.endpoint.endswith(":0")


def test_ipc_endpoint_gets_rank_suffix(
    tmp_path: Path, make_publisher: Callable[..., ZmqEventPublisher]
) -> None:
    """An ipc endpoint of rank 2 binds the base path with a _dp2 suffix."""
    pub = make_publisher(2, f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay")
    assert pub.endpoint == f"ipc://{tmp_path}/kv_dp2"
    assert pub.replay_endpoint == f"ipc://{tmp_path}/replay_dp2"


def test_offset_endpoint_port_static_method() -> None:
    """ZmqEventPublisher.offset_endpoint_port returns SGLang's strings for each rank."""
    offset = ZmqEventPublisher.offset_endpoint_port
    assert offset("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset("tcp://*:5557", None) == "tcp://*:5557"
    assert offset("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset(None, 1) is None


def test_bind_conflict_names_endpoint_rank_and_fix(
    transport: tuple[str, str], make_publisher: Callable[..., ZmqEventPublisher]
) -> None:
    """Binding what another publisher holds fails with an EndpointError naming it, the rank and the fix."""
    first = make_publisher(0, transport[0])
    threads_before = threading.active_count()
    with pytest.raises(EndpointError) as info:
        make_publisher(0, first.endpoint)  # the same port, path or name
    message = str(info.value)
    taken = first.endpoint
    if taken.startswith("tcp://"):
        taken = "port " + taken.rsplit(":", 1)[1]
    assert f"{taken} is already in use" in message
    assert "rank 0" in message
    assert "select_kv_publisher_dp_rank" in message
    assert threading.active_count() == threads_before


def test_ipc_path_left_by_a_dead_process_is_reused(
    tmp_path: Path, make_publisher: Callable[..., ZmqEventPublisher]
) -> None:
    """A stale ipc socket file that nobody listens on does not block binding."""
    stale = tmp_path / "kv"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(stale))  # bound, never listening, then closed: what a crash leaves
    assert stale.exists()
    pub = make_publisher(0, f"ipc://{stale}")
    assert pub.endpoint == f"ipc://{stale}"


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_connect_mode_publishes_to_a_bound_subscriber(
    kind: str, tmp_path: Path, make_publisher: Callable[..., ZmqEventPublisher], zmq_context: Any
) -> None:
    """With bind=False the publisher connects, here to a SUB that bound."""
    sub = zmq_context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:0" if kind == "tcp" else f"ipc://{tmp_path}/sub")
    address = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    pub = make_publisher(0, address, bind=False if kind == "ipc" else None)
    assert pub.endpoint == address
    try:
        first = sync_subscriber(pub, sub)
        pub.publish(batch(1))
        assert recv_live(sub).seq == first
    finally:
        sub.close(linger=0)


def test_connecting_to_a_wildcard_is_refused(
    make_publisher: Callable[..., ZmqEventPublisher],
) -> None:
    """bind=False with a wildcard host fails with an EndpointError saying a wildcard can only be bound."""
    with pytest.raises(EndpointError, match="wildcard host can only be bound"):
        make_publisher(0, "tcp://*:5557", bind=False)


def test_rank_keywords(tmp_path: Path, make_publisher: Callable[..., ZmqEventPublisher]) -> None:
    """vLLM's data_parallel_rank= works like attn_dp_rank=, and giving both is a TypeError."""
    pub = make_publisher(data_parallel_rank=2, endpoint=f"ipc://{tmp_path}/kv")
    assert pub.rank == 2
    assert pub.endpoint.endswith("kv_dp2")
    with pytest.raises(TypeError, match="not both"):
        make_publisher(attn_dp_rank=1, data_parallel_rank=1, endpoint=f"ipc://{tmp_path}/x")


def test_bad_settings_are_refused(make_publisher: Callable[..., ZmqEventPublisher]) -> None:
    """Out-of-range queue, buffer and encoding settings raise ConfigError naming the setting."""
    with pytest.raises(ConfigError, match="max_queue_size"):
        make_publisher(0, "tcp://127.0.0.1:0", max_queue_size=0)
    with pytest.raises(ConfigError, match="buffer_steps"):
        make_publisher(0, "tcp://127.0.0.1:0", buffer_steps=0)
    with pytest.raises(ConfigError, match="encoding"):
        make_publisher(0, "tcp://127.0.0.1:0", encoding="json")


# --- drops --------------------------------------------------------------------------------


def test_drop_on_full_is_a_gap_replay_cannot_fill(
    transport: tuple[str, str],
    make_publisher: Callable[..., ZmqEventPublisher],
    subscribe: Any,
    dealer: Any,
) -> None:
    """Batches refused by a full queue are counted and leave a seq gap that neither live nor replay fills."""
    live, replay_base = transport
    pub = make_publisher(0, live, replay_base, max_queue_size=5)
    sub = subscribe(pub.endpoint)
    first = sync_subscriber(pub, sub)
    # Holding the send lock freezes the sender exactly where a starved sender would be.
    with pub._send_queue.hold():
        for i in range(8):
            pub.publish(batch(i))
        assert pub.stats.dropped == 3
        assert pub.stats.queued == 5
    seqs = [recv_live(sub).seq for _ in range(5)]
    pub.publish(batch(100))  # the queue has drained: accepted, after the three burned seqs
    seqs.append(recv_live(sub).seq)
    assert seqs == [first, first + 1, first + 2, first + 3, first + 4, first + 8]
    assert pub.stats.dropped == 3
    replies = [parse_replay_reply(f) for f in replay(dealer(str(pub.replay_endpoint)), first)]
    assert [r.seq for r in replies[:-1]] == seqs


def test_a_frozen_sender_costs_one_bounded_wait_per_backlog_then_drops(
    transport: tuple[str, str], make_publisher: Callable[..., ZmqEventPublisher]
) -> None:
    """With the sender frozen, publish() waits (bounded) at most once per handoff_backlog batches, then drops."""
    pub = make_publisher(0, transport[0], max_queue_size=100, handoff_backlog=10)
    with pub._send_queue.hold():  # freeze the sender
        for i in range(200):
            pub.publish(batch(i))
        stats = pub.stats
    above_mark = 100 - 10  # accepted batches that found the backlog at or above the mark
    assert 1 <= stats.handoffs <= above_mark // 10 + 1
    assert stats.queued == 100
    assert stats.dropped == 100
    assert pub.flush(timeout=5.0)
    assert pub.stats.published == 100


# --- lifecycle ----------------------------------------------------------------------------


def test_shutdown_sends_everything_accepted(
    transport: tuple[str, str], make_publisher: Callable[..., ZmqEventPublisher], subscribe: Any
) -> None:
    """shutdown() right after a burst still delivers every accepted batch before closing."""
    pub = make_publisher(0, transport[0])
    sub = subscribe(pub.endpoint)
    first = sync_subscriber(pub, sub)
    for i in range(2000):
        pub.publish(batch(i))
    pub.shutdown(timeout=5.0)
    assert pub.state is PublisherState.CLOSED
    assert pub.stats.unsent == 0
    assert [recv_live(sub).seq for _ in range(2000)] == list(range(first, first + 2000))


def test_flush_waits_until_accepted_batches_are_sent(
    transport: tuple[str, str],
    make_publisher: Callable[..., ZmqEventPublisher],
) -> None:
    """flush() returns True once every batch accepted before it has been sent, and False on timeout."""
    pub = make_publisher(0, transport[0])
    for i in range(500):
        pub.publish(batch(i))
    assert pub.flush(timeout=5.0)
    assert pub.stats.published == 500
    with pub._send_queue.hold():  # a frozen sender cannot reach the flush marker
        pub.publish(batch(500))
        assert not pub.flush(timeout=0.05)
    assert pub.flush(timeout=5.0)


def test_shutdown_is_idempotent_and_publish_after_it_raises(
    transport: tuple[str, str],
    make_publisher: Callable[..., ZmqEventPublisher],
) -> None:
    """A second shutdown() does nothing, and publish() after shutdown raises PublisherStateError."""
    pub = make_publisher(0, *transport)
    assert pub.state is PublisherState.RUNNING
    pub.shutdown()
    pub.shutdown()
    assert pub.state is PublisherState.CLOSED
    with pytest.raises(PublisherStateError, match="closed"):
        pub.publish(batch(0))


def test_context_manager_shuts_down(zmq_context: Any) -> None:
    """Leaving a with-block shuts the publisher down and stops its threads."""
    before = set(threading.enumerate())
    with ZmqEventPublisher(
        0, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", bind=True, context=zmq_context
    ) as pub:
        assert isinstance(pub, ZmqEventPublisher)
        assert len(set(threading.enumerate()) - before) == 2  # sender and replay
        pub.publish(batch(0))
    assert pub.state is PublisherState.CLOSED
    assert {t for t in threading.enumerate() if t.is_alive()} - before == set()


def test_null_publisher_accepts_any_publisher_arguments() -> None:
    """NullEventPublisher takes SGLang's constructor arguments and publishes nothing."""
    with NullEventPublisher(3, "tcp://*:5557", None, 10, topic="kv") as pub:
        pub.publish(batch(0))
        assert pub.rank == 3
        assert pub.endpoint is None
        assert pub.stats.published == 0


# --- factory ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        None,
        "",
        "{}",
        '{"publisher": "null"}',
        {"publisher": "zmq", "enable_kv_cache_events": False},
    ],
)
def test_factory_gives_null_publisher_when_off(config: Any) -> None:
    """Absent, empty, null or disabled configs give a NullEventPublisher."""
    pub = EventPublisherFactory.create(config, attn_dp_rank=1)
    assert isinstance(pub, NullEventPublisher)
    assert pub.rank == 1


@pytest.mark.parametrize("form", ["json", "dict", "config"])
def test_factory_builds_zmq_publisher_at_rank(form: str, zmq_context: Any) -> None:
    """A zmq config as JSON, dict or KVEventsConfig gives a ZmqEventPublisher offset by the rank."""
    settings = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "bind": True, "topic": "kv"}
    config: Any = {
        "json": json.dumps(settings),
        "dict": settings,
        "config": KVEventsConfig(**settings),  # type: ignore[arg-type]
    }[form]
    pub = EventPublisherFactory.create(config, data_parallel_rank=2, context=zmq_context)
    try:
        assert isinstance(pub, ZmqEventPublisher)
        assert pub.rank == 2
        assert pub.topic == "kv"
    finally:
        pub.shutdown()


def test_factory_unknown_publisher_lists_registered() -> None:
    """An unregistered publisher name is a ConfigError listing the registered names."""
    with pytest.raises(ConfigError, match="registered publishers: null, zmq"):
        EventPublisherFactory.create('{"publisher": "kafka"}')


def test_factory_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered constructor is called with the rank and the config's settings; names are unique."""
    monkeypatch.setattr(EventPublisherFactory, "_registry", dict(EventPublisherFactory._registry))
    seen: dict[str, Any] = {}

    def custom(**kwargs: Any) -> EventPublisher:
        seen.update(kwargs)
        return NullEventPublisher()

    EventPublisherFactory.register_publisher("custom", custom)
    EventPublisherFactory.create({"publisher": "custom", "topic": "t"}, attn_dp_rank=3)
    assert seen["attn_dp_rank"] == 3
    assert seen["topic"] == "t"
    with pytest.raises(ConfigError, match="already registered"):
        EventPublisherFactory.register_publisher("custom", custom)


def test_factory_refuses_other_types() -> None:
    """A config that is not text, dict, KVEventsConfig or None is a ConfigError."""
    with pytest.raises(ConfigError, match="must be JSON text"):
        EventPublisherFactory.create(42)  # type: ignore[arg-type]


# --- wire compatibility -------------------------------------------------------------------


def test_bytes_equal_sglang_captures(
    transport: tuple[str, str], make_publisher: Callable[..., ZmqEventPublisher], dealer: Any
) -> None:
    """Publishing SGLang's captured batches at rank 3, topic kv-events, gives its captured frames byte for byte."""
    records = load_wire_samples("sglang-0.5.23.jsonl")
    live_frames = [r["frames"] for r in records if r["kind"] == "live"]
    replay_frames = [r["frames"] for r in records if r["kind"] == "replay"]
    pub = make_publisher(3, *transport, topic="kv-events")
    for frames in live_frames:
        sample = decode_batch(frames[2])
        assert sample.data_parallel_rank == 3
        sample.data_parallel_rank = None  # the publisher fills in its own rank
        pub.publish(sample)
    assert pub.flush(timeout=5.0)
    client = dealer(str(pub.replay_endpoint))
    # Replay replies carry the very topic, seq and payload frames sent live.
    everything = replay(client, 0)
    assert everything[:-1] == [[b"", *frames] for frames in live_frames]
    assert replay(client, 5) == replay_frames


def test_live_bytes_equal_sglang_captures_after_probes(
    transport: tuple[str, str], make_publisher: Callable[..., ZmqEventPublisher], subscribe: Any
) -> None:
    """On the live socket, SGLang's captured batches arrive with the captured topic and payload bytes."""
    records = load_wire_samples("sglang-0.5.23.jsonl")
    live_frames = [r["frames"] for r in records if r["kind"] == "live"]
    pub = make_publisher(3, transport[0], topic="kv-events")
    sub = subscribe(pub.endpoint)
    first = sync_subscriber(pub, sub)
    for frames in live_frames:
        pub.publish(decode_batch(frames[2]))
    for i, frames in enumerate(live_frames):
        got = sub.recv_multipart() if sub.poll(TIMEOUT_MS) else None
        assert got is not None
        assert got[0] == frames[0] and got[2] == frames[2]
        assert parse_live_frames(got).seq == first + i


def test_connecting_to_port_zero_is_refused_with_the_fix() -> None:
    """A non-wildcard host with port 0 (which connects by default) is refused, naming the fix."""
    with pytest.raises(EndpointError, match=r"port 0 means 'the OS picks'.*tcp://\*:0"):
        ZmqEventPublisher(0, endpoint="tcp://127.0.0.1:0")


def test_a_batch_the_encoder_refuses_burns_its_seq_and_the_stream_goes_on(
    make_publisher: Callable[..., ZmqEventPublisher], subscribe: Any
) -> None:
    """A batch msgpack cannot encode (nested past its depth limit, which raised an error
    the sender did not catch and ended its thread: the stream stopped for good) is
    skipped with its seq, so consumers see a gap; the batches after it go out."""
    pub = make_publisher(0, "tcp://127.0.0.1:0")
    sub = subscribe(pub.endpoint)
    next_seq = sync_subscriber(pub, sub)
    deep: list[Any] = []
    for _ in range(1200):
        deep = [deep]
    refused = BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=2,
        lora_id=None,
        medium=None,
        extra_keys=[deep],
    )
    pub.publish(KVEventBatch(ts=1.0, events=[refused]))
    pub.publish(batch(1))
    pub.publish(batch(2))
    assert pub.flush(5.0)
    # the refused batch's seq (next_seq) is a gap before the two that follow it
    assert [recv_live(sub).seq for _ in range(2)] == [next_seq + 1, next_seq + 2]
    assert pub.stats.encode_errors == 1


def test_a_batch_published_while_a_shutdown_runs_is_sent_refused_or_counted_unsent(
    make_publisher: Callable[..., ZmqEventPublisher],
) -> None:
    """publish() passes its check, then loses the CPU until another thread's shutdown()
    has returned (events stand in for the scheduler): the batch it then queues is
    counted unsent, and publish() says so (it was neither sent nor counted)."""
    pub = make_publisher(0, "tcp://127.0.0.1:0")
    queue_it = pub._put
    checked, shut = threading.Event(), threading.Event()

    def late_put(events: KVEventBatch) -> None:
        checked.set()
        assert shut.wait(10.0)
        queue_it(events)

    pub._put = late_put  # type: ignore[method-assign]
    outcome: list[str] = []

    def engine_thread() -> None:
        try:
            pub.publish(batch(1))
            outcome.append("accepted")
        except PublisherStateError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=engine_thread)
    thread.start()
    assert checked.wait(10.0)
    pub.shutdown(timeout=1.0)
    shut.set()
    thread.join(10.0)
    stats = pub.stats
    assert (stats.published, stats.unsent, stats.queued) == (0, 1, 0)
    assert outcome and "counts as unsent" in outcome[0]
