"""vLLM's own KV-event messages, on every data-parallel rank, decoded by kvevents.wire.

Raw pyzmq sockets here (no Subscriber), so a failure points at the wire layer alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from real_vllm_helpers import Prompts, RealVLLM, VLLMClient

from kvevents import BlockStored, KVEventBatch, decode_batch, hash_to_int
from kvevents.wire.frames import parse_live_frames, parse_replay_reply, replay_request_frames

RECV_TIMEOUT_S = 15.0


class RankTap:
    """A SUB socket on one rank's live endpoint; every message kept as (seq, payload)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, topic: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sock.connect(endpoint)
        try:
            if not monitor.poll(int(RECV_TIMEOUT_S * 1000)):
                raise AssertionError(f"no ZMQ handshake with vLLM's publisher at {endpoint}")
            monitor.recv_multipart()
        finally:
            self.sock.disable_monitor()
            monitor.close(linger=0)
        self.endpoint = endpoint
        self.topic = topic
        self.seen: list[tuple[int, bytes]] = []

    def next_batch(self, timeout: float = RECV_TIMEOUT_S) -> tuple[bytes, int, bytes]:
        """The next live message as (topic, seq, payload); fails after ``timeout``."""
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"no KV event from {self.endpoint} within {timeout:.0f} s")
        msg = parse_live_frames(self.sock.recv_multipart())
        self.seen.append((msg.seq, msg.payload))
        return msg.topic, msg.seq, msg.payload

    def batch_storing(self, first_block: list[int]) -> tuple[bytes, int, bytes, KVEventBatch]:
        """Read live messages until one stores a chain starting with ``first_block``."""
        while True:
            topic, seq, payload = self.next_batch()
            batch = decode_batch(payload)
            for event in batch.events:
                if (
                    isinstance(event, BlockStored)
                    and event.token_ids[: len(first_block)] == first_block
                ):
                    return topic, seq, payload, batch


@pytest.fixture
def taps(vllm: RealVLLM) -> Iterator[list[RankTap]]:
    """One connected SUB socket per data-parallel rank (all closed after the test)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    out: list[RankTap] = []
    try:
        for rank in range(vllm.dp_size):
            out.append(RankTap(ctx, vllm.rank_endpoint(rank), vllm.topic))
        yield out
    finally:
        for tap in out:
            tap.sock.close(linger=0)
        ctx.term()


def _raw_events(payload: bytes) -> list[dict[str, Any]]:
    """The payload decoded as plain msgpack (no schema): what vLLM really put there."""
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3, raw
    events = raw[1]
    assert all(isinstance(e, dict) for e in events), "vLLM 0.32 sends tagged maps"
    return list(events)


def test_each_rank_publishes_what_it_stored_on_its_own_port(
    vllm: RealVLLM, client: VLLMClient, taps: list[RankTap]
) -> None:
    """A prompt sent with X-data-parallel-rank: r is stored by rank r alone, announced on port base + r in a batch tagged r with vLLM's extra fields."""
    prompts = Prompts("wire-per-rank")
    bs = vllm.block_size
    for rank, tap in enumerate(taps):
        prompt = prompts.fresh(3 * bs + 4)
        client.complete(prompt, rank)
        topic, _seq, payload, batch = tap.batch_storing(prompt[:bs])
        assert topic == vllm.topic.encode()
        assert batch.data_parallel_rank == rank
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        event = next(e for e in stored if e.token_ids[:bs] == prompt[:bs])
        # Only full blocks are stored: 3 of them, the 4 trailing tokens are not.
        assert event.token_ids == prompt[: 3 * bs]
        assert len(event.block_hashes) == 3
        assert event.parent_block_hash is None
        assert event.block_size == bs
        assert event.medium == "GPU"
        assert event.group_idx == 0
        assert event.kv_cache_spec_kind == "full_attention"
        assert event.extra_keys == [None, None, None]
        assert event.lora_name is None and event.lora_id is None
        raw = next(e for e in _raw_events(payload) if e.get("token_ids", [])[:bs] == prompt[:bs])
        assert {"lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"} <= raw.keys()
        # No other rank saw this prompt.
        for other, other_tap in enumerate(taps):
            if other != rank and other_tap.sock.poll(200):
                _t, _s, other_payload = other_tap.next_batch()
                for e in decode_batch(other_payload).events:
                    if isinstance(e, BlockStored):
                        assert e.token_ids[:bs] != prompt[:bs], (
                            f"rank {other} stored rank {rank}'s prompt"
                        )


def test_block_hashes_decode_exactly_as_vllm_sent_them(
    vllm: RealVLLM, client: VLLMClient, taps: list[RankTap]
) -> None:
    """Every block hash decodes to the very value in vLLM's msgpack: uint64 (some above 2**63) in int mode, 32 raw bytes in bytes mode."""
    prompts = Prompts("wire-hashes")
    bs = vllm.block_size
    hashes: list[int | bytes] = []
    for attempt in range(12):
        rank = attempt % vllm.dp_size
        prompt = prompts.fresh(3 * bs + 1)
        client.complete(prompt, rank)
        _topic, _seq, payload, batch = taps[rank].batch_storing(prompt[:bs])
        raw_events = _raw_events(payload)
        assert len(raw_events) == len(batch.events)
        for raw, event in zip(raw_events, batch.events, strict=True):
            assert raw["type"] == type(event).__name__
            if "block_hashes" in raw:
                decoded = event.block_hashes  # type: ignore[union-attr]
                assert decoded == raw["block_hashes"]
                assert [type(h) for h in decoded] == [type(h) for h in raw["block_hashes"]]
                hashes.extend(decoded)
            if raw.get("parent_block_hash") is not None:
                assert event.parent_block_hash == raw["parent_block_hash"]  # type: ignore[union-attr]
        if vllm.hash_mode == "int" and any(isinstance(h, int) and h >= 2**63 for h in hashes):
            break
        if vllm.hash_mode == "bytes" and len(hashes) >= 6:
            break
    if vllm.hash_mode == "int":
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
        big = [h for h in hashes if isinstance(h, int) and h >= 2**63]
        assert big, f"no hash above 2**63 among {len(hashes)} (probability 2**-{len(hashes)})"
        assert all(hash_to_int(h) == h for h in big), "hash_to_int must not fold unsigned values"
    else:
        assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
        assert all(0 <= hash_to_int(h) < 2**64 for h in hashes)


def test_replay_returns_the_live_messages_byte_for_byte(
    vllm: RealVLLM, client: VLLMClient, taps: list[RankTap]
) -> None:
    """vLLM's replay socket on port rbase + r answers a DEALER with 4-frame replies equal to rank r's live messages, then the end marker."""
    prompts = Prompts("wire-replay")
    bs = vllm.block_size
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for rank, tap in enumerate(taps):
            for _ in range(2):
                prompt = prompts.fresh(2 * bs + 3)
                client.complete(prompt, rank)
                tap.batch_storing(prompt[:bs])
            live = dict(tap.seen)
            start = min(live)
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(vllm.rank_replay_endpoint(rank))
            dealer.send_multipart(replay_request_frames(start))
            replayed: dict[int, bytes] = {}
            try:
                while True:
                    if not dealer.poll(int(RECV_TIMEOUT_S * 1000)):
                        raise AssertionError(
                            f"replay from rank {rank} did not end within {RECV_TIMEOUT_S} s"
                        )
                    frames = dealer.recv_multipart()
                    reply = parse_replay_reply(frames)
                    if reply.is_end:
                        break
                    assert len(frames) == 4, "vLLM 0.32 sends [b'', topic, seq, payload]"
                    assert reply.topic == vllm.topic.encode()
                    replayed[reply.seq] = reply.payload
            finally:
                dealer.close(linger=0)
            assert sorted(replayed) == list(range(start, max(replayed) + 1))
            for seq, payload in live.items():
                assert replayed[seq] == payload, f"rank {rank} seq {seq}: replay differs from live"
    finally:
        ctx.term()


def test_vllm_lists_every_ranks_event_endpoints_offset_by_rank(
    vllm: RealVLLM, client: VLLMClient
) -> None:
    """vLLM's GET /kv_event_sources names, for rank r, the live and replay endpoints at base + r with the configured topic: the port rule consumers apply."""
    resp = client.http.get("/kv_event_sources")
    resp.raise_for_status()
    sources = resp.json()
    assert sorted(sources) == [str(r) for r in range(vllm.dp_size)]
    live_base = int(vllm.kv_endpoint.rpartition(":")[2])
    replay_base = int(vllm.replay_endpoint.rpartition(":")[2])
    for rank in range(vllm.dp_size):
        source = sources[str(rank)]
        assert source["endpoint"] == f"tcp://*:{live_base + rank}"
        assert source["replay_endpoint"] == f"tcp://*:{replay_base + rank}"
        assert source["topic"] == vllm.topic
        assert source["enable_kv_cache_events"] is True
