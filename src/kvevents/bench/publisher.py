"""Publisher throughput and latency against a bare pyzmq PUB, end to end over tcp loopback.

A subscriber in another process (spawned) only counts messages, checking every sequence
number and decoding one message in 1,000, so that it is not the bottleneck. Each round
sends ``messages`` batches of ``blocks`` blocks of 16 tokens (one ``BlockStored`` chain
per batch) three ways, in the same run:

* **ceiling**: a bare pyzmq PUB sending pre-encoded frames ``[topic, seq, payload]``
  with ``send_multipart`` from the caller's thread;
* **raw ceiling**: the same frames sent with pyzmq's C-level per-frame ``send`` (what
  the publisher's sender thread calls): the most a Python sender can hope for;
* **publisher**: :class:`~kvevents.publish.zmq_publisher.ZmqEventPublisher` with its
  defaults (replay on) but the ceiling's unlimited send queue (``hwm=0``): with a bounded
  one a subscriber that falls behind has the PUB drop messages, which in service come
  back by replay and here would count as lost against a ceiling that cannot drop.

Before each round the sender sends probes until the subscriber has heard one, so the
slow-joiner effect loses nothing. Throughput is ``messages * blocks`` over the time from
the first send to the subscriber's last receive (``time.monotonic``, one clock for both
processes on Linux); ``publish()`` latency is timed around every call; CPU seconds are
the sending process's, all threads, per million blocks. Rounds alternate the three ways
and repeat; the summary takes the median round of each.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvevents.publish.zmq_publisher import ZmqEventPublisher
from kvevents.wire.codec import decode_batch, encode_batch
from kvevents.wire.events import BlockStored, KVEventBatch

__all__ = ["make_batch", "run_publisher_bench"]

TOKENS_PER_BLOCK = 16
# A real batch is published right after the scheduler built it, so its objects are hot in
# the CPU cache; cycling through a few dozen prebuilt batches keeps that true here, where
# thousands would measure cache misses on token lists instead of the publisher.
DISTINCT_BATCHES = 64
_SEQ = struct.Struct(">Q")
_IDLE_MS = 3000  # the subscriber ends a round after this long without a message


def make_batch(blocks: int, seed: int) -> KVEventBatch:
    """A step's batch: one chain of ``blocks`` blocks of 16 tokens, SGLang-style signed hashes."""
    base = (seed * 0x9E3779B97F4A7C15) % (1 << 62)
    event = BlockStored(
        block_hashes=[base + i for i in range(blocks)],
        parent_block_hash=base - 1,
        token_ids=[(seed + i) % 32_000 for i in range(blocks * TOKENS_PER_BLOCK)],
        block_size=TOKENS_PER_BLOCK,
        lora_id=None,
        medium="GPU",
    )
    return KVEventBatch(ts=time.time(), events=[event])


# --- the subscriber process ---------------------------------------------------------------


def _subscriber(conn: Any) -> None:
    """Count live messages per round as told over ``conn``; report counts and clock readings."""
    ctx = zmq.Context()
    try:
        while True:
            order = conn.recv()
            if order is None:
                return
            conn.send(_count_round(ctx, conn, **order))
    finally:
        ctx.destroy(linger=0)


def _count_round(
    ctx: zmq.Context[Any], conn: Any, endpoint: str, messages: int, blocks: int
) -> dict[str, Any]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        if not sub.poll(30_000):
            return {"error": "no probe arrived within 30 s"}
        conn.send("heard")
        probes = conn.recv()  # the sender stopped probing after `probes` messages
        last = -1
        while last < probes - 1:
            if not sub.poll(_IDLE_MS):
                return {"error": f"probe {probes - 1} never arrived"}
            last = _SEQ.unpack(sub.recv_multipart()[1])[0]
        conn.send("armed")
        cpu0 = time.process_time()
        received = gaps = bad = 0
        expected = probes
        t_first = t_last = 0.0
        # Every live message is exactly [topic, seq, payload] and arrives whole, so once its
        # first frame is there the next two are: three C-level receives, no RCVMORE checks.
        frame: Callable[[int], bytes] = super(zmq.Socket, sub).recv
        nowait = int(zmq.NOBLOCK)
        while received < messages and sub.poll(_IDLE_MS):
            if not received:
                t_first = time.monotonic()
            while received < messages:  # drain what is there without polling per message
                try:
                    frame(nowait)
                except zmq.Again:
                    break
                seq = _SEQ.unpack(frame(0))[0]
                payload = frame(0)
                if seq != expected:
                    gaps += 1
                expected = seq + 1
                received += 1
                if received % 1000 == 1:
                    sample = decode_batch(payload)
                    if len(sample.events[0].block_hashes) != blocks:  # type: ignore[union-attr]
                        bad += 1
            t_last = time.monotonic()
        return {
            "received": received,
            "last_seq": expected - 1,
            "first_seq": probes,
            "seq_gaps": gaps,
            "bad_samples": bad,
            "t_first": t_first,
            "t_last": t_last,
            "cpu_s": time.process_time() - cpu0,
        }
    finally:
        sub.close(linger=0)


# --- the sending side ---------------------------------------------------------------------


def _sync(probe: Callable[[], None], conn: Any, endpoint: str, messages: int, blocks: int) -> int:
    """Probe until the subscriber hears one; return how many probes were sent."""
    conn.send({"endpoint": endpoint, "messages": messages, "blocks": blocks})
    probes = 0
    deadline = time.monotonic() + 30
    while True:
        probe()
        probes += 1
        if conn.poll(0.01):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"subscriber never heard the publisher at {endpoint}")
    if conn.recv() != "heard":
        raise RuntimeError("subscriber protocol error")
    conn.send(probes)
    if conn.recv() != "armed":
        raise RuntimeError("subscriber protocol error")
    return probes


def _ceiling_round(conn: Any, messages: int, blocks: int, *, raw: bool = False) -> dict[str, Any]:
    """The bare PUB: ``send_multipart`` (the issue's ceiling) or, ``raw``, C-level frame sends."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # unlimited: the ceiling may outrun the subscriber, not lose
    pub.bind("tcp://127.0.0.1:0")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        topic = b""
        payloads = [
            encode_batch(_with_rank(make_batch(blocks, s))) for s in range(DISTINCT_BATCHES)
        ]
        sent = [0]

        def probe() -> None:
            pub.send_multipart([topic, _SEQ.pack(sent[0]), encode_batch(KVEventBatch(0.0, []))])
            sent[0] += 1

        first = _sync(probe, conn, endpoint, messages, blocks)
        seqs = [_SEQ.pack(first + i) for i in range(messages)]
        latencies = [0] * messages
        clock = time.perf_counter_ns
        if raw:
            frame: Callable[[bytes, int], Any] = super(zmq.Socket, pub).send
            more = int(zmq.SNDMORE)
        send = pub.send_multipart
        cpu0, t0 = time.process_time(), time.monotonic()
        if raw:
            for i in range(messages):
                start = clock()
                frame(topic, more)
                frame(seqs[i], more)
                frame(payloads[i % DISTINCT_BATCHES], 0)
                latencies[i] = clock() - start
        else:
            for i in range(messages):
                start = clock()
                send([topic, seqs[i], payloads[i % DISTINCT_BATCHES]])
                latencies[i] = clock() - start
        result = conn.recv()
        cpu = time.process_time() - cpu0
        kind = "raw_ceiling" if raw else "ceiling"
        return _summary(kind, result, t0, cpu, latencies, messages, blocks, {})
    finally:
        pub.close(linger=0)
        ctx.term()


def _raw_ceiling_round(conn: Any, messages: int, blocks: int) -> dict[str, Any]:
    return _ceiling_round(conn, messages, blocks, raw=True)


def _publisher_round(conn: Any, messages: int, blocks: int) -> dict[str, Any]:
    pub = ZmqEventPublisher(
        0, "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True, hwm=0
    )
    try:
        batches = [make_batch(blocks, s) for s in range(DISTINCT_BATCHES)]
        empty = KVEventBatch(ts=0.0, events=[])
        _sync(lambda: pub.publish(empty), conn, pub.endpoint, messages, blocks)
        latencies = [0] * messages
        publish, clock = pub.publish, time.perf_counter_ns
        cpu0, t0 = time.process_time(), time.monotonic()
        for i in range(messages):
            start = clock()
            publish(batches[i % DISTINCT_BATCHES])
            latencies[i] = clock() - start
        pub.flush(timeout=60)
        result = conn.recv()
        cpu = time.process_time() - cpu0
        stats = pub.stats
        extra = {"dropped": stats.dropped, "handoffs": stats.handoffs}
        return _summary("publisher", result, t0, cpu, latencies, messages, blocks, extra)
    finally:
        pub.shutdown()


def _with_rank(batch: KVEventBatch) -> KVEventBatch:
    batch.data_parallel_rank = 0
    return batch


def _summary(
    kind: str,
    sub: dict[str, Any],
    t0: float,
    cpu: float,
    latencies: list[int],
    messages: int,
    blocks: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    if "error" in sub:
        raise RuntimeError(f"{kind} round: subscriber: {sub['error']}")
    latencies.sort()
    elapsed = sub["t_last"] - t0
    delivered = sub["received"] * blocks
    return {
        "kind": kind,
        "blocks_per_batch": blocks,
        "messages": messages,
        "received": sub["received"],
        "lost": messages - sub["received"],
        "seq_gaps": sub["seq_gaps"],
        "seq_range": [sub["first_seq"], sub["last_seq"]],
        "bad_samples": sub["bad_samples"],
        "seconds": elapsed,
        "messages_per_s": sub["received"] / elapsed,
        "blocks_per_s": delivered / elapsed,
        "call_us": {
            "p50": latencies[len(latencies) // 2] / 1e3,
            "p99": latencies[int(len(latencies) * 0.99)] / 1e3,
            "p999": latencies[int(len(latencies) * 0.999)] / 1e3,
            "max": latencies[-1] / 1e3,
            "calls_over_1ms": sum(1 for t in latencies if t > 1_000_000),
            "calls_over_5ms": sum(1 for t in latencies if t > 5_000_000),
        },
        "sender_cpu_s_per_million_blocks": cpu / delivered * 1e6 if delivered else None,
        "subscriber_cpu_s": sub["cpu_s"],
        **extra,
    }


def run_publisher_bench(
    messages: int = 200_000,
    block_counts: tuple[int, ...] = (1, 32),
    repeats: int = 3,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every round and return the figures (see the module docstring).

    ``progress`` is called with each round's result as it finishes. The returned dict
    has ``rounds`` (all of them) and ``cases`` (per batch size: the median ceiling and
    publisher rounds by throughput, the share of the ceiling, and whether the targets
    were met: share >= 0.9, nothing lost, publish() p99 <= 5 us and max <= 5 ms).
    """
    load_before = os.getloadavg()
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    proc = spawn.Process(target=_subscriber, args=(theirs,), name="kvevents-bench-subscriber")
    proc.start()
    rounds: list[dict[str, Any]] = []
    try:
        for blocks in block_counts:
            for _ in range(repeats):
                for round_fn in (_ceiling_round, _raw_ceiling_round, _publisher_round):
                    result = round_fn(ours, messages, blocks)
                    rounds.append(result)
                    if progress is not None:
                        progress(result)
        ours.send(None)
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        ours.close()
        theirs.close()
    cases = [_case(rounds, blocks) for blocks in block_counts]
    return {
        "setup": {
            "messages_per_round": messages,
            "tokens_per_block": TOKENS_PER_BLOCK,
            "repeats": repeats,
            "transport": "tcp loopback",
            "switch_interval_s": sys.getswitchinterval(),
            # Other processes compete for the same cores; these say how busy the box was.
            "loadavg_1m_before": load_before[0],
            "loadavg_1m_after": os.getloadavg()[0],
        },
        "rounds": rounds,
        "cases": cases,
    }


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(rounds, key=lambda r: r["blocks_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def _case(rounds: list[dict[str, Any]], blocks: int) -> dict[str, Any]:
    mine = [r for r in rounds if r["blocks_per_batch"] == blocks]
    ceiling = _median_round([r for r in mine if r["kind"] == "ceiling"])
    raw = _median_round([r for r in mine if r["kind"] == "raw_ceiling"])
    ours = _median_round([r for r in mine if r["kind"] == "publisher"])
    share = ours["blocks_per_s"] / ceiling["blocks_per_s"]
    lost = sum(
        r["lost"] + r["seq_gaps"] + r.get("dropped", 0) for r in mine if r["kind"] == "publisher"
    )
    p99 = statistics.median(r["call_us"]["p99"] for r in mine if r["kind"] == "publisher")
    worst_max = max(r["call_us"]["max"] for r in mine if r["kind"] == "publisher")
    return {
        "blocks_per_batch": blocks,
        "ceiling_blocks_per_s": ceiling["blocks_per_s"],
        "publisher_blocks_per_s": ours["blocks_per_s"],
        "share_of_ceiling": share,
        "raw_ceiling_blocks_per_s": raw["blocks_per_s"],
        "share_of_raw_ceiling": ours["blocks_per_s"] / raw["blocks_per_s"],
        "publish_us": ours["call_us"],
        "publish_p99_us_median": p99,
        "publish_max_us_worst": worst_max,
        "publish_calls_over_5ms": sum(
            r["call_us"]["calls_over_5ms"] for r in mine if r["kind"] == "publisher"
        ),
        "ceiling_call_max_us_worst": max(
            r["call_us"]["max"] for r in mine if r["kind"] == "ceiling"
        ),
        "ceiling_calls_over_5ms": sum(
            r["call_us"]["calls_over_5ms"] for r in mine if r["kind"] == "ceiling"
        ),
        # The same for the C-level send loop: what the OS alone does to a single thread
        # sending on this machine, with no second Python thread to wait for.
        "raw_ceiling_call_max_us_worst": max(
            r["call_us"]["max"] for r in mine if r["kind"] == "raw_ceiling"
        ),
        "raw_ceiling_calls_over_5ms": sum(
            r["call_us"]["calls_over_5ms"] for r in mine if r["kind"] == "raw_ceiling"
        ),
        "publish_calls": sum(r["messages"] for r in mine if r["kind"] == "publisher"),
        "sender_cpu_s_per_million_blocks": ours["sender_cpu_s_per_million_blocks"],
        "ceiling_cpu_s_per_million_blocks": ceiling["sender_cpu_s_per_million_blocks"],
        "lost_in_all_rounds": lost,
        "targets": {
            "share_ge_0.9": share >= 0.9,
            "nothing_lost": lost == 0,
            "p99_le_5us": p99 <= 5.0,
            "max_le_5ms": worst_max <= 5000.0,
        },
    }
