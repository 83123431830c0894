"""The Subscriber against the simulated engine: discovery, consistency, rank restart, late start."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import httpx
import pytest

from kvevents import Holder, Reset, Subscriber, Unreachable
from subscriber_support import (
    EngineProcess,
    HeldBlocks,
    collect,
    deliveries,
    free_tcp_port,
    signals,
    wait_for,
)

pytestmark = pytest.mark.slow

KV_CONFIG = {"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}


@pytest.fixture
def engine() -> Iterator[EngineProcess]:
    """A two-rank engine (pure DP) with 12 blocks per rank, so prompts evict, on OS-chosen ports."""
    eng = EngineProcess(["--port", "0", "--dp-size", "2", "--max-blocks", "12"], KV_CONFIG)
    try:
        yield eng
    finally:
        eng.stop()


def caught_up(
    sub: Subscriber, engine: EngineProcess, view: HeldBlocks, timeout: float = 20.0
) -> None:
    """Consume until every rank's delivered count equals what it published (bounded)."""
    expected = engine.published()

    def done(got: list) -> bool:
        view.apply(got)
        got.clear()
        return all(
            len(view.delivered.get(Holder(engine.url, r), [])) == n for r, n in expected.items()
        )

    collect(sub, until=done, timeout=timeout)


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts that share 32-token prefixes among themselves, 40..80 tokens long."""
    prefixes = [[rng.randrange(1000) for _ in range(32)] for _ in range(3)]
    return [
        rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(8, 48))]
        for _ in range(n)
    ]


def test_every_rank_discovered_and_held_blocks_match_the_engine(engine: EngineProcess) -> None:
    """From the engine URL alone, each rank's stream arrives complete: the blocks derived from it equal /kv_blocks, evictions included."""
    rng = random.Random(7)
    view = HeldBlocks()
    with Subscriber(engines=[engine.url]) as sub:
        for i, tokens in enumerate(prompts(rng, 16)):
            engine.generate(tokens, rank=i % 2)
        caught_up(sub, engine, view)
        for rank in (0, 1):
            holder = Holder(engine.url, rank)
            assert view.delivered[holder] == list(range(len(view.delivered[holder])))
            assert view.held[holder] == engine.kv_blocks(rank)
        assert view.removed > 0, "the prompts should have forced evictions"
        assert sub.engines()[engine.url].state == "subscribed"
        assert sub.engines()[engine.url].streams == 2
        stats = sub.stats()
        assert all(s.lost == 0 and s.resets == 0 for s in stats.values())


def test_rank_restart_resets_that_stream_only_and_follows_it_from_zero(
    engine: EngineProcess,
) -> None:
    """Killing and restarting rank 1 delivers Reset for rank 1 alone; its new stream is followed from seq 0 and matches the engine again."""
    rng = random.Random(11)
    view = HeldBlocks()
    r0, r1 = Holder(engine.url, 0), Holder(engine.url, 1)
    with Subscriber(engines=[engine.url], retry_max=0.5) as sub:
        for i, tokens in enumerate(prompts(rng, 8)):
            engine.generate(tokens, rank=i % 2)
        caught_up(sub, engine, view)
        before_r0 = list(view.delivered[r0])
        response = engine.http.post("/admin/restart_rank", params={"dp_rank": 1})
        assert response.status_code == 200, response.text
        resets: list = []

        def reset_seen(got: list) -> bool:
            resets.extend(signals(got, "reset"))
            view.apply(got)
            got.clear()
            return bool(resets)

        collect(sub, until=reset_seen)
        assert [r.holder for r in resets] == [r1]
        assert isinstance(resets[0], Reset)
        for tokens in prompts(rng, 4):
            engine.generate(tokens, rank=1)
        engine.generate(prompts(rng, 1)[0], rank=0)
        caught_up(sub, engine, view)
        assert view.delivered[r1] == list(range(engine.published()[1]))
        assert view.held[r1] == engine.kv_blocks(1)
        assert view.delivered[r0][: len(before_r0)] == before_r0
        assert view.held[r0] == engine.kv_blocks(0)
        assert sub.stats()[r0].resets == 0 and sub.stats()[r1].resets == 1


def test_engine_started_after_subscribing_works_and_one_never_started_is_reported() -> None:
    """An engine that starts after the subscriber is followed from seq 0; one that never starts is reported unreachable and blocks nothing."""
    port, never = free_tcp_port(), free_tcp_port()
    late_url, never_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{never}"
    with Subscriber(
        engines=[late_url, never_url], retry_initial=0.1, retry_max=0.5, discovery_timeout=0.5
    ) as sub:
        early = collect(sub, until=lambda got: len(signals(got, "unreachable")) == 2)
        assert {s.worker for s in signals(early, "unreachable")} == {late_url, never_url}
        assert all(isinstance(s, Unreachable) and s.dp_rank is None for s in early)
        eng = EngineProcess(["--port", str(port), "--dp-size", "2"], KV_CONFIG)
        try:
            # published before the subscriber has even discovered the ranks
            eng.generate(list(range(64)), rank=0)
            eng.generate(list(range(100, 164)), rank=1)
            wait_for(lambda: sub.engines()[late_url].state == "subscribed", timeout=20)
            items = collect(sub, until=lambda got: len(deliveries(got)) == 2)
            assert {d.holder for d in deliveries(items)} == {
                Holder(late_url, 0),
                Holder(late_url, 1),
            }
            assert all(d.seq == 0 for d in deliveries(items))
            assert sub.engines()[never_url].state == "unreachable"
            assert sub.engines()[never_url].attempts >= 2
        finally:
            eng.stop()


def test_engine_restarted_whole_on_new_ports_is_followed_there() -> None:
    """An engine back on the same URL but new OS-chosen event ports is found again by
    rereading /server_info: a Reset per rank, then its new streams from seq 0."""
    port = free_tcp_port()
    url = f"http://127.0.0.1:{port}"
    holders = {Holder(url, 0), Holder(url, 1)}
    eng = EngineProcess(["--port", str(port), "--dp-size", "2"], KV_CONFIG)
    try:
        with Subscriber(
            engines=[url], retry_initial=0.1, retry_max=0.5, rediscover_interval=0.3
        ) as sub:
            eng.generate(list(range(64)), rank=0)
            eng.generate(list(range(100, 164)), rank=1)
            collect(sub, until=lambda got: len(deliveries(got)) == 2)
            before = {h: st.endpoint for h, st in sub.stats().items()}
            eng.stop()
            eng = EngineProcess(["--port", str(port), "--dp-size", "2"], KV_CONFIG)
            items = collect(sub, until=lambda got: len(signals(got, "reset")) == 2)
            resets = signals(items, "reset")
            assert {r.holder for r in resets} == holders
            assert all(isinstance(r, Reset) and "restarted" in r.reason for r in resets)
            eng.generate(list(range(200, 264)), rank=0)
            eng.generate(list(range(300, 364)), rank=1)
            items = collect(sub, until=lambda got: len(deliveries(got)) == 2)
            assert {(d.holder, d.seq) for d in deliveries(items)} == {(h, 0) for h in holders}
            after = {h: st.endpoint for h, st in sub.stats().items()}
            assert all(after[h] != before[h] for h in holders)  # the new engine's ports
            assert sub.engines()[url].rediscoveries == 2
    finally:
        eng.stop()


def test_engine_with_publishing_off_is_reported_with_how_to_enable_it() -> None:
    """An engine whose /server_info has no kv_events block is reported, saying how to turn publishing on."""
    eng = EngineProcess(["--port", "0"], {"publisher": "null"})
    try:
        with Subscriber(engines=[eng.url], retry_initial=0.1, retry_max=0.5) as sub:
            items = collect(sub, until=lambda got: bool(signals(got, "unreachable")))
            (signal,) = signals(items, "unreachable")
            assert isinstance(signal, Unreachable)
            assert "publishing looks off" in signal.reason and "--kv-events-config" in signal.reason
            status = sub.engines()[eng.url]
            assert status.state == "invalid" and status.streams == 0
    finally:
        eng.stop()


def test_burst_through_tiny_hwms_from_the_engine_is_delivered_exactly() -> None:
    """A burst of engine batches through 4-message high-water marks on both sides arrives complete and in order, and matches /kv_blocks."""
    config = {**KV_CONFIG, "hwm": 4}
    eng = EngineProcess(["--port", "0", "--max-blocks", "256"], config)
    rng = random.Random(3)
    requests = [[rng.randrange(1000) for _ in range(32)] for _ in range(400)]

    async def burst() -> None:
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=eng.url, timeout=30, limits=limits) as client:
            gate = asyncio.Semaphore(16)

            async def one(tokens: list[int]) -> None:
                async with gate:
                    body = {"input_ids": tokens, "max_new_tokens": 1, "routed_dp_rank": 0}
                    response = await client.post("/generate", json=body)
                    assert response.status_code == 200, response.text

            await asyncio.gather(*(one(t) for t in requests))

    view = HeldBlocks()
    try:
        with Subscriber(engines=[eng.url], rcvhwm=4, max_buffered=8) as sub:
            wait_for(lambda: sub.engines()[eng.url].state == "subscribed", timeout=20)
            wait_for(lambda: sub.stats()[Holder(eng.url, 0)].status == "connected", timeout=20)
            asyncio.run(burst())
            caught_up(sub, eng, view, timeout=60)
            holder = Holder(eng.url, 0)
            published = eng.published()[0]
            assert view.delivered[holder] == list(range(published))
            assert view.held[holder] == eng.kv_blocks(0)
            stats = sub.stats()[holder]
            assert stats.lost == 0 and stats.resets == 0
    finally:
        eng.stop()
