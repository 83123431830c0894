"""Every captured SGLang and vLLM message, fed through a real Subscriber, decodes field for field."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq

from kvevents import KVCacheEvent, KVEventBatch, StreamSpec, Subscriber
from kvevents.wire.frames import decode_seq
from subscriber_support import (
    bind_local,
    collect,
    deliveries,
    recv_replay_request,
    signals,
    wait_subscribed,
)
from wire_samples import SAMPLE_FILES, load_wire_samples


def assert_same_fields(batch: KVEventBatch, payload: bytes) -> None:
    """Compare a delivered batch with a generic msgpack decode of its payload, field by field."""
    raw = msgspec.msgpack.decode(payload)
    assert batch.ts == raw[0]
    assert batch.data_parallel_rank == (raw[2] if len(raw) > 2 else None)
    assert len(batch.events) == len(raw[1])
    for event, generic in zip(batch.events, raw[1], strict=True):
        assert isinstance(event, KVCacheEvent)
        if isinstance(generic, dict):
            assert type(event).__name__ == generic["type"]
            fields: dict[str, Any] = {k: v for k, v in generic.items() if k != "type"}
        else:
            assert type(event).__name__ == generic[0]
            fields = dict(zip(event.__struct_fields__, generic[1:], strict=False))
        for name, value in fields.items():
            if name in event.__struct_fields__:
                assert getattr(event, name) == value, (name, getattr(event, name), value)


@pytest.mark.parametrize("name", SAMPLE_FILES)
def test_live_samples_are_delivered_in_order_field_for_field(
    name: str, zmq_context: zmq.Context
) -> None:
    """Captured live frames sent by a raw PUB reach the consumer in order, every field intact."""
    live = [r["frames"] for r in load_wire_samples(name) if r["kind"] == "live"]
    topic = live[0][0].decode()
    # One generation at a time: a capture file may hold several runs, each from seq 0.
    runs: list[list[list[bytes]]] = []
    for frames in live:
        if decode_seq(frames[1]) == 0:
            runs.append([])
        runs[-1].append(frames)
    for run in runs:
        xpub, address = bind_local(zmq_context, zmq.XPUB)
        sub = Subscriber(streams=[StreamSpec.from_endpoint(address, topic=topic)])
        try:
            assert wait_subscribed(xpub) == b"\x01" + topic.encode()
            for frames in run:
                xpub.send_multipart(frames)
            count = len(run)
            items = collect(sub, until=lambda got, n=count: len(deliveries(got)) == n)
            assert signals(items) == []
            assert [d.seq for d in deliveries(items)] == [decode_seq(f[1]) for f in run]
            for delivery, frames in zip(deliveries(items), run, strict=True):
                assert_same_fields(delivery.batch, frames[2])
        finally:
            sub.close()
            xpub.close()


@pytest.mark.parametrize("four_frames", [True, False], ids=["4-frame", "3-frame"])
@pytest.mark.parametrize("name", SAMPLE_FILES)
def test_replayed_samples_are_delivered_field_for_field(
    name: str, four_frames: bool, zmq_context: zmq.Context
) -> None:
    """Captured replay replies (4-frame, and the older 3-frame form) answer the joining replay; what the buffer no longer held is a Loss."""
    records = load_wire_samples(name)
    replies = [r["frames"] for r in records if r["kind"] == "replay"]
    replies = replies[: next(i for i, f in enumerate(replies) if f[2] == b"\xff" * 8) + 1]
    topic = next(r["frames"][0] for r in records if r["kind"] == "live")
    if not four_frames:
        replies = [[f[0], *f[2:]] for f in replies]
    seq_at = 2 if four_frames else 1
    first = decode_seq(replies[0][seq_at])
    pub, live_address = bind_local(zmq_context, zmq.PUB)
    router, replay_address = bind_local(zmq_context, zmq.ROUTER)
    spec = StreamSpec.from_endpoint(
        live_address, replay_endpoint=replay_address, topic=topic.decode()
    )
    sub = Subscriber(streams=[spec])
    try:
        identity, start = recv_replay_request(router)
        assert start == 0  # a joining stream asks for everything
        for frames in replies:
            router.send_multipart([identity, *frames])
        data = replies[:-1]
        items = collect(sub, until=lambda got: len(deliveries(got)) == len(data))
        losses = signals(items, "loss")
        # a replay from seq 0 (the hybrid capture's) had everything: nothing lost
        assert [(x.first_seq, x.last_seq) for x in losses] == ([(0, first - 1)] if first else [])
        got = deliveries(items)
        assert [d.seq for d in got] == [decode_seq(f[seq_at]) for f in data]
        for delivery, frames in zip(got, data, strict=True):
            assert_same_fields(delivery.batch, frames[-1])
        stats = sub.stats()[spec.worker, 0]
        assert stats.replayed == len(data) and stats.lost == first and stats.malformed == 0
    finally:
        sub.close()
        pub.close()
        router.close()
