"""A publisher that restarts on the same ports while nothing new is published, over real sockets."""

from __future__ import annotations

import time

import pytest
import zmq

from kvevents import KVEventBatch, Reset, StreamSpec, Subscriber
from kvevents.wire.codec import encode_batch
from kvevents.wire.frames import live_frames, replay_end_frames
from subscriber_support import (
    bind_local,
    collect,
    deliveries,
    recv_replay_request,
    signals,
    wait_subscribed,
)

TOPIC = b"kv"


def _rebind(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, address: str) -> zmq.Socket[bytes]:
    """A socket bound again on ``address``, retried while a just-closed socket still holds it
    (ZMQ closes in its I/O thread, a moment after ``close()`` returns)."""
    deadline = time.monotonic() + 10.0
    while True:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(address)
            return sock
        except zmq.ZMQError as exc:
            sock.close()
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.slow
def test_a_restart_whose_replay_answers_late_is_still_verified_and_reset(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The restarted publisher's replay ignores the first two verifications (it is not up
    yet) and nothing live comes after the reconnect, as when the SUB missed the new
    engine's first batch while reconnecting: the subscriber must keep verifying until the
    replay answers, and then reset the stream. It used to verify twice (on reconnect, and
    one tail probe) and then wait for a live batch that might never come."""
    xpub, live = bind_local(zmq_context, zmq.XPUB)
    router, replay = bind_local(zmq_context, zmq.ROUTER)
    spec = StreamSpec.from_endpoint(live, replay_endpoint=replay, topic=TOPIC.decode())
    sub = Subscriber(streams=[spec], replay_timeout=0.3, tail_probe=0.3, retry_max=0.2)
    try:
        identity, start = recv_replay_request(router)
        assert start == 0
        router.send_multipart([identity, *replay_end_frames()])  # nothing buffered yet
        wait_subscribed(xpub)
        for seq in range(3):
            xpub.send_multipart(
                live_frames(TOPIC, seq, encode_batch(KVEventBatch(ts=1.0, events=[])))
            )
        collect(sub, until=lambda got: len(deliveries(got)) == 3)

        # The publisher restarts on the same ports and publishes nothing.
        xpub.close()
        router.close()
        xpub = _rebind(zmq_context, zmq.XPUB, live)
        router = _rebind(zmq_context, zmq.ROUTER, replay)
        ignored = [recv_replay_request(router)[1] for _ in range(2)]
        assert ignored == [2, 2]  # both verify the last batch delivered
        identity, start = recv_replay_request(router)
        assert start == 2
        router.send_multipart([identity, *replay_end_frames()])  # empty: a new publisher
        items = collect(sub, until=lambda got: bool(signals(got, "reset")))
        (reset,) = signals(items, "reset")
        assert isinstance(reset, Reset) and reset.dp_rank == spec.dp_rank
        assert "restarted" in reset.reason, reset
    finally:
        sub.close()
        xpub.close()
        router.close()
