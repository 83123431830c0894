"""vLLM killed and started again: the subscriber says so, and the index follows.

Slow: it SIGKILLs the whole vLLM process group and starts it again on the same ports
(about a minute with data parallelism 2), hence its own timeout.
"""

from __future__ import annotations

import pytest
from real_vllm_helpers import IndexFeed, Prompts, RealVLLM, VLLMClient

from kvevents.signals import Reset

FEED_TIMEOUT_S = 60.0


@pytest.mark.timeout(600)
def test_killed_and_restarted_vllm_resets_every_rank_and_the_index_follows(
    vllm: RealVLLM, client: VLLMClient, feed: IndexFeed
) -> None:
    """After vLLM is SIGKILLed and restarted, every rank's stream signals reset, the index drops what the old engine held, then holds the new engine's blocks, and routing follows them."""
    prompts = Prompts("restart")
    bs = vllm.block_size
    old = {rank: prompts.fresh(3 * bs + 2) for rank in range(vllm.dp_size)}
    for rank, prompt in old.items():
        client.complete(prompt, rank)
        feed.settle(client, rank, prompts)
        assert feed.predicted_cached_tokens(rank, prompt) == 3 * bs

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
    for rank in range(vllm.dp_size):
        # The old engine's blocks are gone from the index, as from the new engine.
        assert feed.predicted_cached_tokens(rank, old[rank]) == 0
        assert client.cached_tokens(client.complete(old[rank], rank)) == 0
        assert feed.predicted_cached_tokens(rank, new[rank]) == 2 * bs
        assert client.cached_tokens(client.complete(new[rank], rank)) == 2 * bs
        feed.settle(client, rank, prompts)
        feed.assert_index_equals_model(rank)
        # Routing recovers: the new engine's prefix draws its follow-up to the same rank.
        decision = feed.route(new[rank][: 2 * bs] + prompts.fresh(bs + 3))
        assert (decision.dp_rank, decision.chosen.matched.gpu) == (rank, 2)
    resets = [s for s in feed.signals if isinstance(s, Reset)]
    assert sorted({s.dp_rank for s in resets}) == list(range(vllm.dp_size))
