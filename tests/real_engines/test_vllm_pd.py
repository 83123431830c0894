"""Disaggregated prefill/decode against a real vLLM pair: ``kvevents router --prefill P
--decode D`` in front of a vLLM prefill instance and a vLLM decode instance that share
their KV through ``ExampleConnector`` (a folder), scored by vLLM's own counters.

Only under ``scripts/test-real-vllm --pd``. The router runs with its defaults
(``--max-local-prefill-tokens 256``), so a 300-token prompt the decode lacks is
prefilled by the prefill instance, and once the decode's events show it holds the
prompt's blocks, the same prompt is served by the decode alone. What happened is read
from vLLM (:mod:`real_vllm_pd`): each instance's finished requests per rank, its prompt
tokens by source (computed, local prefix cache, KV transfer), the decode's
``cached_tokens``; the router's ``/workers`` ``pd`` counters and ``/metrics`` must agree
with them.

Prompt lengths avoid ``n - 1`` a multiple of the block size: ExampleConnector saves a
prompt under its first ``(n - 1) // B`` blocks and looks it up under its first
``(n - 2) // B``, which differ there (the decode would then find nothing to load).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest
from real_vllm_helpers import Prompts
from real_vllm_pd import (
    Ledger,
    PDFleet,
    VLLMCounters,
    router_delta,
    router_pd_counts,
    router_pd_metrics,
    send,
    wait_totals,
)
from real_vllm_router import RouterProcess, words

LONG = 300  # 9 whole blocks of 32 and 12 tokens: more than 256 uncached, a hand-off
SHORT = 100  # at most 256 uncached: the decode prefills it alone
FEED_TIMEOUT_S = 30.0
NOTHING = VLLMCounters(requests={}, prompt_tokens={})


@pytest.fixture(scope="module")
def pd() -> PDFleet:
    """The prefill and decode instances the script started."""
    return PDFleet.from_env()


@pytest.fixture(scope="module")
def pd_router(pd: PDFleet) -> Iterator[tuple[RouterProcess, Ledger]]:
    """One ``kvevents router --prefill ... --decode ...`` for the module (it must exit 0
    on SIGTERM), with both instances' counters as it started."""
    proc = pd.start_router()
    try:
        yield proc, pd.ledger(proc)
    finally:
        proc.stop()


@pytest.fixture
def router(pd_router: tuple[RouterProcess, Ledger]) -> RouterProcess:
    """The module's router, checked to be still running before each test."""
    proc = pd_router[0]
    assert proc.alive(), f"kvevents router died:\n{proc.output()}"
    return proc


def tokens(compute: int, local: int = 0, transfer: int = 0) -> dict[str, int]:
    """Prompt tokens by vLLM's sources: computed, local prefix cache, KV transfer."""
    return {"local_compute": compute, "local_cache_hit": local, "external_kv_transfer": transfer}


def test_a_long_prompt_is_prefilled_by_the_prefill_instance_and_read_by_the_decode(
    pd: PDFleet, router: RouterProcess
) -> None:
    """A 300-token prompt nobody holds goes through the prefill instance (one request, every prompt token computed there) and then the decode, which reports the prompt's whole blocks as cached tokens, read from the KV transfer, and then publishes them."""
    bs = pd.block_size
    prompt = Prompts("pd-long").fresh(LONG)
    full = pd.decode.max_cached_tokens(LONG)
    sent = send(pd, router, prompt, prefill="load", max_tokens=4)
    routed = sent.routed
    assert int(routed.headers["x-kvevents-uncached-tokens"]) == LONG
    assert routed.prompt_tokens == routed.usage["prompt_tokens"] == LONG
    assert routed.usage["completion_tokens"] == 4
    assert routed.cached_tokens == full, "the decode did not read the prefill's KV"
    assert sent.prefill_rank is not None
    assert sent.prefilled.tokens(sent.prefill_rank) == tokens(LONG)
    assert sent.decoded.tokens(sent.decode_rank) == tokens(LONG - full, transfer=full)
    assert sent.router_counted == {
        "prefill.requests": 1,
        "prefill.chosen_by_load": 1,
        "decode.requests": 1,
    }
    # The decode instance published the blocks it received; the prefill, those it computed.
    router.wait_holds(sent.decode_rank, prompt, bs, FEED_TIMEOUT_S, worker=pd.decode.url)
    router.wait_holds(sent.prefill_rank, prompt, bs, FEED_TIMEOUT_S, worker=pd.prefill.url)


def test_the_same_prompt_again_is_served_by_the_decode_alone(
    pd: PDFleet, router: RouterProcess
) -> None:
    """Once the decode's events show it holds a prompt's blocks, the same prompt goes to that decode rank alone: the prefill instance sees no request, and the decode serves every whole block from its own prefix cache."""
    bs = pd.block_size
    prompt = Prompts("pd-again").fresh(LONG)
    full = pd.decode.max_cached_tokens(LONG)
    first = send(pd, router, prompt, prefill="load")
    router.wait_holds(first.decode_rank, prompt, bs, FEED_TIMEOUT_S, worker=pd.decode.url)
    again = send(pd, router, prompt, prefill="skipped", max_tokens=4)
    assert again.decode_rank == first.decode_rank
    assert again.routed.matched_tokens == full
    assert int(again.routed.headers["x-kvevents-uncached-tokens"]) == LONG - full
    assert again.routed.cached_tokens == full
    assert again.prefilled == NOTHING
    assert again.decoded.tokens(again.decode_rank) == tokens(LONG - full, local=full)
    assert again.router_counted == {"decode.requests": 1, "decode.prefill_skipped": 1}


def test_a_prompt_extending_a_prefilled_one_goes_to_the_prefill_rank_holding_its_start(
    pd: PDFleet, router: RouterProcess
) -> None:
    """A prompt that extends an earlier one by 300 tokens is prefilled on the prefill rank holding the earlier prompt (reason cache), which reuses those blocks, and decoded on the decode rank holding them, which reads only the rest from the transfer."""
    bs = pd.block_size
    prompts = Prompts("pd-extend")
    start = prompts.fresh(LONG)
    first = send(pd, router, start, prefill="load")
    assert first.prefill_rank is not None
    router.wait_holds(first.decode_rank, start, bs, FEED_TIMEOUT_S, worker=pd.decode.url)
    router.wait_holds(first.prefill_rank, start, bs, FEED_TIMEOUT_S, worker=pd.prefill.url)
    held = len(start) // bs * bs
    longer = start[:held] + prompts.fresh(LONG)
    full = pd.decode.max_cached_tokens(len(longer))
    sent = send(pd, router, longer, prefill="cache", max_tokens=4)
    assert (sent.prefill_rank, sent.decode_rank) == (first.prefill_rank, first.decode_rank)
    assert int(sent.routed.headers["x-kvevents-uncached-tokens"]) == len(longer) - held
    assert sent.routed.cached_tokens == full
    assert sent.prefilled.tokens(first.prefill_rank) == tokens(len(longer) - held, local=held)
    assert sent.decoded.tokens(sent.decode_rank) == tokens(
        len(longer) - full, local=held, transfer=full - held
    )
    assert sent.router_counted == {
        "prefill.requests": 1,
        "prefill.chosen_by_cache": 1,
        "decode.requests": 1,
    }


def test_streaming_through_the_router_relays_the_decodes_events(
    pd: PDFleet, router: RouterProcess
) -> None:
    """A streaming request that needs a hand-off gets the decode's server-sent events, a chunk per generated token, then the usage with the transferred tokens as cached, and [DONE]."""
    prompt = Prompts("pd-stream").fresh(LONG)
    full = pd.decode.max_cached_tokens(LONG)
    sent = send(pd, router, prompt, prefill="load", max_tokens=6, stream=True)
    routed = sent.routed
    assert routed.headers["content-type"].startswith("text/event-stream")
    chunks = routed.body
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    choices = [e["choices"][0] for e in events if e.get("choices")]
    assert 2 <= len(choices) <= 6, chunks  # vLLM may fold a token that decodes to nothing
    assert choices[-1]["finish_reason"] == "length"
    assert "usage" in events[-1] and not events[-1]["choices"]
    assert routed.usage["completion_tokens"] == 6
    assert routed.cached_tokens == full
    assert sent.decoded.tokens(sent.decode_rank) == tokens(LONG - full, transfer=full)


def test_a_short_prompt_is_prefilled_by_the_decode_alone(
    pd: PDFleet, router: RouterProcess
) -> None:
    """A 100-token prompt nobody holds is within --max-local-prefill-tokens: the decode computes it alone and the prefill instance sees no request."""
    prompt = Prompts("pd-short").fresh(SHORT)
    sent = send(pd, router, prompt, prefill="skipped", max_tokens=2)
    assert int(sent.routed.headers["x-kvevents-uncached-tokens"]) == SHORT
    assert sent.routed.cached_tokens == 0
    assert sent.prefilled == NOTHING
    assert sent.decoded.tokens(sent.decode_rank) == tokens(SHORT)
    assert sent.router_counted == {"decode.requests": 1, "decode.prefill_skipped": 1}


def test_a_prompt_asked_back_with_its_logprobs_is_computed_by_the_decode_alone(
    pd: PDFleet, router: RouterProcess
) -> None:
    """A 300-token prompt asked back with its logprobs (echo) goes to the decode alone, which computes every prompt token itself (vLLM reads no cache for a prompt whose logprobs are asked) and answers a logprob for each token; the prefill instance sees no request."""
    prompt = Prompts("pd-logprobs").fresh(LONG)
    extra = {"echo": True, "logprobs": 0}
    sent = send(pd, router, prompt, prefill="skipped", max_tokens=2, extra=extra)
    assert int(sent.routed.headers["x-kvevents-uncached-tokens"]) == LONG
    assert sent.prefilled == NOTHING
    assert sent.decoded.tokens(sent.decode_rank) == tokens(LONG)
    logprobs = sent.routed.body["choices"][0]["logprobs"]["token_logprobs"]
    assert len(logprobs) == LONG + 2 and logprobs[0] is None
    assert all(isinstance(lp, float) for lp in logprobs[1:]), logprobs
    assert sent.router_counted == {"decode.requests": 1, "decode.prefill_skipped": 1}


def test_the_routers_pd_counters_agree_with_its_metrics_and_with_vllm(
    pd: PDFleet, pd_router: tuple[RouterProcess, Ledger]
) -> None:
    """After a hand-off and a request served alone, /workers' pd section equals /metrics' kvevents_router_pd_* families, no leg failed, and the router's per-pool request counts equal the requests each vLLM instance finished since the router started."""
    router, started = pd_router
    prompts = Prompts("pd-agree")
    send(pd, router, prompts.fresh(LONG), prefill="load")
    send(pd, router, prompts.fresh(SHORT), prefill="skipped")
    workers = router.workers()
    section = workers["pd"]
    assert section["protocol"] == "vllm"
    assert [e["url"] for e in section["pools"]["prefill"]["engines"]] == [pd.prefill.url]
    assert [e["url"] for e in section["pools"]["decode"]["engines"]] == [pd.decode.url]
    counts = router_pd_counts(workers)
    assert router_pd_metrics(router.metrics()) == counts
    assert not {k: v for k, v in counts.items() if ".legs_failed." in k and v}, counts
    # Every request of this module went through this router: vLLM finished exactly the
    # legs the router sent to each pool.
    wait_totals(pd, started, (counts["prefill.requests"], counts["decode.requests"]))


def test_a_long_chat_goes_through_both_legs_as_a_chat(pd: PDFleet) -> None:
    """A chat whose rendered prompt is over 256 tokens is sent to both instances as
    /v1/chat/completions (by a router that renders chats with the decode's /tokenize): the
    prefill instance computes every prompt token and the decode reads the prompt's whole
    blocks from the transfer, as vLLM's own counters say."""
    log = Path(pd.decode.state_dir).parent / "router-pd-chat.log"
    router = pd.start_router(ask_engine=True, log=log)
    try:
        _check_a_long_chat(pd, router)
    finally:
        router.stop()


def _check_a_long_chat(pd: PDFleet, router: RouterProcess) -> None:
    content = words(Prompts("pd-chat").fresh(LONG))
    before = pd.ledger(router)
    routed = router.chat([{"role": "user", "content": content}], max_tokens=2)
    assert routed.status == 200, routed.body
    assert routed.headers.get("x-kvevents-prefill") == "load", dict(routed.headers)
    assert unquote(routed.headers["x-kvevents-prefill-worker"]) == pd.prefill.url
    assert unquote(routed.worker) == pd.decode.url
    assert routed.body["object"] == "chat.completion"
    n = routed.usage["prompt_tokens"]
    assert n > LONG and (n - 1) % pd.block_size, n  # see the module docstring
    p_rank = int(routed.headers["x-kvevents-prefill-dp-rank"])
    after = pd.settle(router, before, prefill={p_rank: 1}, decode={routed.dp_rank: 1})
    full = pd.decode.max_cached_tokens(n)
    assert routed.cached_tokens == full, "the decode did not read the prefill's KV"
    assert after.prefill.since(before.prefill).tokens(p_rank) == tokens(n)
    assert after.decode.since(before.decode).tokens(routed.dp_rank) == tokens(
        n - full, transfer=full
    )


def test_a_prefill_that_refuses_the_prompt_is_one_error_and_no_decode_leg(
    pd: PDFleet, router: RouterProcess
) -> None:
    """A prompt longer than the instances' --max-model-len is refused by the prefill
    instance: the client gets its 400 in OpenAI's error shape, the decode instance is never
    sent the request, and the router counts the prefill leg failed with status (runs last:
    the counters test above checks that nothing failed before it)."""
    before = pd.ledger(router)
    routed = router.complete(words(Prompts("pd-too-long").fresh(1100)), max_tokens=1)
    assert routed.status == 400, routed.body
    error = json.loads(routed.body)["error"]
    assert error["message"] and error["type"], error
    time.sleep(1.0)  # a decode leg sent by mistake would be counted by now
    after = pd.ledger(router)
    assert after.decode.since(before.decode) == NOTHING
    assert after.prefill.since(before.prefill) == NOTHING
    delta = router_delta(after, before)
    assert delta.get("prefill.legs_failed.status") == 1, delta
    assert not delta.get("decode.legs_failed.status"), delta
