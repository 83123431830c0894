"""``kvevents router``'s ``/v1/completions`` in front of a real vLLM: requests go where their
prefix is cached, and vLLM itself says it reused it.

The router is the ``router`` fixture: a subprocess given vLLM by flags only, tokenizing
text prompts with the model folder's ``tokenizer.json``. Each request is an ordinary
OpenAI completions request to the router; its decision comes back in the
``x-kvevents-*`` headers and vLLM's own ``usage.prompt_tokens_details.cached_tokens``
(``--enable-prompt-tokens-details``) says how many prompt tokens it served from cache.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
from real_vllm_helpers import IndexFeed, Prompts, RealVLLM, VLLMClient
from real_vllm_router import RouterProcess, words

from kvevents.router.fleet.engines import vllm_rank_loads, vllm_scrape

FEED_TIMEOUT_S = 30.0


def test_requests_sharing_a_prefix_go_to_the_rank_that_holds_it_and_vllm_reuses_it(
    vllm: RealVLLM, client: VLLMClient, feed: IndexFeed, router: RouterProcess
) -> None:
    """A text prompt whose three-block prefix is cached on rank r is sent by the router's /v1/completions to rank r (decision headers), where vLLM reports exactly the predicted cached tokens, at least the whole prefix."""
    prompts = Prompts("routing-shared-prefix")
    bs = vllm.block_size
    for home in range(vllm.dp_size):
        prefix = prompts.fresh(3 * bs)  # three full blocks
        client.complete(prefix + prompts.fresh(5), home)
        feed.settle(client, home, prompts, router=router)
        for turn in range(3):
            request = prefix + prompts.fresh(bs + 7)
            routed = router.complete(words(request))
            assert routed.status == 200, routed.body
            assert (routed.worker, routed.dp_rank, routed.policy) == (vllm.url, home, "kv-aware"), (
                f"turn {turn}: routed to rank {routed.dp_rank}, the prefix is on rank {home}"
            )
            # The router tokenized the text as vLLM did.
            assert routed.prompt_tokens == routed.usage["prompt_tokens"] == len(request)
            assert routed.matched_tokens >= 3 * bs
            predicted = min(routed.matched_tokens, vllm.max_cached_tokens(len(request)))
            assert routed.cached_tokens == predicted, (
                f"turn {turn}: the router predicted {predicted} cached tokens, vLLM reported "
                f"{routed.cached_tokens}"
            )
            router.wait_holds(home, request, bs, FEED_TIMEOUT_S)


def test_streaming_through_the_router_relays_every_chunk_and_the_usage(
    vllm: RealVLLM, client: VLLMClient, router: RouterProcess
) -> None:
    """A streaming /v1/completions request through the router comes back as vLLM's server-sent events, a chunk per generated token, then the usage with the cached tokens and [DONE], with the decision headers."""
    prompts = Prompts("routing-stream")
    bs = vllm.block_size
    prompt = prompts.fresh(2 * bs + 3)
    first = router.complete(prompt, max_tokens=1)
    router.wait_holds(first.dp_rank, prompt, bs, FEED_TIMEOUT_S)
    routed = router.complete(prompt[: 2 * bs] + prompts.fresh(9), max_tokens=6, stream=True)
    assert routed.status == 200, routed.body
    assert routed.dp_rank == first.dp_rank
    assert routed.matched_tokens == 2 * bs
    chunks = routed.body
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    # One chunk per generated token (vLLM may fold a token that decodes to nothing, e.g.
    # a special token, into the next one), the last with finish_reason "length".
    choices = [e["choices"][0] for e in events if e.get("choices")]
    assert 2 <= len(choices) <= 6, chunks
    assert choices[-1]["finish_reason"] == "length"
    assert "usage" in events[-1] and not events[-1]["choices"]
    assert routed.usage["completion_tokens"] == 6
    assert routed.cached_tokens == 2 * bs


def test_prompts_with_no_cached_prefix_are_spread_over_the_ranks(
    vllm: RealVLLM, router: RouterProcess
) -> None:
    """Fresh prompts that no rank holds, sent one by one through the router, are spread across every rank rather than piled on one, and vLLM serves none of them from cache."""
    prompts = Prompts("routing-spread")
    chosen = []
    for _ in range(2 * vllm.dp_size):
        routed = router.complete(prompts.fresh(2 * vllm.block_size + 3))
        assert routed.status == 200, routed.body
        assert routed.matched_tokens == 0
        assert routed.cached_tokens == 0
        chosen.append(routed.dp_rank)
    assert sorted(set(chosen)) == list(range(vllm.dp_size))


def test_router_metrics_count_the_requests_and_vllms_cached_tokens(
    vllm: RealVLLM, router: RouterProcess
) -> None:
    """After a request through the router, /metrics counts it for the rank it went to, with the prompt and cached tokens vLLM reported."""
    prompts = Prompts("routing-metrics")
    bs = vllm.block_size
    before = _engine_counters(router.metrics(), vllm.url)
    prompt = prompts.fresh(2 * bs + 1)
    first = router.complete(prompt)
    router.wait_holds(first.dp_rank, prompt, bs, FEED_TIMEOUT_S)
    again = router.complete(prompt)
    assert again.dp_rank == first.dp_rank and again.cached_tokens == 2 * bs
    after = _engine_counters(router.metrics(), vllm.url)
    rank = str(first.dp_rank)
    assert after[("prompt", rank)] - before.get(("prompt", rank), 0) == 2 * len(prompt)
    assert after[("cached", rank)] - before.get(("cached", rank), 0) == 2 * bs


def _engine_counters(text: str, worker: str) -> dict[tuple[str, str], float]:
    """``kvevents_router_engine_{prompt,cached}_tokens_total`` of ``worker``, by rank."""
    out: dict[tuple[str, str], float] = {}
    pattern = re.compile(r"^kvevents_router_engine_(prompt|cached)_tokens_total\{(.*)\} (\S+)$")
    for line in text.splitlines():
        m = pattern.match(line)
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("worker") == worker:
            out[(m.group(1), labels["dp_rank"])] = float(m.group(3))
    return out


def test_chat_turns_follow_their_conversation_and_vllm_reuses_it(vllm: RealVLLM) -> None:
    """With the router asking vLLM's /tokenize to render chats, a conversation's second turn goes to the rank holding its first, where vLLM reports exactly the predicted cached tokens."""
    prompts = Prompts("routing-chat")
    bs = vllm.block_size
    router = vllm.start_router(ask_engine=True, log=Path(vllm.state_dir) / "router-chat.log")
    try:
        system, user = prompts.fresh(2 * bs), prompts.fresh(bs)
        turn1 = [
            {"role": "system", "content": words(system)},
            {"role": "user", "content": words(user)},
        ]
        first = router.chat(turn1)
        assert first.status == 200, first.body
        # The template of scripts/real_vllm/vllm_server.py: role words w4/w5/w6.
        tokens1 = [4, *system, 5, *user, 6]
        assert first.prompt_tokens == first.usage["prompt_tokens"] == len(tokens1)
        router.wait_holds(first.dp_rank, tokens1, bs, FEED_TIMEOUT_S)
        turn2 = [
            *turn1,
            {"role": "assistant", "content": words(prompts.fresh(3))},
            {"role": "user", "content": words(prompts.fresh(bs))},
        ]
        second = router.chat(turn2)
        assert second.status == 200, second.body
        assert (second.worker, second.dp_rank) == (vllm.url, first.dp_rank)
        assert second.matched_tokens >= len(tokens1) // bs * bs
        predicted = min(second.matched_tokens, vllm.max_cached_tokens(second.prompt_tokens))
        assert second.cached_tokens == predicted, (
            f"the router predicted {predicted} cached tokens, vLLM reported {second.cached_tokens}"
        )
    finally:
        router.stop()


def test_vllm_load_is_read_from_its_metrics(vllm: RealVLLM, router: RouterProcess) -> None:
    """vLLM's /metrics gives every rank's running and waiting requests, and the router polls them as its load."""
    text = httpx.get(f"{vllm.url}/metrics", timeout=30.0).text
    ranks = vllm_rank_loads(text)
    assert [r["dp_rank"] for r in ranks] == list(range(vllm.dp_size))
    # vllm:cache_config_info states every rank's block size: what its events carry
    assert vllm_scrape(text)[1] == dict.fromkeys(range(vllm.dp_size), vllm.block_size)
    assert all(r["running"] >= 0 and r["waiting"] >= 0 for r in ranks)
    engine = next(e for e in router.workers()["engines"] if e["url"] == vllm.url)
    assert engine["load_source"] == "/metrics", engine["metrics_error"]


def test_a_router_given_only_the_vllm_url_finds_every_rank(vllm: RealVLLM) -> None:
    """`kvevents router --engine URL --engine-kind vllm`, no endpoints: vLLM's /kv_event_sources gives every rank's stream, and routing follows the cache."""
    prompts = Prompts("routing-url-only")
    bs = vllm.block_size
    router = RouterProcess(
        vllm.url,
        ["--engine-kind", "vllm"],
        "--tokenizer",
        vllm.model,
        log=Path(vllm.state_dir) / "router-url-only.log",
    )
    try:
        deadline = time.monotonic() + FEED_TIMEOUT_S
        # Discovered in the background, twice: the subscriber's streams and the router's
        # holders (each reads /server_info, then /kv_event_sources).
        while (
            len(streams := router.streams()) < vllm.dp_size
            or len(router.workers()["holders"]) < vllm.dp_size
        ):
            assert time.monotonic() < deadline, f"{router.workers()}\n{router.output()}"
            time.sleep(0.1)
        assert [streams[r]["endpoint"] for r in sorted(streams)] == [
            vllm.rank_endpoint(r) for r in range(vllm.dp_size)
        ]
        prompt = prompts.fresh(2 * bs + 3)
        first = router.complete(prompt)
        assert first.status == 200, first.body
        router.wait_holds(first.dp_rank, prompt, bs, FEED_TIMEOUT_S)
        again = router.complete(prompt)
        assert again.dp_rank == first.dp_rank and again.cached_tokens == 2 * bs
        # the size its /metrics states agrees with its events': no mismatch anywhere
        sizes = [h["block_size"] for h in router.workers()["holders"]]
        assert all(s["expected"] == bs and not s["mismatches"] for s in sizes), sizes
    finally:
        router.stop()
