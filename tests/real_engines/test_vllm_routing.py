"""kvevents' Router, fed by vLLM's own events, sends requests where their prefix is cached.

The router is driven in-process (:class:`kvevents.router.core.Router`, the logic behind
``kvevents router``) and each decision is carried out as a user would: the request goes
to vLLM's ``/v1/completions`` with ``X-data-parallel-rank`` set to the chosen rank. vLLM's
own ``cached_tokens`` then says whether the prefix was really reused.
"""

from __future__ import annotations

from real_vllm_helpers import IndexFeed, Prompts, RealVLLM, VLLMClient


def test_requests_sharing_a_prefix_go_to_the_rank_that_holds_it_and_vllm_reuses_it(
    vllm: RealVLLM, client: VLLMClient, feed: IndexFeed
) -> None:
    """A conversation prefix cached on rank r draws every follow-up sharing it to rank r, where vLLM serves the whole prefix from cache."""
    prompts = Prompts("routing-shared-prefix")
    bs = vllm.block_size
    for home in range(vllm.dp_size):
        prefix = prompts.fresh(3 * bs)  # three full blocks
        client.complete(prefix + prompts.fresh(5), home)
        feed.settle(client, home, prompts)
        for turn in range(3):
            request = prefix + prompts.fresh(bs + 7)
            decision = feed.route(request)
            assert decision.dp_rank == home, (
                f"turn {turn}: routed to rank {decision.dp_rank}, prefix is on rank {home}; "
                f"scores {decision.scores}"
            )
            assert decision.chosen.matched.gpu == 3
            predicted = feed.predicted_cached_tokens(decision.dp_rank, request)
            ticket = feed.router.begin(decision)
            try:
                usage = client.complete(request, decision.dp_rank)
            finally:
                feed.router.finish(ticket)
            assert client.cached_tokens(usage) == predicted >= 3 * bs
            feed.settle(client, home, prompts)


def test_prompts_with_no_cached_prefix_are_spread_over_the_ranks(
    vllm: RealVLLM, client: VLLMClient, feed: IndexFeed
) -> None:
    """Fresh prompts that no rank holds are spread across every rank rather than piled on one."""
    prompts = Prompts("routing-spread")
    chosen = []
    for _ in range(2 * vllm.dp_size):
        request = prompts.fresh(2 * vllm.block_size + 3)
        decision = feed.route(request)
        assert decision.chosen.matched.blocks == 0
        ticket = feed.router.begin(decision)
        try:
            assert client.cached_tokens(client.complete(request, decision.dp_rank)) == 0
        finally:
            feed.router.finish(ticket)
        chosen.append(decision.dp_rank)
    assert sorted(set(chosen)) == list(range(vllm.dp_size))
