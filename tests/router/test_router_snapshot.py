"""A router started after the engine's replay buffer wrapped: with the engine's snapshots
(the simulated engine's default) it holds every rank's blocks and reports no loss;
without them it holds only what replay still had.

A real `kvevents engine` (dp 2, `buffer_steps` 50) stores 600 blocks per rank in 60
batches, then a router or a subscriber starts.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from router_support import KV_CONFIG, Engine, RouterProc, wait_until

from kvevents import Delivery, Holder, Loss, PrefixIndex, Reset, Subscriber

pytestmark = pytest.mark.slow  # engines and routers run as processes

DP = 2
PAGE = 16
REQUESTS = 60  # per rank, 10 blocks each: 60 batches, past the buffer's 50
BUFFERED = {**KV_CONFIG, "buffer_steps": 50}


def fill(engine: Engine) -> None:
    """600 distinct blocks per rank, one stored chain (one batch) per request."""
    for rank in range(DP):
        for i in range(REQUESTS):
            base = (rank * REQUESTS + i) * 1000
            engine.generate([base + t for t in range(10 * PAGE)], rank=rank)
    for rank in range(DP):
        assert len(engine.kv_blocks(rank)) == 10 * REQUESTS


def index_matches(engine: Engine, router: RouterProc) -> bool:
    index = PrefixIndex.from_bytes(router.http.get("/dump").content)
    return all(index.holder_hashes(Holder(engine.url, r)) == engine.kv_blocks(r) for r in range(DP))


def test_a_router_started_after_the_buffer_wrapped_holds_every_ranks_blocks() -> None:
    """The engine advertises snapshots; a router started after 60 batches per rank, with
    a 50-batch replay buffer and no --peer, holds exactly each rank's /kv_blocks, with a
    resync per rank and no loss."""
    engine = Engine(["--dp-size", str(DP), "--page-size", str(PAGE)], BUFFERED)
    try:
        assert engine.server_info()["kv_events"]["snapshot"] is True
        fill(engine)
        router = RouterProc([engine.url])
        try:
            wait_until(lambda: index_matches(engine, router), 30, "the index to hold every block")
            holders = router.http.get("/workers").json()["holders"]
            assert len(holders) == DP
            assert all(h["signals"].get("loss", 0) == 0 for h in holders), holders
            assert all(h["signals"].get("resync", 0) >= 1 for h in holders), holders
            streams = router.http.get("/workers").json()["streams"]
            assert all(s["lost"] == 0 and s["snapshots"] >= 1 for s in streams), streams
        finally:
            router.stop()
    finally:
        engine.stop()


def test_without_snapshots_the_late_subscriber_loses_what_replay_no_longer_has() -> None:
    """With ``"snapshot": false`` the engine advertises none, the subscriber never asks,
    reports each rank's overrun as a Loss, and holds only the buffered batches' blocks."""
    engine = Engine(
        ["--dp-size", str(DP), "--page-size", str(PAGE)], BUFFERED | {"snapshot": False}
    )
    try:
        assert "snapshot" not in engine.server_info()["kv_events"]
        fill(engine)
        index = PrefixIndex()
        items: list[Any] = []
        with Subscriber(engines=[engine.url]) as sub:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                item = sub.get(timeout=0.5)
                if item is None:
                    if sum(isinstance(i, Delivery) for i in items) >= 2 * 50:
                        break
                    continue
                items.append(item)
                if isinstance(item, Delivery):
                    index.apply(item.holder, item.batch)
                elif isinstance(item, (Reset, Loss)) and item.holder is not None:
                    index.clear_holder(item.holder)
        losses = [i for i in items if isinstance(i, Loss)]
        assert sorted((x.dp_rank, x.first_seq, x.last_seq) for x in losses) == [
            (0, 0, 9),
            (1, 0, 9),
        ]
        assert not [i for i in items if type(i).__name__ == "Resync"]
        for rank in range(DP):
            held = index.holder_hashes(Holder(engine.url, rank))
            assert len(held) == 500 and held < engine.kv_blocks(rank)
    finally:
        engine.stop()
