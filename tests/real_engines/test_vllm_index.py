"""What kvevents builds from a real vLLM's events agrees with vLLM.

Two consumers follow vLLM's streams side by side: an in-process :class:`PrefixIndex`
fed by a :class:`Subscriber` (the ``feed`` fixture) and the ``kvevents router`` service,
a subprocess given the engine by flags only (the ``router`` fixture). Both are checked
against two references from vLLM itself (it has no endpoint listing its cache):

* its event stream, replayed by brute force (:class:`EventModel`): per rank, the set of
  block hashes held after every ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
  in seq order (a hash stored twice is held until removed twice), each with the token
  prefix it covers. The in-process index and the router's ``GET /dump`` must hold, per
  rank, exactly those engine hashes (GPU tier) and the content keys of those prefixes;
* the ``cached_tokens`` vLLM reports per request: before each request, both the
  in-process index and the router's ``POST /query`` predict it exactly (whole blocks of
  the longest cached prefix, capped at vLLM's rule that the last prompt token is always
  computed).
"""

from __future__ import annotations

import time

from real_vllm_helpers import IndexFeed, Prompts, RealVLLM, VLLMClient
from real_vllm_router import RouterProcess, words

FEED_TIMEOUT_S = 30.0


def _router_prediction(router: RouterProcess, vllm: RealVLLM, rank: int, prompt: list[int]) -> int:
    return min(router.query(prompt)[rank], vllm.max_cached_tokens(len(prompt)))


def test_prompt_sent_to_rank_r_shows_in_router_query_on_rank_r_with_its_full_prefix(
    vllm: RealVLLM, client: VLLMClient, feed: IndexFeed, router: RouterProcess
) -> None:
    """A prompt sent straight to vLLM with X-data-parallel-rank: r appears on rank r alone, with every full block of it in tokens, in the router's /query (as token ids and as text) and in the in-process index."""
    prompts = Prompts("index-per-rank")
    bs = vllm.block_size
    for rank in range(vllm.dp_size):
        prompt = prompts.fresh(3 * bs + 5)
        client.complete(prompt, rank)
        router.wait_holds(rank, prompt, bs, FEED_TIMEOUT_S)
        expected = {r: 3 * bs if r == rank else 0 for r in range(vllm.dp_size)}
        deadline = time.monotonic() + 60  # the native call reads the mirror the kernels keep
        while router.workers()["process"]["kernels"] != "compiled":
            assert time.monotonic() < deadline, router.workers()["process"]
            time.sleep(0.2)
        native = router.workers()["process"]["native"]
        assert router.query(prompt) == expected
        # token ids alone: answered by the native call, as the Python path answers them
        after = router.workers()["process"]["native"]
        assert after["answered"] == native["answered"] + 1 and after["failures"] == 0, after
        # The same prompt as text, tokenized by the router with the model's tokenizer.json.
        assert router.query(words(prompt)) == expected
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
        feed.settle(client, rank, prompts, router=router)
        feed.assert_index_equals_model(rank)
        feed.assert_router_equals_model(router, rank)
    assert not [s for s in feed.signals if s.kind in ("loss", "reset")]


def test_index_and_router_track_vllm_through_evictions(
    vllm: RealVLLM, client: VLLMClient, feed: IndexFeed, router: RouterProcess
) -> None:
    """Under a 20-block cache with evictions, the in-process index and the router's /dump equal vLLM's event history after every request, and both predict every reported cached_tokens exactly."""
    prompts = Prompts("index-evictions")
    bs = vllm.block_size
    length = 3 * bs + 4  # 3 full blocks plus a partial one: 4 blocks per request
    checked: list[tuple[int, int]] = []  # (predicted, reported)
    for rank in range(vllm.dp_size):
        feed.settle(client, rank, prompts, router=router)
        removed_before = feed.model.removed
        sent: list[list[int]] = []
        for i in range(12):
            sent.append(prompts.fresh(length))
            # A new prompt, then earlier ones at distances 1, 3 and 6: under LRU eviction
            # they come back whole, in part and not at all. Each prediction is made right
            # before its request.
            for prompt in (sent[-1], *sent[-2:-1], *sent[-4:-3], *sent[-7:-6]):
                predicted = feed.predicted_cached_tokens(rank, prompt)
                predicted_by_router = _router_prediction(router, vllm, rank, prompt)
                reported = client.cached_tokens(client.complete(prompt, rank))
                assert predicted == predicted_by_router == reported, (
                    f"rank {rank}, request {i}: index predicted {predicted} cached tokens, "
                    f"router {predicted_by_router}, vLLM reported {reported}"
                )
                checked.append((predicted, reported))
                feed.settle(client, rank, prompts, router=router)
                feed.assert_index_equals_model(rank)
                feed.assert_router_equals_model(router, rank)
        assert feed.model.removed > removed_before, f"rank {rank} evicted nothing"
    # The workload covered full hits, misses of evicted prompts and partial hits.
    outcomes = {p for p, _ in checked}
    assert {0, 3 * bs} < outcomes, f"only {sorted(outcomes)} cached tokens were seen"
    assert not [s for s in feed.signals if s.kind in ("loss", "reset")]
    streams = router.streams()
    assert all(streams[r]["lost"] == 0 and streams[r]["resets"] == 0 for r in streams), streams


def test_reset_prefix_cache_empties_each_rank_at_its_next_step(
    vllm: RealVLLM, client: VLLMClient, feed: IndexFeed, router: RouterProcess
) -> None:
    """After POST /reset_prefix_cache, each rank's AllBlocksCleared (sent with its next step) leaves the in-process index and the router's /dump holding only what that step stored, as vLLM does."""
    prompts = Prompts("index-reset")
    bs = vllm.block_size
    before = {rank: prompts.fresh(2 * bs + 7) for rank in range(vllm.dp_size)}
    for rank, prompt in before.items():
        client.complete(prompt, rank)
        feed.settle(client, rank, prompts, router=router)
        assert feed.predicted_cached_tokens(rank, prompt) == 2 * bs
        assert _router_prediction(router, vllm, rank, prompt) == 2 * bs
    cleared_before = feed.model.cleared
    client.reset_prefix_cache()
    for rank, prompt in before.items():
        # vLLM emits AllBlocksCleared with the rank's next step: the barrier's.
        feed.settle(client, rank, prompts, router=router)
        assert feed.predicted_cached_tokens(rank, prompt) == 0
        assert router.query(prompt)[rank] == 0
        assert client.cached_tokens(client.complete(prompt, rank)) == 0
        feed.settle(client, rank, prompts, router=router)
        feed.assert_index_equals_model(rank)
        feed.assert_router_equals_model(router, rank)
        # Left in the router's index for the rank: the two barriers and the prompt, no more.
        assert len(router.index().holder_hashes(router.holder(rank))) == 4
    assert feed.model.cleared >= cleared_before + vllm.dp_size
    with feed.cond:
        clears = feed.index.stats.events.get("AllBlocksCleared:ok", 0)
    assert clears >= vllm.dp_size
    assert router.index().stats.events.get("AllBlocksCleared:ok", 0) >= vllm.dp_size
