"""A PrefixIndex fed by a Subscriber on a real vLLM agrees with vLLM.

Two references, both from vLLM itself (it has no endpoint listing its cache):
* its event stream, replayed by brute force (:class:`EventModel`): after every request
  the index holds, per rank, exactly the engine hashes and prefixes the events describe;
* the ``cached_tokens`` vLLM reports per request: before each request the index
  predicts it exactly (whole blocks of the longest cached prefix, capped at vLLM's rule
  that the last prompt token is always computed).
"""

from __future__ import annotations

from real_vllm_helpers import IndexFeed, Prompts, RealVLLM, VLLMClient

FEED_TIMEOUT_S = 30.0


def test_prompt_sent_to_rank_r_matches_its_full_prefix_on_rank_r_only(
    vllm: RealVLLM, client: VLLMClient, feed: IndexFeed
) -> None:
    """A prompt sent with X-data-parallel-rank: r appears in the index on holder (vLLM, r) with every full block of it, in tokens, and on no other rank."""
    prompts = Prompts("index-per-rank")
    bs = vllm.block_size
    for rank in range(vllm.dp_size):
        prompt = prompts.fresh(3 * bs + 5)
        client.complete(prompt, rank)
        feed.wait_for(
            lambda p=prompt, r=rank: feed.holds(r, p), FEED_TIMEOUT_S, "the prompt's blocks"
        )
        with feed.cond:
            result = feed.index.match(prompt)
            per_rank = [feed.index.holder_match(result, h) for h in feed.holders]
        assert per_rank[rank].gpu * bs == 3 * bs == 96
        assert all(m.blocks == 0 for r, m in enumerate(per_rank) if r != rank)
        # vLLM agrees: the same prompt again on rank r is served from cache, 96 tokens.
        assert client.cached_tokens(client.complete(prompt, rank)) == 3 * bs
    for rank in range(vllm.dp_size):
        feed.settle(client, rank, prompts)
        feed.assert_index_equals_model(rank)
    assert not [s for s in feed.signals if s.kind in ("loss", "reset")]


def test_index_tracks_vllm_through_evictions(
    vllm: RealVLLM, client: VLLMClient, feed: IndexFeed
) -> None:
    """Under a 20-block cache with evictions, the index equals vLLM's event history after every request and predicts every reported cached_tokens exactly."""
    prompts = Prompts("index-evictions")
    bs = vllm.block_size
    length = 3 * bs + 4  # 3 full blocks plus a partial one: 4 blocks per request
    checked: list[tuple[int, int]] = []  # (predicted, reported)
    for rank in range(vllm.dp_size):
        feed.settle(client, rank, prompts)
        removed_before = feed.model.removed
        sent: list[list[int]] = []
        for i in range(12):
            sent.append(prompts.fresh(length))
            # A new prompt, then earlier ones at distances 1, 3 and 6: under LRU eviction
            # they come back whole, in part and not at all. Each prediction is made right
            # before its request.
            for prompt in (sent[-1], *sent[-2:-1], *sent[-4:-3], *sent[-7:-6]):
                predicted = feed.predicted_cached_tokens(rank, prompt)
                reported = client.cached_tokens(client.complete(prompt, rank))
                assert predicted == reported, (
                    f"rank {rank}, request {i}: index predicted {predicted} cached tokens, "
                    f"vLLM reported {reported}"
                )
                checked.append((predicted, reported))
                feed.settle(client, rank, prompts)
                feed.assert_index_equals_model(rank)
        assert feed.model.removed > removed_before, f"rank {rank} evicted nothing"
    # The workload covered full hits, misses of evicted prompts and partial hits.
    outcomes = {p for p, _ in checked}
    assert {0, 3 * bs} < outcomes, f"only {sorted(outcomes)} cached tokens were seen"
    assert not [s for s in feed.signals if s.kind in ("loss", "reset")]


def test_reset_prefix_cache_empties_each_rank_at_its_next_step(
    vllm: RealVLLM, client: VLLMClient, feed: IndexFeed
) -> None:
    """After POST /reset_prefix_cache, each rank's AllBlocksCleared (sent with its next step) leaves the index holding only what that step stored, as vLLM does."""
    prompts = Prompts("index-reset")
    bs = vllm.block_size
    before = {rank: prompts.fresh(2 * bs + 7) for rank in range(vllm.dp_size)}
    for rank, prompt in before.items():
        client.complete(prompt, rank)
        feed.settle(client, rank, prompts)
        assert feed.predicted_cached_tokens(rank, prompt) == 2 * bs
    cleared_before = feed.model.cleared
    client.reset_prefix_cache()
    for rank, prompt in before.items():
        # vLLM emits AllBlocksCleared with the rank's next step: the barrier's.
        feed.settle(client, rank, prompts)
        assert feed.predicted_cached_tokens(rank, prompt) == 0
        assert client.cached_tokens(client.complete(prompt, rank)) == 0
        feed.settle(client, rank, prompts)
        feed.assert_index_equals_model(rank)
    assert feed.model.cleared >= cleared_before + vllm.dp_size
    with feed.cond:
        clears = feed.index.stats.events.get("AllBlocksCleared:ok", 0)
    assert clears >= vllm.dp_size
