"""Subscriber throughput: batches and blocks decoded per second, and per CPU second.

A producer process (spawned, so it runs on its own core) sends pre-encoded live frames
on one XPUB socket per stream as fast as ZMQ takes them; the subscriber process runs a
real :class:`~kvevents.subscribe.subscriber.Subscriber` and a consumer that takes every item.
Both high-water marks are unlimited, so nothing is dropped and the figure is the
subscriber's own speed. The producer waits until every stream's subscription has
arrived (XPUB) before sending, so the slow-joiner effect cannot lose the start.

Two modes: ``backlog`` times the subscriber draining messages that already arrived
(no producer competing for the two cores: the subscriber's capacity), ``live`` times
it while the producer sends (what a deployment on one small machine sees).

Measured in the subscriber process: wall time and process CPU time (all its threads:
the socket thread, ZMQ's I/O thread and the consumer). "Per CPU second" figures divide
by CPU seconds, i.e. per core. For reference the same payloads are decoded in a bare
``decode_batch`` loop (the ceiling for decoding alone).
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import zmq

from kvevents.subscribe.discovery import StreamSpec
from kvevents.subscribe.items import Delivery
from kvevents.subscribe.subscriber import Subscriber
from kvevents.wire.codec import decode_batch, encode_batch
from kvevents.wire.events import BlockStored, KVEventBatch
from kvevents.wire.frames import encode_seq

__all__ = ["make_payload", "run_subscriber_bench"]

TOKENS_PER_BLOCK = 16


def make_payload(blocks: int, seed: int = 0) -> bytes:
    """One batch: a single BlockStored chain of ``blocks`` blocks of 16 tokens (map encoding)."""
    base = seed * 1_000_003
    event = BlockStored(
        block_hashes=[base + i for i in range(blocks)],
        parent_block_hash=base - 1,
        token_ids=list(range(base % 50_000, base % 50_000 + blocks * TOKENS_PER_BLOCK)),
        block_size=TOKENS_PER_BLOCK,
        lora_id=None,
        medium="GPU",
    )
    return encode_batch(KVEventBatch(ts=time.time(), events=[event], data_parallel_rank=0))


def _produce(
    addresses_out: Any, go: Any, sent: Any, done: Any, streams: int, batches: int, blocks: int
) -> None:
    """Producer process: bind one XPUB per stream, wait for subscribers, send everything."""
    ctx = zmq.Context()
    socks = []
    try:
        for _ in range(streams):
            s = ctx.socket(zmq.XPUB)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 5000)
            s.bind("tcp://127.0.0.1:0")
            socks.append(s)
        addresses_out.send([s.getsockopt_string(zmq.LAST_ENDPOINT) for s in socks])
        for s in socks:
            if not s.poll(30_000):
                return
            s.recv()
        if not go.wait(30):
            return
        payload = make_payload(blocks)
        topic = b""
        for seq in range(batches):
            seq_frame = encode_seq(seq)
            for s in socks:
                s.send_multipart((topic, seq_frame, payload), copy=False)
        sent.set()
        done.wait(120)  # keep the connections up until the subscriber has everything
    finally:
        for s in socks:
            s.close()
        ctx.term()


def _measure(streams: int, batches: int, blocks: int, mode: str, timeout: float) -> dict[str, Any]:
    """One case. ``mode="live"``: consume while the producer sends. ``"backlog"``: let
    everything arrive first (the socket thread stops after ``max_buffered`` items, ZMQ
    queues the rest), then time draining it; the first ``max_buffered`` items, decoded
    before the clock started, are not counted."""
    mp = multiprocessing.get_context("spawn")
    parent, child = mp.Pipe()
    go, sent, done = mp.Event(), mp.Event(), mp.Event()
    proc = mp.Process(
        target=_produce, args=(child, go, sent, done, streams, batches, blocks), daemon=True
    )
    proc.start()
    total = streams * batches
    max_buffered = 1024
    kinds: dict[str, int] = {}
    try:
        if not parent.poll(30):
            raise RuntimeError("benchmark producer did not start within 30 s")
        addresses = parent.recv()
        specs = [StreamSpec.from_endpoint(a, worker=f"bench-{i}") for i, a in enumerate(addresses)]
        with Subscriber(streams=specs, rcvhwm=0, max_buffered=max_buffered) as sub:
            go.set()
            skip = 0
            if mode == "backlog":
                if not sent.wait(timeout):
                    raise RuntimeError(f"producer did not finish sending within {timeout} s")
                skip = max_buffered
            got = counted = blocks_seen = 0
            wall = cpu = 0.0
            deadline = time.monotonic() + timeout
            while got < total and time.monotonic() < deadline:
                item = sub.get(timeout=1.0)
                if item is None:
                    continue
                if not isinstance(item, Delivery):
                    kinds[item.kind] = kinds.get(item.kind, 0) + 1
                    continue
                got += 1
                if got == skip + 1:
                    wall, cpu = time.perf_counter(), time.process_time()
                elif got > skip + 1:
                    counted += 1
                    for event in item.batch.events:
                        blocks_seen += len(event.block_hashes)  # type: ignore[union-attr]
            wall = time.perf_counter() - wall
            cpu = time.process_time() - cpu
        done.set()
        proc.join(10)
    finally:
        done.set()
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return {
        "mode": mode,
        "streams": streams,
        "blocks_per_batch": blocks,
        "batches_sent": total,
        "batches_delivered": got,
        "batches_timed": counted,
        "signals": kinds,
        "wall_s": wall,
        "cpu_s": cpu,
        "batches_per_s": counted / wall if wall > 0 else 0.0,
        "blocks_per_s": blocks_seen / wall if wall > 0 else 0.0,
        "batches_per_cpu_s": counted / cpu if cpu > 0 else 0.0,
        "blocks_per_cpu_s": blocks_seen / cpu if cpu > 0 else 0.0,
    }


def _decode_ceiling(blocks: int, seconds: float = 0.5) -> dict[str, float]:
    payload = make_payload(blocks)
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(200):
            decode_batch(payload)
        n += 200
    dt = time.perf_counter() - start
    return {"batches_per_s": n / dt, "blocks_per_s": n * blocks / dt}


def run_subscriber_bench(
    *,
    stream_counts: tuple[int, ...] = (1, 4),
    block_counts: tuple[int, ...] = (1, 32),
    modes: tuple[str, ...] = ("backlog", "live"),
    blocks_target: int = 2_000_000,
    max_batches: int = 100_000,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """Run every (streams, blocks per batch) case; returns a JSON-ready dict.

    Each case sends about ``blocks_target`` blocks in total (at most ``max_batches``
    batches per stream).
    """
    for mode in modes:
        if mode not in ("backlog", "live"):
            raise ValueError(f"run_subscriber_bench: mode {mode!r} is not 'backlog' or 'live'")
    cases = []
    for mode in modes:
        for blocks in block_counts:
            for streams in stream_counts:
                batches = max(2_000, min(max_batches, blocks_target // (blocks * streams)))
                cases.append(_measure(streams, batches, blocks, mode, timeout))
    return {
        "benchmark": "subscriber",
        "tokens_per_block": TOKENS_PER_BLOCK,
        "cases": cases,
        "decode_ceiling": {str(b): _decode_ceiling(b) for b in block_counts},
        "target_blocks_per_cpu_s_32": 1_000_000,
    }
