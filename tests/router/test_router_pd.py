"""`kvevents router --prefill ... --decode ...` in front of fake P/D engines, over real HTTP.

The fakes (:mod:`pd_support`) behave like SGLang's and vLLM's prefill and decode servers
and hand the KV over through a registry shared in the test process, so a decode leg
that never gets its prefill waits, as a real one does. Each engine is described with
real event publishers (two ranks each), so the tests also steer the choice by
publishing blocks. Faults: an engine answering 500, one that never answers, one that
is down; each must end in one error for the client, the other leg cancelled.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq
from openai_support import RankPublishers
from pd_support import FakePD, Handoffs
from router_support import RouterProc, wait_until

from kvevents.transport.endpoints import free_port_range

BS = 4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


class Pair:
    """A fake prefill and a fake decode engine, each with two ranks' publishers."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.handoffs = Handoffs()
        self.prefill = FakePD("prefill", self.handoffs)
        self.decode = FakePD("decode", self.handoffs)
        base_p, base_d = free_port_range(4), free_port_range(4)
        self.pubs_p = RankPublishers(ctx, 2, base_p, base_p + 2, topic="kv")
        self.pubs_d = RankPublishers(ctx, 2, base_d, base_d + 2, topic="kv")

    def args(self, kind: str, *, prefill_port: str | None = None) -> list[str]:
        def described(flag: list[str], pubs: RankPublishers) -> list[str]:
            return [
                *flag, "--kv-endpoint", pubs.live, "--replay-endpoint", pubs.replay,
                "--dp-size", "2", "--topic", "kv", "--block-size", str(BS),
                "--engine-kind", kind,
            ]  # fmt: skip

        prefill = ["--prefill", self.prefill.url, *([prefill_port] if prefill_port else [])]
        return described(prefill, self.pubs_p) + described(
            ["--decode", self.decode.url], self.pubs_d
        )

    def reset(self) -> None:
        for fake in (self.prefill, self.decode):
            fake.received.clear()
            fake.fault = None
            fake.left = 0
            fake.share_storage = False

    def close(self) -> None:
        for thing in (self.pubs_p, self.pubs_d, self.prefill, self.decode):
            thing.close()


@contextlib.contextmanager
def pd_router(
    pair: Pair, kind: str, *extra: str, prefill_port: str | None = None
) -> Iterator[RouterProc]:
    """A router in P/D mode over ``pair`` following all four ranks."""
    argv = pair.args(kind, prefill_port=prefill_port)
    proc = RouterProc([], *argv, "--prefill-timeout", "2", "--forward-timeout", "4", *extra)
    try:
        wait_until(lambda: proc.connected() == 4, 20, "the router to follow all four ranks")
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def sglang(ctx: zmq.Context) -> Iterator[tuple[Pair, RouterProc]]:
    pair = Pair(ctx)
    try:
        with pd_router(
            pair, "sglang", "--max-local-prefill-tokens", "8", "--load-interval", "60"
        ) as proc:
            yield pair, proc
    finally:
        pair.close()


@pytest.fixture(scope="module")
def vllm(ctx: zmq.Context) -> Iterator[tuple[Pair, RouterProc]]:
    pair = Pair(ctx)
    try:
        with pd_router(
            pair, "vllm", "--max-local-prefill-tokens", "0", "--load-interval", "60"
        ) as proc:
            yield pair, proc
    finally:
        pair.close()


@pytest.fixture
def sg(sglang: tuple[Pair, RouterProc]) -> Iterator[tuple[Pair, RouterProc]]:
    sglang[0].reset()
    yield sglang
    sglang[0].reset()


@pytest.fixture
def vl(vllm: tuple[Pair, RouterProc]) -> Iterator[tuple[Pair, RouterProc]]:
    vllm[0].reset()
    yield vllm
    vllm[0].reset()


_counter = iter(range(10_000, 1_000_000, 1000))


def fresh_prompt(n: int = 32) -> list[int]:
    """A prompt of ``n`` tokens no earlier test sent (so no engine caches it)."""
    start = next(_counter)
    return list(range(start, start + n))


def held(router: RouterProc, worker: str, rank: int, tokens: list[int]) -> None:
    """Wait until the router's index has ``tokens`` on ``worker`` rank ``rank`` (asked
    with one token more, so that every block of them is one an engine reuses)."""
    whole = len(tokens) // BS * BS

    def matched() -> bool:
        body = router.post("/query", {"input_ids": [*tokens, 0]}).json()
        return any(
            m["worker"] == worker and m["dp_rank"] == rank and m["matched_tokens"] == whole
            for m in body["matches"]
        )

    wait_until(matched, 10, f"{worker} rank {rank} to hold the prompt in the router")


def sse(text: str) -> list[Any]:
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]", events
    return [json.loads(e) for e in events[:-1]]


def workers_pd(router: RouterProc) -> dict[str, Any]:
    pd: dict[str, Any] = router.http.get("/workers").json()["pd"]
    return pd


# --- SGLang's legs ---------------------------------------------------------------------


def test_sglang_legs_go_at_once_joined_by_one_room_with_both_ranks_pinned(sg: tuple) -> None:
    """Both legs carry the same fresh room, the prefill's host and advertised bootstrap
    port; each names its own rank, the decode the prefill's; the client gets the decode's answer."""
    pair, router = sg
    response = router.post("/v1/completions", {"prompt": fresh_prompt(), "max_tokens": 2})
    assert response.status_code == 200, response.text
    (prefill,), (decode,) = pair.prefill.bodies(), pair.decode.bodies()
    assert isinstance(prefill["bootstrap_room"], int)
    assert prefill["bootstrap_room"] == decode["bootstrap_room"]
    assert 0 <= prefill["bootstrap_room"] < 2**63
    assert prefill["bootstrap_host"] == decode["bootstrap_host"] == "127.0.0.1"
    assert prefill["bootstrap_port"] == decode["bootstrap_port"] == pair.prefill.bootstrap_port
    p_rank = int(response.headers["x-kvevents-prefill-dp-rank"])
    d_rank = int(response.headers["x-kvevents-dp-rank"])
    assert prefill["routed_dp_rank"] == p_rank and "disagg_prefill_dp_rank" not in prefill
    assert decode["routed_dp_rank"] == d_rank and decode["disagg_prefill_dp_rank"] == p_rank
    assert response.headers["x-kvevents-worker"] == pair.decode.url
    assert response.headers["x-kvevents-prefill-worker"] == pair.prefill.url
    assert response.headers["x-kvevents-prefill"] == "load"
    assert response.json()["choices"][0]["text"] == f"decode-{d_rank}"
    second = router.post("/v1/completions", {"prompt": fresh_prompt(), "max_tokens": 2})
    assert pair.prefill.bodies()[1]["bootstrap_room"] != prefill["bootstrap_room"]
    assert second.status_code == 200


def test_sglang_stream_relays_the_decodes_events(sg: tuple) -> None:
    """A streamed completion is the decode's events; the prefill leg asked for no stream."""
    pair, router = sg
    body = {"prompt": fresh_prompt(), "max_tokens": 3, "stream": True}
    response = router.post("/v1/completions", body)
    assert response.status_code == 200
    d_rank = int(response.headers["x-kvevents-dp-rank"])
    assert [e["text"] for e in sse(response.text)] == [f"decode-{d_rank}-{i}" for i in range(3)]
    assert pair.prefill.bodies()[0]["stream"] is False
    assert pair.decode.bodies()[0]["stream"] is True


def test_sglang_generate_merges_the_prefills_input_logprobs(sg: tuple) -> None:
    """/generate with return_logprob answers the decode's result with the prefill's input
    logprobs in front, whole or in the stream's first event, and says where it went."""
    pair, router = sg
    body = {"input_ids": fresh_prompt(), "return_logprob": True, "sampling_params": {}}
    answer = router.post("/generate", body).json()
    assert answer["meta_info"]["input_token_logprobs"] == [[-0.5, 1, None], [-0.25, 2, None]]
    assert answer["router"]["prefill_skipped"] is False
    assert answer["router"]["prefill"]["worker"] == pair.prefill.url
    assert answer["router"]["decode"]["worker"] == pair.decode.url
    streamed = router.post("/generate", {**body, "input_ids": fresh_prompt(), "stream": True})
    events = sse(streamed.text)
    assert events[0]["meta_info"]["input_token_logprobs"] == [[-0.5, 1, None], [-0.25, 2, None]]
    assert events[1]["meta_info"]["input_token_logprobs"] == []


def test_sglang_chat_goes_through_both_legs(sg: tuple) -> None:
    """A chat is rendered, routed and sent to both legs at /v1/chat/completions."""
    pair, router = sg
    messages = [{"role": "user", "content": "a longer question " * 4}]
    response = router.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"
    assert [p for p, _, _ in pair.prefill.received] == ["/v1/chat/completions"]
    assert [p for p, _, _ in pair.decode.received] == ["/v1/chat/completions"]


@pytest.mark.parametrize(("prompt_count", "n", "rooms"), [(2, 1, 2), (1, 3, 3), (2, 2, 4)])
def test_batches_and_samples_get_one_room_each(
    sg: tuple, prompt_count: int, n: int, rooms: int
) -> None:
    """A prompt list gets a list of rooms, one per prompt and sample, the same on both legs."""
    pair, router = sg
    prompts = [fresh_prompt() for _ in range(prompt_count)]
    prompt: Any = prompts if prompt_count > 1 else prompts[0]
    response = router.post("/v1/completions", {"prompt": prompt, "n": n, "max_tokens": 1})
    assert response.status_code == 200, response.text
    (prefill,), (decode,) = pair.prefill.bodies(), pair.decode.bodies()
    assert isinstance(prefill["bootstrap_room"], list)
    assert len(set(prefill["bootstrap_room"])) == rooms
    assert prefill["bootstrap_room"] == decode["bootstrap_room"]


def test_the_prefill_is_skipped_when_the_decode_rank_holds_the_prompt(sg: tuple) -> None:
    """A decode rank holding the prompt (but for at most N tokens) serves it alone, its
    rank pinned, no hand-off fields; the prefill engine sees nothing."""
    pair, router = sg
    prompt = fresh_prompt()
    pair.pubs_d.store(1, prompt, BS)
    held(router, pair.decode.url, 1, prompt)
    response = router.post("/v1/completions", {"prompt": [*prompt, 1, 2, 3], "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert response.headers["x-kvevents-prefill"] == "skipped"
    assert response.headers["x-kvevents-uncached-tokens"] == "3"
    assert pair.prefill.received == []
    (decode,) = pair.decode.bodies()
    assert decode["routed_dp_rank"] == 1
    assert not {"bootstrap_room", "bootstrap_host", "disagg_prefill_dp_rank"} & set(decode)


def test_an_sglang_decode_server_is_never_sent_a_request_alone(ctx: zmq.Context) -> None:
    """A decode engine whose /server_info does not say it prefills alone (an SGLang decode
    server serves every request from a prefill's KV) gets even a prompt it holds with a
    prefill leg beside it (so does /route), and /workers says so."""
    pair = Pair(ctx)
    pair.decode.local_prefill = False
    try:
        with pd_router(pair, "sglang", "--max-local-prefill-tokens", "8") as router:
            wait_until(
                lambda: (
                    workers_pd(router)["pools"]["decode"]["engines"][0]["advertised_mode"]
                    == "decode"
                ),
                10,
                "the decode's /server_info read",
            )
            engines = workers_pd(router)["pools"]["decode"]["engines"]
            assert engines[0]["local_prefill"] is False
            prompt = fresh_prompt()
            pair.pubs_d.store(1, prompt, BS)
            held(router, pair.decode.url, 1, prompt)
            routed = router.post("/route", {"input_ids": [*prompt, 1, 2, 3]}).json()
            assert routed["prefill_skipped"] is False and routed["prefill"] is not None
            body = {"prompt": [*prompt, 1, 2, 3], "max_tokens": 1}
            response = router.post("/v1/completions", body)
            assert response.status_code == 200, response.text
            assert response.headers["x-kvevents-prefill"] != "skipped"
            assert response.headers["x-kvevents-dp-rank"] == "1"
            (prefilled,), (decoded,) = pair.prefill.bodies(), pair.decode.bodies()
            assert decoded["bootstrap_room"] == prefilled["bootstrap_room"]
    finally:
        pair.close()


def test_the_prefill_rank_holding_the_prompt_is_chosen_by_its_cache(sg: tuple) -> None:
    """With the prompt cached on prefill rank 1, the prefill leg goes there, by cache."""
    pair, router = sg
    prompt = fresh_prompt()
    pair.pubs_p.store(1, prompt, BS)
    held(router, pair.prefill.url, 1, prompt)
    response = router.post(
        "/v1/completions", {"prompt": [*prompt, *fresh_prompt()], "max_tokens": 1}
    )
    assert response.headers["x-kvevents-prefill"] == "cache"
    assert response.headers["x-kvevents-prefill-dp-rank"] == "1"
    assert pair.prefill.bodies()[0]["routed_dp_rank"] == 1


def test_route_answers_both_holders_and_records_them(sg: tuple) -> None:
    """/route in P/D mode answers the decode holder (top level and 'decode'), the prefill
    holder or that it is skipped; 'record' counts both without sending anything."""
    pair, router = sg
    prompt = fresh_prompt()
    answer = router.post("/route", {"input_ids": prompt, "record": True}).json()
    assert answer["worker"] == answer["decode"]["worker"] == pair.decode.url
    assert answer["dp_rank"] == answer["decode"]["dp_rank"]
    assert answer["prefill_skipped"] is False and answer["prefill_reason"] == "load"
    assert answer["prefill"]["worker"] == pair.prefill.url
    assert answer["uncached_tokens"] == answer["prompt_tokens"] == len(prompt)
    assert answer["protocol"] == "sglang" and answer["recorded"] is True
    predicted = router.post("/query", {"input_ids": prompt}).json()["matches"]
    holders = {(m["worker"], m["dp_rank"]) for m in predicted if m.get("predicted_blocks")}
    assert holders == {
        (pair.prefill.url, answer["prefill"]["dp_rank"]),
        (pair.decode.url, answer["dp_rank"]),
    }
    assert pair.prefill.received == [] and pair.decode.received == []
    pair.pubs_d.store(0, prompt, BS)
    held(router, pair.decode.url, 0, prompt)
    skipped = router.post("/route", {"input_ids": prompt}).json()
    assert skipped["prefill_skipped"] is True and skipped["prefill"] is None


# --- faults, SGLang -------------------------------------------------------------------


def test_a_prefill_answering_500_is_one_error_and_the_decode_is_cancelled(sg: tuple) -> None:
    """A prefill error answers 502 in OpenAI's shape; the decode, waiting for its room,
    is cancelled (its connection closed), and the leg counted failed per pool."""
    pair, router = sg
    before = workers_pd(router)["pools"]
    pair.prefill.fault = "status"
    response = router.post("/v1/completions", {"prompt": fresh_prompt(), "max_tokens": 1})
    assert response.status_code == 502
    error = response.json()["error"]
    assert "the prefill engine" in error["message"] and "500" in error["message"]
    assert error["type"] == "bad_gateway"
    wait_until(lambda: pair.decode.left == 1, 5, "the decode leg to be cancelled")
    after = workers_pd(router)["pools"]
    assert (
        after["prefill"]["legs_failed"]["status"] == before["prefill"]["legs_failed"]["status"] + 1
    )
    assert (
        after["decode"]["legs_failed"]["cancelled"]
        == before["decode"]["legs_failed"]["cancelled"] + 1
    )


def test_a_prefill_that_never_answers_ends_at_its_deadline(sg: tuple) -> None:
    """A prefill leg that hangs fails at --prefill-timeout (504, /generate's error shape);
    the decode is cancelled, nothing waits for the decode's own timeout."""
    pair, router = sg
    pair.prefill.fault = "hang"
    response = router.post("/generate", {"input_ids": fresh_prompt()})
    assert response.status_code == 504
    error = response.json()["error"]
    assert error.startswith(f"the prefill engine {pair.prefill.url} did not answer")
    assert error.endswith("within its deadline (2 s)")  # not the decode's 4 s
    wait_until(lambda: pair.decode.left == 1 and pair.prefill.left == 1, 5, "both legs closed")


def test_a_decode_answering_500_passes_on_and_withdraws_the_prefill_prediction(sg: tuple) -> None:
    """The decode's error answer goes to the client as it came; the prefill's blocks,
    predicted on its rank, are withdrawn."""
    pair, router = sg
    pair.decode.fault = "status"
    prompt = fresh_prompt()
    response = router.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert response.status_code == 500
    assert response.json() == {"error": {"message": "decode broke"}}
    matches = router.post("/query", {"input_ids": prompt}).json()["matches"]
    assert all(not m.get("predicted_blocks") for m in matches)


def test_a_decode_that_never_answers_ends_at_the_forward_timeout(sg: tuple) -> None:
    """A decode leg without an answer fails at --forward-timeout: 504, counted as a timeout."""
    pair, router = sg
    pair.decode.fault = "hang"
    before = workers_pd(router)["pools"]["decode"]["legs_failed"]["timeout"]
    response = router.post("/v1/completions", {"prompt": fresh_prompt(), "max_tokens": 1})
    assert response.status_code == 504
    assert workers_pd(router)["pools"]["decode"]["legs_failed"]["timeout"] == before + 1


def _down(ctx: zmq.Context, which: str, kind: str) -> None:
    """Engine ``which`` goes down after the router's first poll: one error, the other leg ended."""
    pair = Pair(ctx)
    try:
        with pd_router(
            pair, kind, "--max-local-prefill-tokens", "0", "--load-interval", "60"
        ) as router:
            getattr(pair, which).close()
            prompt = fresh_prompt()
            response = router.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
            assert response.status_code == 502, response.text
            message = response.json()["error"]["message"]
            assert f"the {which} engine {getattr(pair, which).url} failed" in message
            pools = workers_pd(router)["pools"]
            assert pools[which]["legs_failed"]["unreachable"] == 1
            matches = router.post("/query", {"input_ids": prompt}).json()["matches"]
            assert all(not m.get("predicted_blocks") for m in matches)
            metrics = router.http.get("/metrics").text
            line = (
                f'kvevents_router_pd_legs_failed_total{{pool="{which}",reason="unreachable"}} 1.0'
            )
            assert line in metrics
            other = pair.decode if which == "prefill" else pair.prefill
            if kind == "sglang" and which == "prefill":
                wait_until(lambda: other.left == 1, 5, "the decode leg to be cancelled")
            if kind == "vllm" and which == "prefill":
                assert other.received == []  # sequential: the decode is never sent
    finally:
        pair.close()


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_an_engine_down_is_one_error_and_its_predictions_are_withdrawn(
    ctx: zmq.Context, which: str, kind: str
) -> None:
    """A prefill or decode engine that went down answers 502 naming it; the request's
    predicted blocks are withdrawn from both holders and the leg counted unreachable."""
    _down(ctx, which, kind)


def test_a_prefill_pool_known_down_answers_503_and_a_configured_port_is_used(
    ctx: zmq.Context,
) -> None:
    """A bootstrap port given as --prefill URL PORT wins over /server_info's; with every
    prefill rank unavailable, a request that needs one answers 503 naming the pool."""
    pair = Pair(ctx)
    try:
        with pd_router(pair, "sglang", "--load-interval", "0.2", prefill_port="7777") as router:
            prompt = fresh_prompt(300)  # past the default 256 tokens a decode prefills
            response = router.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
            assert response.status_code == 200, response.text
            assert pair.prefill.bodies()[0]["bootstrap_port"] == 7777
            engines = workers_pd(router)["pools"]["prefill"]["engines"]
            assert engines[0]["bootstrap_port_source"] == "configured"
            pair.prefill.close()
            wait_until(
                lambda: (
                    router.post("/v1/completions", {"prompt": fresh_prompt(300)}).status_code == 503
                ),
                10,
                "the router to see the prefill engine down",
            )
            refused = router.post("/v1/completions", {"prompt": fresh_prompt(300)}).json()
            assert "no prefill engine rank" in refused["error"]["message"]
    finally:
        pair.close()


# --- vLLM's legs ----------------------------------------------------------------------


def test_vllm_prefill_then_decode_with_its_transfer_params(vl: tuple) -> None:
    """vLLM: the prefill leg asks one token and a remote decode, no stream; the decode
    leg carries the kv_transfer_params it answered; ranks are the X-data-parallel-rank
    header on each leg, the bodies name none."""
    pair, router = vl
    body = {
        "prompt": fresh_prompt(),
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = router.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    d_rank = response.headers["x-kvevents-dp-rank"]
    assert [e["text"] for e in sse(response.text)] == [f"decode-{d_rank}-{i}" for i in range(3)]
    (_, p_headers, prefill), (_, d_headers, decode) = (
        pair.prefill.received[0],
        pair.decode.received[0],
    )
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "stream_options" not in prefill
    assert decode["kv_transfer_params"]["do_remote_prefill"] is True
    assert decode["kv_transfer_params"]["remote_request_id"] in pair.handoffs.requests
    assert decode["max_tokens"] == 5 and decode["stream"] is True
    assert p_headers["x-data-parallel-rank"] == response.headers["x-kvevents-prefill-dp-rank"]
    assert d_headers["x-data-parallel-rank"] == d_rank
    assert "routed_dp_rank" not in prefill and "routed_dp_rank" not in decode


def test_vllm_chat_and_shared_storage(vl: tuple) -> None:
    """A chat's prefill leg caps max_completion_tokens too; a prefill answering no
    kv_transfer_params (shared storage) leaves the decode leg as the client sent it."""
    pair, router = vl
    pair.prefill.share_storage = True
    messages = [{"role": "user", "content": "hello " * 8}]
    body = {"messages": messages, "max_completion_tokens": 9}
    response = router.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    prefill, decode = pair.prefill.bodies()[0], pair.decode.bodies()[0]
    assert prefill["max_completion_tokens"] == 1 and prefill["max_tokens"] == 1
    assert decode == body


@pytest.mark.parametrize(
    ("path", "members"),
    [
        ("/v1/completions", {"prompt_logprobs": 0}),
        ("/v1/completions", {"echo": True, "logprobs": 1}),
        ("/v1/chat/completions", {"prompt_logprobs": 2}),
    ],
)
def test_vllm_prompt_logprobs_go_to_the_decode_alone(
    vl: tuple, path: str, members: dict[str, Any]
) -> None:
    """vLLM computes the prompt of a request asking for its logprobs itself, whatever it
    is handed: such a request, long as it is, goes to the decode alone, as the client
    sent it (counted a prefill skipped); without them the same prompt takes both legs."""
    pair, router = vl
    prompt = fresh_prompt(300)  # past the default 256 tokens a decode prefills
    if path == "/v1/chat/completions":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "hello " * 300}]}
    else:
        body = {"prompt": prompt}
    response = router.post(path, {**body, **members})
    assert response.status_code == 200, response.text
    assert pair.prefill.received == []
    (decoded,) = pair.decode.bodies()
    assert "kv_transfer_params" not in decoded
    assert {k: decoded[k] for k in members} == members
    assert "x-kvevents-prefill-dp-rank" not in response.headers
    pd = workers_pd(router)
    assert pd["pools"]["decode"]["prefill_skipped"] >= 1, pd
    both = router.post(path, {**body, "max_tokens": 2})
    assert both.status_code == 200, both.text
    assert len(pair.prefill.received) == 1 and len(pair.decode.received) == 2


def test_vllm_prefill_error_never_sends_the_decode(vl: tuple) -> None:
    """A vLLM prefill answering 500 is a 502 for the client; the decode leg is not sent."""
    pair, router = vl
    pair.prefill.fault = "status"
    response = router.post("/v1/completions", {"prompt": fresh_prompt()})
    assert response.status_code == 502
    assert pair.decode.received == []


def test_vllm_generate_is_refused(vl: tuple) -> None:
    """/generate is SGLang's: with the vLLM protocol it answers 501, sending nothing."""
    pair, router = vl
    response = router.post("/generate", {"input_ids": fresh_prompt()})
    assert response.status_code == 501
    assert "--pd-protocol vllm" in response.json()["error"]
    assert pair.prefill.received == [] and pair.decode.received == []


# --- what was decided, per pool ---------------------------------------------------------


def test_workers_and_metrics_count_per_pool(ctx: zmq.Context) -> None:
    """/workers and /metrics show per pool the requests, prefills skipped, the reasons
    prefills were chosen and the engines' advertised roles."""
    pair = Pair(ctx)
    try:
        with pd_router(pair, "sglang", "--max-local-prefill-tokens", "4") as router:
            cached = fresh_prompt()
            pair.pubs_p.store(0, cached, BS)
            held(router, pair.prefill.url, 0, cached)
            router.post("/v1/completions", {"prompt": cached + fresh_prompt()})  # by cache
            router.post("/v1/completions", {"prompt": fresh_prompt()})
            alone = fresh_prompt()
            pair.pubs_d.store(1, alone, BS)
            held(router, pair.decode.url, 1, alone)
            router.post("/v1/completions", {"prompt": alone})  # skipped
            pd = workers_pd(router)
            assert pd["protocol"] == "sglang" and pd["max_local_prefill_tokens"] == 4
            prefill, decode = pd["pools"]["prefill"], pd["pools"]["decode"]
            assert prefill["requests"] == 2 and decode["requests"] == 3
            assert decode["prefill_skipped"] == 1
            assert prefill["chosen_by_cache"] == 1
            assert (
                prefill["chosen_by_cache"]
                + prefill["chosen_by_load"]
                + prefill["chosen_by_prediction"]
                == 2
            )
            assert prefill["engines"][0]["advertised_mode"] == "prefill"
            assert prefill["engines"][0]["bootstrap_port"] == pair.prefill.bootstrap_port
            assert decode["engines"][0]["advertised_mode"] == "decode"
            metrics = router.http.get("/metrics").text
            assert 'kvevents_router_pd_requests_total{pool="decode"} 3.0' in metrics
            assert 'kvevents_router_pd_requests_total{pool="prefill"} 2.0' in metrics
            assert "kvevents_router_pd_prefill_skipped_total 1.0" in metrics
            assert 'kvevents_router_pd_prefill_chosen_total{reason="cache"} 1.0' in metrics
    finally:
        pair.close()


# --- the command line -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--engine", "http://a:1", "--prefill", "http://b:1", "--decode", "http://c:1"],
            "cannot be mixed",
        ),
        (["--prefill", "http://b:1"], "--prefill needs at least one --decode engine"),
        (["--decode", "http://c:1"], "--decode needs at least one --prefill engine"),
        (
            ["--prefill", "http://b:1", "port", "--decode", "http://c:1"],
            "bootstrap port must be a number",
        ),
        (["--pd-protocol", "vllm", "--engine", "http://a:1"], "--pd-protocol needs --prefill"),
        (
            ["--prefill", "http://b:1", "--engine-kind", "vllm", "--decode", "http://c:1"],
            "mix vllm engines with kvevents ones",
        ),
        (["--prefill", "http://b:1", "--decode", "http://b:1"], "given twice"),
    ],
)
def test_cli_refuses_what_does_not_fit(argv: list[str], message: str) -> None:
    """Options that cannot make a P/D router exit 2 with `kvevents router: error: ...`."""
    from process_support import run_kvevents

    done = run_kvevents("router", "--port", "0", "--workers", "1", *argv, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "kvevents router: error:" in done.stderr and message in done.stderr


def test_a_pool_option_amends_its_engine() -> None:
    """--engine-kind after a --decode amends that engine, as after an --engine."""
    from kvevents.cli.engine_args import pool_specs
    from kvevents.cli.main import build_parser

    args = build_parser("router").parse_args(
        [
            "router",
            "--prefill",
            "http://p:1",
            "9000",
            "--block-size",
            "16",
            "--decode",
            "http://d:1",
            "--engine-kind",
            "vllm",
        ]
    )
    (p_pool, p_spec, port), (d_pool, d_spec, none) = pool_specs(args)
    assert (p_pool, port, p_spec.block_size, p_spec.engine_kind) == (
        "prefill",
        9000,
        16,
        "kvevents",
    )
    assert (d_pool, none, d_spec.engine_kind) == ("decode", None, "vllm")


def test_failed_and_served_requests_leave_nothing_in_flight(sg: tuple) -> None:
    """After failed and successful P/D requests the router answers on (nothing leaked or stuck)."""
    pair, router = sg
    pair.prefill.fault = "status"
    for _ in range(3):
        assert router.post("/v1/completions", {"prompt": fresh_prompt()}).status_code == 502
    pair.prefill.fault = None
    with httpx.Client(base_url=router.url, timeout=10) as client:
        for _ in range(3):
            assert (
                client.post("/v1/completions", json={"prompt": fresh_prompt()}).status_code == 200
            )
    inflight = [
        h["load"]["inflight_requests"] for h in router.http.get("/workers").json()["holders"]
    ]
    assert inflight == [0, 0, 0, 0]


def test_keys_the_client_needs_one_and_both_legs_carry_the_engines(ctx: zmq.Context) -> None:
    """With --api-key a P/D request needs the client's key; both legs carry the router's
    --engine-api-key instead, never the client's."""
    pair = Pair(ctx)
    try:
        keys = ("--api-key", "client-key", "--engine-api-key", "engine-key")
        argv = [*pair.args("sglang"), "--max-local-prefill-tokens", "0", *keys]
        router = RouterProc([], *argv)
        try:
            auth = {"authorization": "Bearer client-key"}
            wait_until(
                lambda: (
                    sum(
                        s["status"] == "connected"
                        for s in router.http.get("/workers", headers=auth).json()["streams"]
                    )
                    == 4
                ),
                20,
                "the router to follow all four ranks",
            )
            body = {"prompt": fresh_prompt(), "max_tokens": 1}
            assert router.http.post("/v1/completions", json=body).status_code == 401
            response = router.http.post("/v1/completions", json=body, headers=auth)
            assert response.status_code == 200, response.text
            for fake in (pair.prefill, pair.decode):
                ((_, headers, _),) = fake.received
                assert headers["authorization"] == "Bearer engine-key"
        finally:
            router.stop()
    finally:
        pair.close()
