"""vLLM killed and started again: the subscriber and the router service say so, and follow.

Slow: it SIGKILLs the whole vLLM process group and starts it again on the same ports
(about a minute with data parallelism 2), hence its own timeout. Two consumers watch
the same restart: the in-process :class:`Subscriber` + index (the ``feed``), which must
signal ``reset`` for every rank, and the ``kvevents router`` service (the ``router``),
whose ``/workers`` must count the reset on every rank's stream and holder, whose index
must drop the old engine's blocks, and whose ``/v1/completions`` must route by the new
engine's blocks.
"""

from __future__ import annotations

import pytest
from real_vllm_helpers import IndexFeed, Prompts, RealVLLM, VLLMClient, wait_until
from real_vllm_router import RouterProcess, words

from kvevents import Reset

FEED_TIMEOUT_S = 60.0


@pytest.mark.timeout(600)
def test_killed_and_restarted_vllm_resets_every_rank_and_routing_follows(
    vllm: RealVLLM, client: VLLMClient, feed: IndexFeed, router: RouterProcess
) -> None:
    """After vLLM is SIGKILLed and restarted, every rank's stream signals reset (in-process and in the router's /workers), both indexes drop what the old engine held and hold the new engine's blocks, and the router's /v1/completions sends follow-ups to the rank holding the new prefix, where vLLM reuses it."""
    prompts = Prompts("restart")
    bs = vllm.block_size
    old = {rank: prompts.fresh(3 * bs + 2) for rank in range(vllm.dp_size)}
    for rank, prompt in old.items():
        client.complete(prompt, rank)
        feed.settle(client, rank, prompts, router=router)
        assert feed.predicted_cached_tokens(rank, prompt) == 3 * bs
        assert router.query(prompt)[rank] == 3 * bs
    resets_before = {r: s["resets"] for r, s in router.streams().items()}

    vllm.restart()

    new = {rank: prompts.fresh(2 * bs + 2) for rank in range(vllm.dp_size)}
    for rank, prompt in new.items():
        client.complete(prompt, rank)
    for rank, holder in enumerate(feed.holders):
        feed.wait_for(
            lambda h=holder: any(isinstance(s, Reset) and s.holder == h for s in feed.signals),
            FEED_TIMEOUT_S,
            f"a reset signal for rank {rank}",
        )
        feed.wait_for(
            lambda r=rank: feed.holds(r, new[r]), FEED_TIMEOUT_S, f"rank {rank}'s new blocks"
        )
        router.wait_holds(rank, new[rank], bs, FEED_TIMEOUT_S)
    # The router sees the restart on two paths that converge on their own schedules: the
    # streams (a monitor event says connected) and the load poll (the next /load after
    # the engine is back says available). Wait for both, bounded, then check them all.
    wait_until(
        lambda: _settled(router, vllm.url, vllm.dp_size),
        FEED_TIMEOUT_S,
        "every rank's stream connected and its holder available",
    )
    streams = router.streams()
    holders = {h["dp_rank"]: h for h in router.workers()["holders"] if h["worker"] == vllm.url}
    for rank in range(vllm.dp_size):
        assert streams[rank]["resets"] > resets_before[rank], streams[rank]
        assert streams[rank]["status"] == "connected", streams[rank]
        assert holders[rank]["signals"].get("reset", 0) >= 1, holders[rank]
        assert holders[rank]["load"]["available"], holders[rank]
    for rank in range(vllm.dp_size):
        # The old engine's blocks are gone from both indexes, as from the new engine.
        assert feed.predicted_cached_tokens(rank, old[rank]) == 0
        assert router.query(old[rank]) == {r: 0 for r in range(vllm.dp_size)}
        assert client.cached_tokens(client.complete(old[rank], rank)) == 0
        assert feed.predicted_cached_tokens(rank, new[rank]) == 2 * bs
        assert router.query(new[rank])[rank] == 2 * bs
        assert client.cached_tokens(client.complete(new[rank], rank)) == 2 * bs
        feed.settle(client, rank, prompts, router=router)
        feed.assert_index_equals_model(rank)
        feed.assert_router_equals_model(router, rank)
    for rank in range(vllm.dp_size):
        # Routing recovers: the new engine's prefix draws its follow-up to the same rank,
        # through the router's /v1/completions, and vLLM serves the prefix from cache.
        request = new[rank][: 2 * bs] + prompts.fresh(bs + 3)
        routed = router.complete(words(request))
        assert routed.status == 200, routed.body
        assert (routed.dp_rank, routed.matched_tokens) == (rank, 2 * bs)
        assert routed.cached_tokens == 2 * bs
    resets = [s for s in feed.signals if isinstance(s, Reset)]
    assert sorted({s.dp_rank for s in resets}) == list(range(vllm.dp_size))


def _settled(router: RouterProcess, url: str, ranks: int) -> bool:
    """Every rank's stream of ``url`` is connected and its holder available."""
    streams = router.streams()
    holders = {h["dp_rank"]: h for h in router.workers()["holders"] if h["worker"] == url}
    return all(
        streams[r]["status"] == "connected" and holders[r]["load"]["available"]
        for r in range(ranks)
    )
