"""`kvevents router` as a user runs it: real engine and router processes, real HTTP."""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys

import pytest
from router_support import Engine, RouterProc, wait_until

from kvevents import Holder, PrefixIndex, ScoringWeights
from kvevents.cli.router import add_arguments, build_service
from kvevents.router.decide.router import Router
from kvevents.router.serve.service import RouterService
from kvevents.text.chat import render_chat

PAGE = 4


@pytest.fixture(scope="module")
def engine_args() -> list[str]:
    """The shared ``engine``'s arguments here: two ranks of 256 blocks."""
    return ["--dp-size", "2", "--page-size", str(PAGE), "--max-blocks", "256"]


@pytest.fixture(scope="module")
def router_args() -> list[str]:
    """The shared ``router``'s options: predictions off, so these tests state how routing
    reads confirmed blocks and load alone (test_router_predictions_http.py covers them)."""
    return ["--load-interval", "0.2", "--prediction-ttl", "0"]


def matched(router: RouterProc, tokens: list[int]) -> dict[int, int]:
    body = router.post("/query", {"input_ids": tokens}).json()
    return {m["dp_rank"]: m["matched_tokens"] for m in body["matches"]}


def test_generate_is_routed_to_the_rank_holding_the_prefix(
    engine: Engine, router: RouterProc
) -> None:
    """A repeated prompt goes through the router to the rank that cached it, which reports the reuse."""
    prompt = list(range(1000, 1024))  # 6 pages
    first = router.post("/generate", {"input_ids": prompt, "max_new_tokens": 1}).json()
    rank = first["router"]["dp_rank"]
    assert first["dp_rank"] == rank and first["cached_tokens"] == 0
    wait_until(
        lambda: matched(router, [*prompt, 0])[rank] == 24, 10, "the router to see the prompt"
    )
    again = router.post("/generate", {"input_ids": [*prompt, 1, 2, 3, 4], "max_new_tokens": 1})
    body = again.json()
    assert body["router"]["dp_rank"] == rank == body["dp_rank"]
    assert body["cached_tokens"] == 24 and body["router"]["cached_blocks"] == 6.0


def test_query_and_route_report_every_holder(engine: Engine, router: RouterProc) -> None:
    """/query gives matched tokens per worker, rank and tier; /route explains its choice with scores."""
    prompt = [7] * 16
    engine.generate(prompt, rank=1)
    wait_until(lambda: matched(router, [*prompt, 0])[1] == 16, 10, "rank 1's blocks in the index")
    body = router.post("/query", {"input_ids": [*prompt, 9]}).json()
    assert body["block_size"] == PAGE and body["prompt_tokens"] == 17
    rank1 = next(m for m in body["matches"] if m["dp_rank"] == 1)
    assert rank1 == {
        "worker": engine.url,
        "dp_rank": 1,
        "matched_blocks": 4,
        "matched_tokens": 16,
        "tiers": {"gpu": 16, "cpu": 0, "disk": 0},
    }
    route = router.post("/route", {"input_ids": [*prompt, 9, 9, 9, 9]}).json()
    assert (route["worker"], route["dp_rank"], route["n_blocks"]) == (engine.url, 1, 5)
    assert [s["dp_rank"] for s in route["scores"]] == [1, 0]
    assert route["scores"][0]["matched"] == {"gpu": 4, "cpu": 0, "disk": 0}


def test_text_prompts_use_the_engines_byte_tokenizer(engine: Engine, router: RouterProc) -> None:
    """A text prompt sent to the engine matches the same text asked of the router."""
    text = "the quick brown fox jumps over the lazy dog"
    engine.http.post("/generate", json={"text": text, "routed_dp_rank": 0, "max_new_tokens": 1})
    wait_until(
        lambda: router.post("/query", {"text": text}).json()["matches"][0]["matched_tokens"] == 40,
        10,
        "the text prompt's 10 pages on rank 0",
    )


def test_workers_metrics_and_dump(engine: Engine, router: RouterProc) -> None:
    """/workers shows both streams connected, /metrics is Prometheus text, /dump equals /kv_blocks."""
    engine.generate(list(range(50, 62)), rank=0)
    workers = router.http.get("/workers").json()
    assert {s["dp_rank"] for s in workers["streams"]} == {0, 1}
    assert all(s["status"] == "connected" for s in workers["streams"])
    assert workers["engines"][0]["discovery"]["state"] == "subscribed"
    text = router.http.get("/metrics").text
    for family in (
        "kvevents_router_events_total",
        "kvevents_router_index_entries",
        "kvevents_router_lookups_total",
        "kvevents_router_stream_lag_seconds",
        "kvevents_router_stream_gaps_total",
        "kvevents_router_stream_lost_total",
        "kvevents_router_stream_resets_total",
    ):
        assert f"# TYPE {family.removesuffix('_total')}" in text, family

    def dump_equals_engine() -> bool:
        index = PrefixIndex.from_bytes(router.http.get("/dump").content)
        return all(
            index.holder_hashes(Holder(engine.url, r)) == engine.kv_blocks(r) for r in (0, 1)
        )

    wait_until(dump_equals_engine, 10, "the dumped index to equal /kv_blocks")


def test_bad_bodies_answer_400_naming_the_problem(router: RouterProc) -> None:
    """A body with neither or both of input_ids/text, or a bad token, is a 400 that says why."""
    neither = router.post("/query", {})
    assert neither.status_code == 400 and "input_ids" in neither.json()["error"]
    both = router.post("/route", {"input_ids": [1], "text": "a"})
    assert both.status_code == 400
    bad = router.post("/generate", {"input_ids": [-1]})
    assert bad.status_code == 400 and "input_ids" in bad.json()["error"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_engine_not_up_yet_is_reported_not_fatal() -> None:
    """With its engine down, the router still serves: 503 for routing, the error in /workers."""
    url = f"http://127.0.0.1:{_closed_port()}"
    proc = RouterProc([url])
    try:
        answer = proc.post("/route", {"input_ids": [1, 2, 3, 4]})
        assert answer.status_code == 503 and "no engine rank is known" in answer.json()["error"]
        wait_until(
            lambda: proc.http.get("/workers").json()["engines"][0]["load_error"] is not None,
            10,
            "the load poller to report the dead engine",
        )
    finally:
        proc.stop()


def test_a_started_router_already_knows_its_engines(engine: Engine) -> None:
    """RouterService.start() returns (and so the server says it is ready) only after each
    engine's first poll: the advertised block size, the ranks and their load are known,
    so the first /query is answered instead of refused for want of a block size."""

    async def run() -> None:
        router = Router()
        service = RouterService(router, [engine.url], load_interval=60.0)
        await service.start()
        try:
            assert router.index.block_size == PAGE
            assert sorted(h.dp_rank for h in router.loads) == [0, 1]
            (state,) = service.states.values()
            assert state.registered and state.load_source == "/load"
            matches = router.query([1, 2, 3, 4])  # no RouterNotReadyError: the size is known
            assert set(matches) == set(router.loads)
        finally:
            await service.stop()

    asyncio.run(run())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--credits", "1,2"], "kvevents router: error: --credits '1,2'"),
        (["--balance-weight", "-1"], "error: argument --balance-weight: -1: must be a number >= 0"),
        (["--balance-half-life", "0"], "error: argument --balance-half-life: 0: must be a finite"),
    ],
)
def test_bad_option_exits_2_with_a_message(option: list[str], message: str) -> None:
    """A malformed --credits, a negative weight or a zero half-life exits with code 2 and names the option."""
    done = subprocess.run(
        [sys.executable, "-m", "kvevents.cli.main", "router", "--engine", "x", *option],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.parametrize(
    ("argv", "weights"),
    [
        ([], ScoringWeights()),
        (
            ["--load-weight", "0.5", "--balance-weight", "0", "--balance-half-life", "16"],
            ScoringWeights(load_weight=0.5, balance_weight=0.0, balance_half_life=16),
        ),
    ],
)
def test_scoring_options_reach_the_router(argv: list[str], weights: ScoringWeights) -> None:
    """With no scoring options the router uses ScoringWeights' defaults; each option sets its weight."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    service = build_service(parser.parse_args(["--engine", "http://127.0.0.1:9", *argv]))
    try:
        assert service.router.weights == weights
    finally:
        assert service.subscriber is not None
        service.subscriber.close()


def test_query_and_route_take_chat_messages(engine: Engine, router: RouterProc) -> None:
    """/query and /route accept a chat as messages, rendered as /v1/chat/completions renders it."""
    messages = [{"role": "user", "content": "route this conversation, please"}]
    chat = router.post("/query", {"messages": messages}).json()
    ids = router.post("/query", {"input_ids": list(render_chat(messages).encode())}).json()
    assert chat == ids
    plain = router.post("/query", {"messages": messages, "add_generation_prompt": False}).json()
    assert plain["prompt_tokens"] == len(render_chat(messages, add_generation_prompt=False))
    assert router.post("/route", {"messages": messages}).status_code == 200
    both = router.post("/route", {"messages": messages, "text": "x"})
    assert both.status_code == 400 and '"messages"' in both.json()["error"]
    bad = router.post("/query", {"messages": [{"role": "user"}, "x"]})
    assert bad.status_code == 400 and "messages[1]" in bad.json()["error"]
    generate = router.post("/generate", {"messages": messages})  # /generate takes no chat
    assert generate.status_code == 400 and "/v1/chat/completions" in generate.json()["error"]


def test_a_tokenizer_that_cannot_be_reached_answers_502(engine: Engine) -> None:
    """Text asked of a router whose --tokenize-endpoint is down gets 502 naming the endpoint."""
    with socket.socket() as probe:  # a port nothing listens on once the probe closes
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}/tokenize"
    proc = RouterProc([engine.url], "--tokenize-endpoint", dead)
    try:
        wait_until(lambda: len(proc.http.get("/workers").json()["holders"]) == 2, 20, "discovery")
        response = proc.post("/query", {"text": "hello"})
        assert response.status_code == 502
        assert dead in response.json()["error"]
        chat = proc.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 502 and dead in chat.json()["error"]["message"]
    finally:
        proc.stop()


def test_route_changes_nothing_unless_asked_to_record(engine: Engine, router: RouterProc) -> None:
    """/route alone leaves the router as it was; with "record" the choice counts as sent,
    so the same uncached prompt then goes to the other rank."""
    prompt = {"input_ids": [3000 + i for i in range(64 * PAGE)]}  # 64 blocks nobody holds

    def routed() -> dict[int, int]:
        found = router.http.get("/workers").json()["holders"]
        return {h["dp_rank"]: h["load"]["routed"] for h in found}

    before = routed()
    first = router.post("/route", prompt).json()
    again = router.post("/route", prompt).json()
    assert first["dp_rank"] == again["dp_rank"] and not again["recorded"]
    assert routed() == before
    recorded = router.post("/route", {**prompt, "record": True}).json()
    assert recorded["recorded"] and recorded["dp_rank"] == first["dp_rank"]
    after = routed()
    assert after[first["dp_rank"]] == before[first["dp_rank"]] + 1
    assert router.post("/route", prompt).json()["dp_rank"] != first["dp_rank"]
