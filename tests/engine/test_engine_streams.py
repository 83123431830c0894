"""`kvevents engine` end to end: every rank streams on its own advertised port, completely."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq
from engine_support import Engine, RankStreams, published_counts

from kvevents import AllBlocksCleared, BlockRemoved
from kvevents.transport.endpoints import free_port_range

pytestmark = pytest.mark.slow

KV_CONFIG = {
    "publisher": "zmq",
    "endpoint": "tcp://*:0",
    "replay_endpoint": "tcp://*:0",
    "topic": "kv",
}
PAGE = 4
MAX_BLOCKS = 12


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def prompt(prefix: int, suffix: int, pages: int = 3) -> list[int]:
    """A prompt of `pages` full pages plus 1 token: two shared prefix pages, then its own."""
    shared = [1000 + prefix] * (2 * PAGE)
    own = [suffix * 10 + i for i in range((pages - 2) * PAGE + 1)]
    return shared + own


def check_consistent(engine: Engine, streams: RankStreams, dp_size: int) -> dict[int, set[int]]:
    streams.collect(published_counts(engine))
    held = {}
    for rank in range(dp_size):
        held[rank] = streams.held(rank)
        assert held[rank] == engine.kv_blocks(rank), f"rank {rank}: events disagree with /kv_blocks"
    return held


def run_workload(engine: Engine, ctx: zmq.Context, dp_size: int) -> None:
    info = engine.server_info()
    assert info["dp_size"] == dp_size
    block = info["kv_events"]
    assert block["dp_size"] == dp_size and block["block_size"] == PAGE
    assert [p["dp_rank"] for p in block["publishers"]] == list(range(dp_size))
    assert len({p["endpoint"] for p in block["publishers"]}) == dp_size, "ranks share a port"
    streams = RankStreams(ctx, block, engine.url)
    try:
        # Shared prefixes, each rank chosen explicitly: the second prompt of a prefix hits.
        for rank in range(dp_size):
            first = engine.generate(prompt(rank, 1), rank)
            again = engine.generate(prompt(rank, 2), rank)
            assert (first["dp_rank"], first["cached_tokens"]) == (rank, 0)
            assert (again["dp_rank"], again["cached_tokens"]) == (rank, 2 * PAGE)
        held = check_consistent(engine, streams, dp_size)
        assert all(len(h) == 4 for h in held.values())  # 2 shared + 1 + 1 pages per rank
        assert len(set().union(*held.values())) == 4 * dp_size  # prefixes differ per rank

        # Evictions: more distinct pages than a rank holds.
        for rank in range(dp_size):
            for suffix in range(3, 12):
                engine.generate(prompt(100 + suffix, suffix), rank)
        held = check_consistent(engine, streams, dp_size)
        for rank in range(dp_size):
            assert len(held[rank]) == MAX_BLOCKS
            events = [e for b in streams.batches[rank].values() for e in b.events]
            assert any(isinstance(e, BlockRemoved) for e in events), f"rank {rank} never evicted"

        # A flush, then more prompts.
        assert engine.http.post("/flush_cache").json() == {"flushed": list(range(dp_size))}
        for rank in range(dp_size):
            engine.generate(prompt(7, 7), rank)
        held = check_consistent(engine, streams, dp_size)
        for rank in range(dp_size):
            events = [e for b in streams.batches[rank].values() for e in b.events]
            assert any(isinstance(e, AllBlocksCleared) for e in events)
            assert len(held[rank]) == 3
        assert all(streams.live_received[r] > 0 for r in range(dp_size)), streams.live_received
    finally:
        streams.close()


def test_pure_dp_four_ranks_each_stream_matches_its_kv_blocks(ctx: zmq.Context) -> None:
    """With --dp-size 4 (pure DP) each rank publishes on its own port and its events equal /kv_blocks, through evictions and a flush."""
    engine = Engine(
        ["--dp-size", "4", "--page-size", str(PAGE), "--max-blocks", str(MAX_BLOCKS)], KV_CONFIG
    )
    try:
        run_workload(engine, ctx, 4)
    finally:
        engine.stop()


def test_dp_attention_streams_match_kv_blocks(ctx: zmq.Context) -> None:
    """With --enable-dp-attention each attention-DP rank publishes on its own port and its events equal /kv_blocks."""
    engine = Engine(
        [
            "--dp-size",
            "2",
            "--enable-dp-attention",
            "--page-size",
            str(PAGE),
            "--max-blocks",
            str(MAX_BLOCKS),
        ],
        KV_CONFIG,
    )
    try:
        info = engine.server_info()
        assert info["enable_dp_attention"] and info["tp_size"] == 2
        run_workload(engine, ctx, 2)
    finally:
        engine.stop()


def test_tp2_still_has_exactly_dp_size_publishers(ctx: zmq.Context) -> None:
    """With --tp-size 2 in pure DP only attention-TP rank 0 publishes: exactly dp_size streams, all consistent."""
    engine = Engine(
        [
            "--dp-size",
            "2",
            "--tp-size",
            "2",
            "--page-size",
            str(PAGE),
            "--max-blocks",
            str(MAX_BLOCKS),
        ],
        KV_CONFIG,
    )
    try:
        info = engine.server_info()
        schedulers = info["schedulers"]
        assert len(schedulers) == 4
        publishing = [s for s in schedulers if s["publishes"]]
        assert [(s["dp_rank"], s["attn_tp_rank"], s["publisher_rank"]) for s in publishing] == [
            (0, 0, 0),
            (1, 0, 1),
        ]
        assert len(info["kv_events"]["publishers"]) == 2
        run_workload(engine, ctx, 2)
    finally:
        engine.stop()


def test_fixed_base_port_gives_base_plus_rank_streams(ctx: zmq.Context) -> None:
    """With a fixed base port, pure-DP rank r publishes on base + r (replay on its base + r) and the block says so."""
    base = free_port_range(8)
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{base}",
        "replay_endpoint": f"tcp://*:{base + 4}",
        "topic": "kv",
    }
    engine = Engine(["--dp-size", "4", "--page-size", str(PAGE)], config)
    try:
        block = engine.server_info()["kv_events"]
        assert block["endpoint_port_base"] == base
        assert block["replay_endpoint_port_base"] == base + 4
        assert block["ports_consecutive"] is True
        # the config's wildcard is bound, and advertised, as --kv-events-host (loopback)
        assert block["endpoint_host"] == "127.0.0.1"
        # Connect by the base + rank rule alone, as an SGLang-era consumer would.
        by_rule = dict(block)
        by_rule["publishers"] = [
            {
                "dp_rank": r,
                "endpoint": f"tcp://127.0.0.1:{base + r}",
                "replay_endpoint": f"tcp://127.0.0.1:{base + 4 + r}",
            }
            for r in range(4)
        ]
        assert by_rule["publishers"] == block["publishers"]
        streams = RankStreams(ctx, by_rule, engine.url)
        try:
            for rank in range(4):
                engine.generate(prompt(rank, rank), rank)
            check_consistent(engine, streams, 4)
        finally:
            streams.close()
    finally:
        engine.stop()
