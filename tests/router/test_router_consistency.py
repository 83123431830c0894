"""Consistency (issue 5, part 4): the router's index equals every rank's /kv_blocks.

A `kvevents engine` with dp 4 and a small cache, a `kvevents router` following it, a
workload with evictions, one flush and one rank restarted: once the streams settle,
the index's blocks for each holder (from the router's /dump) equal that rank's
`/kv_blocks`.
"""

from __future__ import annotations

import random

import pytest
from router_support import KV_CONFIG, Engine, RouterProc, wait_until

from kvevents import Holder, PrefixIndex

pytestmark = pytest.mark.slow  # an engine and a router as subprocesses

DP = 4
PAGE = 4
MAX_BLOCKS = 24


def prompts(rng: random.Random, count: int, salt: int) -> list[list[int]]:
    """Prompts sharing a 2-page system prefix, in a few conversations that grow turn by turn."""
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    conversations = [[salt * 1000 + c * 10 + t for t in range(4)] for c in range(6)]
    out = []
    for _ in range(count):
        conv = rng.randrange(len(conversations))
        conversations[conv] += [rng.randrange(100, 60000) for _ in range(rng.randrange(4, 13))]
        out.append(system + conversations[conv])
    return out


def settled(engine: Engine, router: RouterProc) -> bool:
    index = PrefixIndex.from_bytes(router.http.get("/dump").content)
    return all(index.holder_hashes(Holder(engine.url, r)) == engine.kv_blocks(r) for r in range(DP))


def send(engine: Engine, router: RouterProc, batch: list[list[int]], rng: random.Random) -> None:
    for tokens in batch:
        if rng.random() < 0.5:
            answer = router.post("/generate", {"input_ids": tokens, "max_new_tokens": 2})
            assert answer.status_code == 200, answer.text
        else:
            engine.generate(tokens, rank=rng.randrange(DP))


def test_index_equals_every_ranks_kv_blocks_through_evictions_flush_and_restart() -> None:
    """After evictions, a flush and a rank restart, the index holds exactly what each rank holds."""
    rng = random.Random(5)
    engine = Engine(
        ["--dp-size", str(DP), "--page-size", str(PAGE), "--max-blocks", str(MAX_BLOCKS)],
        KV_CONFIG,
    )
    try:
        router = RouterProc([engine.url], "--load-interval", "0.2")
        try:
            wait_until(
                lambda: len(router.http.get("/workers").json()["holders"]) == DP,
                20,
                "the router to discover every rank",
            )
            send(engine, router, prompts(rng, 40, 1), rng)
            wait_until(lambda: settled(engine, router), 20, "the index to match after evictions")

            assert engine.http.post("/flush_cache").status_code == 200
            send(engine, router, prompts(rng, 20, 2), rng)
            wait_until(lambda: settled(engine, router), 20, "the index to match after a flush")

            restarted = engine.http.post("/admin/restart_rank", params={"dp_rank": 2})
            assert restarted.status_code == 200, restarted.text
            send(engine, router, prompts(rng, 20, 3), rng)
            for tokens in prompts(rng, 3, 4):
                engine.generate(tokens, rank=2)
            wait_until(lambda: settled(engine, router), 30, "the index to match after a restart")

            metrics = router.http.get("/metrics").text
            removed = [
                line
                for line in metrics.splitlines()
                if line.startswith('kvevents_router_events_total{outcome="ok",type="BlockRemoved"}')
            ]
            assert removed and float(removed[0].split()[-1]) > 0, "no eviction was exercised"
            assert 'type="AllBlocksCleared"' in metrics
            holders = router.http.get("/workers").json()["holders"]
            rank2 = next(h for h in holders if h["dp_rank"] == 2)
            assert rank2["signals"].get("reset", 0) >= 1, rank2
            assert all(h["signals"].get("loss", 0) == 0 for h in holders), holders
            assert all(len(engine.kv_blocks(r)) > 0 for r in range(DP))
        finally:
            router.stop()
    finally:
        engine.stop()
