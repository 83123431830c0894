"""/v1/completions end to end: the simulated engine, described to `kvevents router` by flags only.

The engine publishes on fixed consecutive ports (live ``base + r``, replay
``base + 2 + r``); the router is told ``--kv-endpoint tcp://*:BASE --dp-size 2`` and
never reads the engine's ``/server_info`` for its streams, so it must apply the per-rank
offsets and the wildcard rule itself. The engine's own ``cached_tokens`` proves the
routing decision right.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_support import stream_events
from router_support import Engine, RouterProc, wait_until

from kvevents.text.chat import render_chat
from kvevents.transport.endpoints import free_port_range

pytestmark = pytest.mark.slow  # an engine and routers as subprocesses

PAGE = 4


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[Engine, int]]:
    base = free_port_range(4)
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{base}",
        "replay_endpoint": f"tcp://*:{base + 2}",
    }
    eng = Engine(["--dp-size", "2", "--page-size", str(PAGE), "--max-blocks", "256"], config)
    yield eng, base
    eng.stop()


def described(engine: Engine, base: int, *extra: str) -> list[str]:
    return [
        "--engine", engine.url, "--kv-endpoint", f"tcp://*:{base}",
        "--replay-endpoint", f"tcp://*:{base + 2}", "--dp-size", "2", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def router(engine: tuple[Engine, int]) -> Iterator[RouterProc]:
    eng, base = engine
    proc = RouterProc(
        [], *described(eng, base, "--engine-kind", "kvevents"), "--load-interval", "0.2"
    )
    try:
        wait_until(lambda: proc.connected() == 2, 20, "the router to follow both ranks")
        yield proc
    finally:
        proc.stop()


def matched(router: RouterProc, tokens: list[int]) -> dict[int, int]:
    body = router.post("/query", {"input_ids": tokens}).json()
    return {m["dp_rank"]: m["matched_tokens"] for m in body["matches"]}


def test_every_rank_is_followed_through_the_per_rank_offsets(
    engine: tuple[Engine, int], router: RouterProc
) -> None:
    """Flags alone subscribe rank r at base + r on the engine URL's host, with replay at its own base + r."""
    eng, base = engine
    workers = router.http.get("/workers").json()
    streams = sorted(workers["streams"], key=lambda s: s["dp_rank"])
    assert [(s["endpoint"], s["replay_endpoint"]) for s in streams] == [
        (f"tcp://127.0.0.1:{base + r}", f"tcp://127.0.0.1:{base + 2 + r}") for r in (0, 1)
    ]
    [described_engine] = workers["engines"]
    assert described_engine["discovery"] is None  # not discovered: described
    assert described_engine["kind"] == "kvevents" and described_engine["registered"]
    eng.generate(list(range(40, 48)), rank=1)
    wait_until(lambda: matched(router, [*range(40, 48), 0])[1] == 8, 10, "rank 1's blocks")


def test_token_prompt_is_routed_to_the_rank_that_cached_it(router: RouterProc) -> None:
    """A repeated token prompt goes back to the rank that served it, which reports the reused prefix."""
    prompt = list(range(1000, 1024))
    first = router.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert first.status_code == 200, first.text
    rank = int(first.headers["x-kvevents-dp-rank"])
    assert first.json()["dp_rank"] == rank
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_until(lambda: matched(router, [*prompt, 0])[rank] == 24, 10, "the prompt in the index")
    again = router.post("/v1/completions", {"prompt": [*prompt, 1, 2, 3, 4], "max_tokens": 1})
    assert again.headers["x-kvevents-dp-rank"] == str(rank)
    assert again.headers["x-kvevents-matched-tokens"] == "24"
    assert again.json()["dp_rank"] == rank
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 24


def test_text_prompt_follows_a_prefix_the_engine_cached(
    engine: tuple[Engine, int], router: RouterProc
) -> None:
    """Text sent to rank 1 by the vLLM header is found again by the router's byte tokenizer and routed there."""
    eng, _ = engine
    text = "the quick brown fox jumps over the lazy dog, twice over"
    direct = eng.http.post(
        "/v1/completions",
        json={"prompt": text, "max_tokens": 1},
        headers={"X-data-parallel-rank": "1"},
    )
    assert direct.json()["dp_rank"] == 1
    wait_until(
        lambda: matched(router, list(text.encode()))[1] == 52, 10, "the text's 13 pages on rank 1"
    )
    routed = router.post("/v1/completions", {"prompt": text + " and more", "max_tokens": 1})
    assert routed.headers["x-kvevents-dp-rank"] == "1"
    assert routed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 52


def test_streaming_from_the_engine_arrives_in_order(router: RouterProc) -> None:
    """A streamed completion is relayed chunk by chunk, in order, ending with usage and [DONE]."""
    request = {
        "prompt": list(range(2000, 2010)),
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers, chunks = stream_events(router.http, "/v1/completions", request)
    assert [c["choices"][0]["text"] for c in chunks[:4]] == [chr(ord("a") + i) for i in range(4)]
    assert chunks[3]["choices"][0]["finish_reason"] == "length"
    assert chunks[4]["usage"]["prompt_tokens"] == 10
    assert chunks[0]["dp_rank"] == int(headers["x-kvevents-dp-rank"])


def test_chat_conversation_stays_on_the_rank_holding_its_earlier_turns(
    router: RouterProc,
) -> None:
    """Turn 2 of a chat is routed to turn 1's rank, and the engine confirms the predicted reuse."""
    turn1 = [
        {"role": "system", "content": "You answer in one word, always and forever."},
        {"role": "user", "content": "Which animal is the fastest on land?"},
    ]
    first = router.post("/v1/chat/completions", {"messages": turn1, "max_tokens": 3})
    assert first.status_code == 200, first.text
    rank = int(first.headers["x-kvevents-dp-rank"])
    assert first.json()["dp_rank"] == rank
    prompt1 = list(render_chat(turn1).encode())
    assert first.headers["x-kvevents-prompt-tokens"] == str(len(prompt1))
    pages = len(prompt1) // PAGE * PAGE
    wait_until(lambda: matched(router, [*prompt1, 0])[rank] == pages, 10, "turn 1 in the index")
    reply = first.json()["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
    second = router.post("/v1/chat/completions", {"messages": turn2, "max_tokens": 1})
    assert second.headers["x-kvevents-dp-rank"] == str(rank)
    predicted = int(second.headers["x-kvevents-matched-tokens"])
    assert predicted >= pages
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted


def test_chat_streaming_and_bad_messages_through_the_router(router: RouterProc) -> None:
    """A streamed chat is relayed to the end; malformed messages answer 400 naming the field."""
    request = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "stream": True}
    _, chunks = stream_events(router.http, "/v1/chat/completions", request)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}]
    bad = router.post("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]})
    assert bad.status_code == 400
    assert "messages[0].content" in bad.json()["error"]["message"]
    missing = router.post("/v1/chat/completions", {"prompt": "not a chat"})
    assert missing.status_code == 400 and "messages" in missing.json()["error"]["message"]


def test_engine_refuses_conflicting_ranks(engine: tuple[Engine, int]) -> None:
    """The simulated engine answers 400 when the header and the body name different ranks."""
    eng, _ = engine
    response = eng.http.post(
        "/v1/completions",
        json={"prompt": [1, 2], "routed_dp_rank": 0},
        headers={"X-data-parallel-rank": "1"},
    )
    assert response.status_code == 400 and "different ranks" in response.json()["error"]["message"]
    tokens = eng.http.post("/tokenize", json={"prompt": "hé"}).json()
    assert tokens["tokens"] == list("hé".encode()) and tokens["count"] == 3


def test_block_size_mismatch_is_loud_counted_and_skipped(engine: tuple[Engine, int]) -> None:
    """A configured block size the engine does not use is logged naming both sizes, counted, shown, and its events skipped."""
    eng, base = engine
    proc = RouterProc([], *described(eng, base, "--engine-kind", "kvevents", "--block-size", "8"))
    try:
        wait_until(lambda: proc.connected() == 2, 20, "the router to follow both ranks")
        eng.generate(list(range(3000, 3016)), rank=0)

        def mismatched_events() -> int:
            found = proc.http.get("/workers").json()["block_size_mismatches"]
            return sum(m["count"] for m in found if m["source"] == "events" and m["dp_rank"] == 0)

        wait_until(lambda: mismatched_events() >= 1, 10, "the mismatch to be counted")
        workers = proc.http.get("/workers").json()
        rank0 = next(h for h in workers["holders"] if h["dp_rank"] == 0)
        assert rank0["index_entries"] == 0  # skipped, not mis-indexed
        assert rank0["block_size"]["expected"] == 8 and rank0["block_size"]["observed"] == PAGE
        assert {(m["source"], m["observed"]) for m in rank0["block_size"]["mismatches"]} >= {
            ("server_info", PAGE),
            ("events", PAGE),
        }
        metric = (
            f'kvevents_router_block_size_mismatches_total{{dp_rank="0",expected="8",'
            f'observed="{PAGE}",source="events",worker="{eng.url}"}}'
        )
        assert metric in proc.http.get("/metrics").text
    finally:
        proc.stop()
    assert f"engine {eng.url} rank 0 sends BlockStored events with block_size {PAGE}" in proc.stderr
    assert "but 8 is expected (--block-size of engine" in proc.stderr
