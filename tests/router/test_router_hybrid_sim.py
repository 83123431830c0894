"""Hybrid attention and salts end to end, in CI: a simulated engine with vLLM's event shapes.

``kvevents engine --sliding-window 8 --hash-scheme vllm`` publishes a sliding-window group
(group 0) beside the full-attention group (group 1), as vLLM does for a hybrid model, and
names salted prompts' blocks with the salt in the first block's extra keys. A ``kvevents
router`` follows it; before every request, the router's ``/query`` must equal the
``cached_tokens`` the engine then reports, through evictions of either group.
"""

from __future__ import annotations

import random

import pytest
from router_support import KV_CONFIG, Engine, RouterProc, wait_until

from kvevents import Holder, PrefixIndex

pytestmark = pytest.mark.slow  # an engine and a router as subprocesses

PAGE = 4
DP = 2


def test_router_query_equals_the_hybrid_engines_cached_tokens() -> None:
    rng = random.Random(14)
    engine = Engine(
        [
            "--dp-size", str(DP), "--page-size", str(PAGE), "--max-blocks", "20",
            "--hash-scheme", "vllm", "--sliding-window", "8",
        ],
        KV_CONFIG,
    )  # fmt: skip
    try:
        router = RouterProc([engine.url], "--load-interval", "0.2")
        try:
            wait_until(
                lambda: len(router.http.get("/workers").json()["holders"]) == DP,
                20,
                "the router to discover every rank",
            )
            bases = [[rng.randrange(5, 60000) for _ in range(4 * PAGE + 1)] for _ in range(6)]
            pool = bases + [b + [rng.randrange(5, 60000) for _ in range(2 * PAGE)] for b in bases]
            pool += [b[: 3 * PAGE + 1] for b in bases]
            checks = 0
            for step in range(60):
                rank = step % DP
                prompt = rng.choice(pool)
                salt = rng.choice([None, None, "tenant"])
                keys = {} if salt is None else {"cache_salt": salt}
                # settle: a fresh one-page barrier on the rank, waited for in /query
                barrier = [step + 1, 60001, 60002, 60003, 60004]
                engine.generate(barrier, rank=rank, max_new_tokens=1)

                def barrier_seen(rank: int = rank, barrier: list[int] = barrier) -> bool:
                    answer = router.post("/query", {"input_ids": barrier}).json()
                    return any(
                        m["dp_rank"] == rank and m["matched_tokens"] == PAGE
                        for m in answer["matches"]
                    )

                wait_until(barrier_seen, 20, f"rank {rank}'s barrier in /query")
                answer = router.post("/query", {"input_ids": prompt, **keys}).json()
                expect = next(
                    (m["matched_tokens"] for m in answer["matches"] if m["dp_rank"] == rank), 0
                )
                reported = engine.generate(prompt, rank=rank, max_new_tokens=1, **keys)
                assert reported["cached_tokens"] == expect, (step, rank, salt, answer)
                checks += 1
            assert checks == 60
            index = PrefixIndex.from_bytes(router.http.get("/dump").content)
            assert index.stats.malformed == 0 and index.stats.unknown_parent == 0
            entries = dict((label, n) for label, n, *_ in index.group_counters())
            assert entries["sliding_window:0:8"] > 0 and entries["main"] > 0
            assert index.held_by_group(Holder(engine.url, 0), [])  # the holder has groups
            metrics = router.http.get("/metrics").text
            assert 'kvevents_router_group_entries{group="sliding_window:0:8"}' in metrics
        finally:
            router.stop()
    finally:
        engine.stop()
