"""An engine restarted with another block size: the router follows it, over real processes."""

from __future__ import annotations

import pytest
from router_support import KV_CONFIG, Engine, RouterProc, wait_until

from subscriber_support import free_tcp_port

pytestmark = pytest.mark.slow  # an engine restarted under a router, as subprocesses

PROMPT = list(range(300, 364))  # 64 tokens: 4 blocks of 16, 2 of 32


def _engine(port: int, block_size: int) -> Engine:
    return Engine(
        ["--port", str(port), "--dp-size", "2", "--block-size", str(block_size)], KV_CONFIG
    )


def _query(router: RouterProc) -> tuple[int, dict[int, int]]:
    """The router's block size and the tokens each rank holds of the prompt (asked with
    one token more, so that every block of it is one an engine reuses)."""
    answer = router.post("/query", {"input_ids": [*PROMPT, 0]}).json()
    return answer["block_size"], {m["dp_rank"]: m["matched_tokens"] for m in answer["matches"]}


def test_an_engine_restarted_with_another_block_size_is_followed_at_it() -> None:
    """`kvevents router --engine URL` keys at the engine's 16; the engine comes back on the
    same URL at 32: the router keys at 32 once every rank says so, and the prompt the
    engine stores again matches (before, every event was skipped as a mismatch until the
    router restarted)."""
    port = free_tcp_port()
    engine = _engine(port, 16)
    router: RouterProc | None = None
    try:
        router = RouterProc([engine.url], "--load-interval", "0.2")
        wait_until(lambda: router.connected() == 2, 20, "both streams connected")
        sent = engine.http.post("/generate", json={"input_ids": PROMPT, "max_new_tokens": 1})
        rank = sent.json()["dp_rank"]
        wait_until(lambda: _query(router)[1].get(rank) == 64, 20, "the prompt at 16 tokens a block")
        engine.stop()
        engine = _engine(port, 32)
        wait_until(lambda: _query(router)[0] == 32, 30, "the router at 32 tokens a block")
        sent = engine.http.post("/generate", json={"input_ids": PROMPT, "max_new_tokens": 1})
        rank = sent.json()["dp_rank"]
        wait_until(lambda: _query(router)[1].get(rank) == 64, 20, "the prompt at 32 tokens a block")
        workers = router.http.get("/workers").json()
        assert all(h["block_size"]["expected"] == 32 for h in workers["holders"])
    finally:
        if router is not None:
            router.stop()
        engine.stop(expect=None)
