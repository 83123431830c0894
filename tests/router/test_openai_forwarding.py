"""/v1/completions through `kvevents router` to fake OpenAI engines described by flags only.

Two fake engines (real HTTP, recording what they receive) are described to a router
subprocess with ``--engine URL --kv-endpoint ... --dp-size 2`` (no /server_info: the fake
has none); their KV events come from real publishers, one per rank on base + rank.
Engine A is a vLLM (rank in the ``X-data-parallel-rank`` header), engine B an SGLang
(``routed_dp_rank`` in the body).
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from openai_support import FakeEngine, RankPublishers
from router_support import RouterProc, wait_until

from kvevents.transport.endpoints import free_port_range

pytestmark = pytest.mark.slow  # every test talks to a router subprocess

BS = 4


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _publishers(ctx: zmq.Context) -> RankPublishers:
    base = free_port_range(4)
    return RankPublishers(ctx, 2, base, base + 2, topic="kv")


@pytest.fixture(scope="module")
def plane(ctx: zmq.Context) -> Iterator[dict]:
    """Engines A (vllm) and B (sglang), dp 2 each, with their publishers."""
    a, b = FakeEngine(), FakeEngine()
    pubs_a, pubs_b = _publishers(ctx), _publishers(ctx)
    try:
        yield {"a": a, "b": b, "pubs_a": pubs_a, "pubs_b": pubs_b}
    finally:
        for thing in (pubs_a, pubs_b, a, b):
            thing.close()


def described(engine: FakeEngine, pubs: RankPublishers, *extra: str) -> list[str]:
    return [
        "--engine", engine.url, "--kv-endpoint", pubs.live, "--replay-endpoint", pubs.replay,
        "--dp-size", "2", "--topic", "kv", "--block-size", str(BS), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def router(plane: dict) -> Iterator[RouterProc]:
    argv = described(plane["a"], plane["pubs_a"])
    argv += described(plane["b"], plane["pubs_b"], "--engine-kind", "sglang")
    proc = RouterProc([], *argv, "--load-interval", "0.2")
    try:
        wait_until(lambda: proc.connected() == 4, 20, "the router to follow all four ranks")
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def router_for_a(plane: dict, *options: str) -> Iterator[RouterProc]:
    """A router of its own in front of engine A alone, with ``options``, following both ranks."""
    proc = RouterProc([], *described(plane["a"], plane["pubs_a"]), *options)
    try:
        wait_until(lambda: proc.connected() == 2, 20, "the router to follow both ranks")
        yield proc
    finally:
        proc.stop()


def matched(router: RouterProc, worker: str, rank: int, tokens: list[int]) -> int:
    body = router.post("/query", {"input_ids": tokens}).json()
    return next(
        m["matched_tokens"]
        for m in body["matches"]
        if m["worker"] == worker and m["dp_rank"] == rank
    )


def held(
    router: RouterProc, pubs: RankPublishers, worker: str, rank: int, tokens: list[int]
) -> None:
    """Publish ``tokens`` from ``rank`` and wait until the router has indexed them (asked
    with one token more, so that every whole block of them is one an engine reuses)."""
    pubs.store(rank, tokens, BS)
    wait_until(
        lambda: matched(router, worker, rank, [*tokens, 0]) == len(tokens) // BS * BS,
        10,
        f"{worker} rank {rank} to hold the prefix in the router",
    )


def test_vllm_engine_gets_the_rank_header_and_the_body_unchanged(
    plane: dict, router: RouterProc
) -> None:
    """A token-id prompt goes to the vLLM rank holding its prefix: header set, body bytes as sent, the client's Authorization not forwarded."""
    a = plane["a"]
    prefix = list(range(100, 116))
    held(router, plane["pubs_a"], a.url, 1, prefix)
    raw = json.dumps({"model": "tiny", "prompt": [*prefix, 7, 8], "max_tokens": 1}).encode()
    response = router.http.post(
        "/v1/completions",
        content=raw,
        headers=[
            ("content-type", "application/json"),
            ("authorization", "Bearer sk-test"),
            ("X-data-parallel-rank", "0"),  # the client's own is replaced
            ("connection", "keep-alive, x-hop"),  # x-hop is for this connection only
            ("x-hop", "1"),
            ("proxy-connection", "keep-alive"),
            ("x-end-to-end", "kept"),
            ("x-forwarded-for", "10.0.0.1"),  # sent twice: both go on, as one line
            ("x-forwarded-for", "10.0.0.2"),
            ("cookie", "a=1"),  # as HTTP/2 clients split them: one Cookie line again
            ("cookie", "b=2"),
        ],
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-kvevents-worker"] == a.url
    assert response.headers["x-kvevents-dp-rank"] == "1"
    assert response.headers["x-kvevents-matched-tokens"] == "16"
    assert response.headers["x-kvevents-prompt-tokens"] == "18"
    assert response.headers["x-kvevents-policy"] == "kv-aware"
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 7
    headers, body = a.received[-1]
    assert headers["x-data-parallel-rank"] == "1"
    assert "authorization" not in headers  # the client's key is for the router, never the engine's
    assert "x-hop" not in headers and "proxy-connection" not in headers
    assert headers["x-end-to-end"] == "kept"
    assert headers["x-forwarded-for"] == "10.0.0.1, 10.0.0.2"
    assert headers["cookie"] == "a=1; b=2"
    assert body == raw


def test_sglang_engine_gets_routed_dp_rank_in_the_body(plane: dict, router: RouterProc) -> None:
    """For an SGLang engine the rank travels as routed_dp_rank in the JSON body, with no rank header."""
    b = plane["b"]
    prefix = list(range(200, 212))
    held(router, plane["pubs_b"], b.url, 0, prefix)
    sent = {"prompt": [prefix], "max_tokens": 1, "data_parallel_rank": 1}  # a batch of one
    response = router.post("/v1/completions", sent)
    assert response.status_code == 200, response.text
    assert (response.headers["x-kvevents-worker"], response.headers["x-kvevents-dp-rank"]) == (
        b.url,
        "0",
    )
    headers, body = b.received[-1]
    assert "x-data-parallel-rank" not in headers
    assert json.loads(body) == {"prompt": [prefix], "max_tokens": 1, "routed_dp_rank": 0}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": [[300, 301, 302, 303, 304]], "max_tokens": 1}  \n',  # no rank key: appended
        b'{"prompt": [[300, 301, 302, 303, 304]], "max_tokens": 1, "routed_dp_rank": 1}',
        b'{"prompt": [[300, 301, 302, 303, 304]], "max_tokens": 1, "data\\u005fparallel_rank": 1}',
    ],
)
def test_sglang_body_gets_exactly_one_rank_however_the_client_spelled_its_own(
    plane: dict, router: RouterProc, raw: bytes
) -> None:
    """The SGLang body the engine receives is the client's, with the router's rank as the
    one rank key: a client's rank key is dropped even when written with a JSON escape."""
    b = plane["b"]
    prefix = [300, 301, 302, 303]
    held(router, plane["pubs_b"], b.url, 0, prefix)
    response = router.http.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-kvevents-dp-rank"] == "0"
    _, body = b.received[-1]
    assert json.loads(body) == {"prompt": [[*prefix, 304]], "max_tokens": 1, "routed_dp_rank": 0}


@pytest.mark.parametrize("stream", [True, "true", 1], ids=["true", "string", "one"])
def test_streaming_relays_each_chunk_as_it_arrives(
    plane: dict, router: RouterProc, stream: object
) -> None:
    """A streamed answer's first chunk reaches the client while the engine still holds
    the rest; all arrive in order. ``stream`` is read as the engines read it: ``"true"``
    and ``1`` ask for a stream too."""
    a = plane["a"]
    prefix = list(range(300, 308))
    held(router, plane["pubs_a"], a.url, 0, prefix)
    request = {"prompt": [*prefix, 0], "stream": stream, "max_tokens": 5}
    with router.http.stream("POST", "/v1/completions", json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-kvevents-dp-rank"] == "0"
        chunks = response.iter_raw()
        first = b""
        while b"\n\n" not in first:  # bounded by the client's 30 s read timeout
            first += next(chunks)
        assert first == b'data: {"i": 0}\n\n'  # the engine is still waiting for release()
        a.release()
        rest = b"".join(chunks)
    events = [e for e in (first + rest).split(b"\n\n") if e]
    assert events == [*(f'data: {{"i": {i}}}'.encode() for i in range(5)), b"data: [DONE]"]


def test_bad_requests_answer_400_in_openai_shape(router: RouterProc) -> None:
    """A bad prompt in a batch, a missing prompt, or a non-JSON body answers 400 with an OpenAI error saying why."""
    batch = router.post("/v1/completions", {"prompt": [[1, 2], []]})
    assert batch.status_code == 400
    assert "prompt[1] must be" in batch.json()["error"]["message"]
    assert batch.json()["error"]["type"] == "invalid_request_error"
    assert batch.json()["error"]["param"] is None
    assert (
        "no 'prompt'" in router.post("/v1/completions", {"model": "m"}).json()["error"]["message"]
    )
    bad = router.http.post(
        "/v1/completions", content=b"{", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
    assert router.post("/v1/completions", {"prompt": [1, -2]}).status_code == 400


def test_engine_errors_are_relayed_with_the_decision(plane: dict, router: RouterProc) -> None:
    """An engine's error status and body come back unchanged, with the decision headers, and are counted by status."""
    response = router.post("/v1/completions", {"prompt": list(range(400, 408)), "fail_status": 422})
    assert response.status_code == 422
    assert response.json() == {"error": {"message": "asked to fail", "code": 422}}
    assert response.headers["x-kvevents-worker"] in (plane["a"].url, plane["b"].url)
    line = next(x for x in router.http.get("/metrics").text.splitlines() if 'status="422"' in x)
    assert line.startswith("kvevents_router_requests_total{") and line.endswith(" 1.0")
    for prompt in (list(range(400, 408)), "w1 w2 w3"):  # relayed inline, and through ASGI
        busy = router.post(
            "/v1/completions", {"prompt": prompt, "fail_status": 503, "retry_after": 7}
        )
        assert busy.status_code == 503 and busy.headers["retry-after"] == "7"


def test_metrics_count_routed_requests_and_matched_tokens(plane: dict, router: RouterProc) -> None:
    """/metrics counts forwarded requests by worker, rank, policy and status, and the matched and engine-cached tokens."""
    a = plane["a"]
    prefix = list(range(500, 508))
    held(router, plane["pubs_a"], a.url, 1, prefix)
    assert router.post("/v1/completions", {"prompt": prefix}).status_code == 200
    text = router.http.get("/metrics").text
    line = (
        'kvevents_router_requests_total{dp_rank="1",endpoint="completions",policy="kv-aware",'
        f'status="200",worker="{a.url}"}}'
    )
    assert line in text
    assert 'kvevents_router_matched_tokens_bucket{endpoint="completions",le="16"}' in text
    cached = f'kvevents_router_engine_cached_tokens_total{{dp_rank="1",worker="{a.url}"}}'
    assert any(x.startswith(cached) and float(x.split()[-1]) >= 7 for x in text.splitlines())


def test_vllm_load_comes_from_its_metrics(plane: dict, router: RouterProc) -> None:
    """A vLLM's /metrics gauges are each rank's load: requests other clients sent weigh on
    the route; an SGLang engine keeps only the router's own count."""
    a = plane["a"]

    def holder(worker: str, rank: int) -> dict:
        found = router.http.get("/workers").json()["holders"]
        return next(h for h in found if h["worker"] == worker and h["dp_rank"] == rank)

    def engine(worker: str) -> dict:
        found = router.http.get("/workers").json()["engines"]
        return next(e for e in found if e["worker"] == worker)

    a.running[0], a.waiting[0] = 3, 2
    try:
        wait_until(
            lambda: holder(a.url, 0)["load"]["engine_requests"] == 5, 10, "the gauges polled"
        )
        assert engine(a.url)["load_source"] == "/metrics"
        assert engine(plane["b"].url)["load_source"] == "router"
        assert holder(a.url, 1)["load"]["engine_requests"] == 0
        route = router.post("/route", {"input_ids": list(range(5000, 5016))}).json()
        scores = {(s["worker"], s["dp_rank"]): s for s in route["scores"]}
        assert scores[(a.url, 0)]["pending_blocks"] == 5 * 8.0  # foreign_request_blocks each
        assert (route["worker"], route["dp_rank"]) != (a.url, 0)  # the busy rank loses the tie
        a.metrics_status = 500  # metrics break while rank 0 is busy: no phantom load stays
        wait_until(
            lambda: holder(a.url, 0)["load"]["engine_requests"] == 0, 10, "the load to clear"
        )
        broken = engine(a.url)
        assert broken["load_source"] == "router" and "500" in broken["metrics_error"]
        assert broken["load_error"] is None  # /health still answers: the ranks stay available
    finally:
        a.running[0], a.waiting[0], a.metrics_status = 0, 0, 200
    wait_until(lambda: engine(a.url)["load_source"] == "/metrics", 10, "metrics read again")


def test_a_vllm_is_found_from_its_url_alone_through_kv_event_sources(plane: dict) -> None:
    """--engine URL --engine-kind vllm, no endpoints given: the router reads vLLM's
    /kv_event_sources, follows every rank, and routes to the one holding the prefix."""
    a, pubs = plane["a"], plane["pubs_a"]
    live, replay = (int(e.rsplit(":", 1)[1]) for e in (pubs.live, pubs.replay))
    a.kv_sources = {
        str(r): {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{live + r}",
            "replay_endpoint": f"tcp://*:{replay + r}",
            "topic": "kv",
        }
        for r in range(2)
    }
    proc = RouterProc([], "--engine", a.url, "--engine-kind", "vllm", "--block-size", str(BS))
    try:
        wait_until(lambda: proc.connected() == 2, 20, "the router to follow both ranks")
        streams = sorted(proc.http.get("/workers").json()["streams"], key=lambda s: s["dp_rank"])
        assert [s["endpoint"] for s in streams] == [f"tcp://127.0.0.1:{live + r}" for r in (0, 1)]
        held(proc, pubs, a.url, 1, list(range(1100, 1108)))
        response = proc.post("/v1/completions", {"prompt": list(range(1100, 1110))})
        assert response.status_code == 200, response.text
        assert response.headers["x-kvevents-dp-rank"] == "1"
        assert a.received[-1][0]["x-data-parallel-rank"] == "1"  # a vLLM: the rank header
    finally:
        proc.stop()
        a.kv_sources = None


def test_a_vllm_known_by_url_that_changes_its_block_size_is_followed(ctx: zmq.Context) -> None:
    """No --block-size: the router keys at 16, the size the vLLM's events and its
    /metrics (vllm:cache_config_info) state; then every rank states 32 and chains its
    blocks at 32 (the vLLM came back with another block size): the router keys at 32 and
    a prompt stored at 32 matches. Before, a vLLM known by URL declared no size, so every
    event at 32 was skipped as a mismatch until the router restarted."""
    engine, pubs = FakeEngine(), _publishers(ctx)
    live, replay = (int(e.rsplit(":", 1)[1]) for e in (pubs.live, pubs.replay))
    engine.kv_sources = {
        str(r): {"publisher": "zmq", "endpoint": f"tcp://*:{live + r}",
                 "replay_endpoint": f"tcp://*:{replay + r}", "topic": "kv"}
        for r in range(2)
    }  # fmt: skip
    engine.block_sizes = {0: 16, 1: 16}
    proc = RouterProc([], "--engine", engine.url, "--engine-kind", "vllm", "--load-interval", "0.2")

    def state() -> tuple[int, int]:
        answer = proc.post("/query", {"input_ids": list(range(2000, 2065))}).json()
        if "error" in answer:  # no block size known yet
            return 0, 0
        held = {m["dp_rank"]: m["matched_tokens"] for m in answer["matches"]}
        return answer["block_size"], held.get(1, 0)

    try:
        wait_until(lambda: proc.connected() == 2, 20, "the router to follow both ranks")
        pubs.store(1, list(range(2000, 2064)), 16)
        wait_until(lambda: state() == (16, 64), 20, "the prompt at 16 tokens a block")
        engine.block_sizes = {0: 32, 1: 32}
        wait_until(lambda: state()[0] == 32, 20, "the router at 32 tokens a block")
        pubs.store(1, list(range(2000, 2064)), 32)
        wait_until(lambda: state() == (32, 64), 20, "the prompt at 32 tokens a block")
        holders = proc.http.get("/workers").json()["holders"]
        assert all(h["block_size"]["expected"] == 32 for h in holders)
    finally:
        proc.stop()
        pubs.close()
        engine.close()


def test_tokenize_endpoint_tokenizes_text_prompts(plane: dict) -> None:
    """With --tokenize-endpoint, a text prompt is tokenized by the engine's /tokenize and routed by those ids."""
    a = plane["a"]
    with router_for_a(plane, "--tokenize-endpoint", f"{a.url}/tokenize") as proc:
        held(proc, plane["pubs_a"], a.url, 1, list(range(600, 608)))
        text = " ".join(f"w{i}" for i in range(600, 610))
        response = proc.post("/v1/completions", {"model": "tiny", "prompt": text})
        assert response.status_code == 200, response.text
        assert response.headers["x-kvevents-dp-rank"] == "1"
        assert response.headers["x-kvevents-matched-tokens"] == "8"
        assert a.tokenized[-1] == {"prompt": text, "add_special_tokens": True, "model": "tiny"}
        assert json.loads(a.received[-1][1])["prompt"] == text  # the text itself is forwarded


def test_a_wrong_tokenize_endpoint_is_the_routers_fault_not_the_clients(plane: dict) -> None:
    """A --tokenize-endpoint answering 404 (a wrong path) makes text prompts 502, not 4xx."""
    a = plane["a"]
    with router_for_a(plane, "--tokenize-endpoint", f"{a.url}/no-such-path") as proc:
        response = proc.post("/v1/completions", {"prompt": "w1 w2"})
        assert response.status_code == 502
        assert response.json()["error"]["type"] == "tokenizer_error"
        assert "404" in response.json()["error"]["message"]


def test_chat_is_rendered_by_the_engine_and_sent_to_the_rank_holding_it(plane: dict) -> None:
    """With --tokenize-endpoint, a chat's messages go to the engine's /tokenize with every
    template field, and the body goes unchanged to /v1/chat/completions of the holding rank."""
    a = plane["a"]
    with router_for_a(plane, "--tokenize-endpoint", f"{a.url}/tokenize") as proc:
        held(proc, plane["pubs_a"], a.url, 1, list(range(900, 908)))
        messages = [
            {"role": "system", "content": "w900 w901 w902 w903"},
            {"role": "user", "content": "w904 w905 w906 w907 w908"},
        ]
        chat = {
            "model": "tiny",
            "messages": messages,
            "chat_template_kwargs": {"enable_thinking": False},
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "max_completion_tokens": 1,
        }
        raw = json.dumps(chat).encode()
        response = proc.http.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code == 200, response.text
        assert response.json()["object"] == "chat.completion"
        assert response.headers["x-kvevents-dp-rank"] == "1"
        assert response.headers["x-kvevents-matched-tokens"] == "8"
        assert response.headers["x-kvevents-prompt-tokens"] == "10"  # 9 words + generation prompt
        assert a.tokenized[-1] == {
            "messages": messages,
            "model": "tiny",
            "chat_template_kwargs": {"enable_thinking": False},
            "tools": chat["tools"],
        }
        headers, body = a.received[-1]
        assert headers["x-data-parallel-rank"] == "1"
        assert body == raw  # forwarded as sent, to the chat path
        open_ended = proc.post(
            "/v1/chat/completions",
            {"messages": messages, "add_generation_prompt": False, "continue_final_message": True},
        )
        assert open_ended.headers["x-kvevents-prompt-tokens"] == "9"
        assert a.tokenized[-1]["continue_final_message"] is True
        refused = proc.post(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "refuse"}]}
        )
        assert refused.status_code == 400  # the engine's verdict on the client's input
        assert "cannot render this conversation" in refused.json()["error"]["message"]
        metrics = proc.http.get("/metrics").text
        bucket = 'kvevents_router_matched_tokens_bucket{endpoint="chat",le="16"} '
        assert any(x.startswith(bucket) and float(x.split()[-1]) == 2 for x in metrics.splitlines())


def test_tokenizer_file_encodes_like_the_engine(plane: dict, tmp_path: Path) -> None:
    """With --tokenizer, text is encoded by the model's tokenizer.json, BOS included unless add_special_tokens is false."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 1000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    a = plane["a"]
    with router_for_a(plane, "--tokenizer", str(tmp_path)) as proc:
        held(proc, plane["pubs_a"], a.url, 0, [1, 700, 701, 702, 703, 704, 705, 706])
        text = " ".join(f"w{i}" for i in range(700, 710))
        with_bos = proc.post("/v1/completions", {"prompt": text})
        assert with_bos.headers["x-kvevents-dp-rank"] == "0"
        assert with_bos.headers["x-kvevents-matched-tokens"] == "8"
        assert with_bos.headers["x-kvevents-prompt-tokens"] == "11"
        plain = proc.post("/v1/completions", {"prompt": text, "add_special_tokens": False})
        assert plain.headers["x-kvevents-prompt-tokens"] == "10"
        assert plain.headers["x-kvevents-matched-tokens"] == "0"
        assert proc.http.get("/workers").json()["tokenizer"] == str(tmp_path / "tokenizer.json")
        chat = proc.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "w7"}]})
        assert chat.status_code == 501  # a tokenizer.json has no chat template to apply
        assert "--tokenize-endpoint" in chat.json()["error"]["message"]


def test_round_robin_policy_takes_turns_and_says_so(plane: dict) -> None:
    """--policy round-robin sends successive requests to each rank in turn, whatever they cache, and labels them."""
    a = plane["a"]
    with router_for_a(plane, "--policy", "round-robin") as proc:
        held(proc, plane["pubs_a"], a.url, 1, list(range(800, 808)))
        ranks = [
            proc.post("/v1/completions", {"prompt": list(range(800, 808))}).headers
            for _ in range(4)
        ]
        assert [h["x-kvevents-dp-rank"] for h in ranks] == ["0", "1", "0", "1"]
        assert {h["x-kvevents-policy"] for h in ranks} == {"round-robin"}
        assert 'policy="round-robin"' in proc.http.get("/metrics").text


def test_unreachable_engine_answers_503_until_it_is_healthy() -> None:
    """A described engine whose /health does not answer has no available rank: 503 in OpenAI shape."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = RouterProc(
        [],
        "--engine", f"http://127.0.0.1:{port}", "--kv-endpoint", f"tcp://127.0.0.1:{port}",
        "--block-size", "4", "--load-interval", "0.2",
    )  # fmt: skip
    try:
        wait_until(
            lambda: proc.http.get("/workers").json()["engines"][0]["load_error"] is not None,
            10,
            "the health poll to fail",
        )
        response = proc.post("/v1/completions", {"prompt": [1, 2, 3, 4]})
        assert response.status_code == 503
        assert "no available holder" in response.json()["error"]["message"]
    finally:
        proc.stop()
    # A vLLM engine (the default kind when described) and no tokenizer given: said at start.
    assert f"engine http://127.0.0.1:{port} is a vllm engine" in proc.stderr
    assert f"Give --tokenize-endpoint http://127.0.0.1:{port}/tokenize" in proc.stderr


def test_an_engine_error_withdraws_the_requests_prediction(plane: dict) -> None:
    """A completion the engine refuses leaves no prediction behind; an answered one does."""
    with router_for_a(plane, "--prediction-ttl", "600") as router:
        prompt = list(range(20_000, 20_016))  # tokens no other test stores
        failed = router.post("/v1/completions", {"prompt": prompt, "fail_status": 500})
        assert failed.status_code == 500
        query = router.post("/query", {"input_ids": [*prompt, 0]}).json()
        assert all("predicted_blocks" not in m for m in query["matches"])
        metrics = router.http.get("/metrics").text
        assert 'kvevents_router_predicted_entries_total{fate="withdrawn"} 4.0' in metrics
        answered = router.post("/v1/completions", {"prompt": prompt})
        assert answered.status_code == 200
        rank = int(answered.headers["x-kvevents-dp-rank"])
        query = router.post("/query", {"input_ids": [*prompt, 0]}).json()
        assert {m["dp_rank"]: m.get("predicted_blocks", 0) for m in query["matches"]}[rank] == 4


def _inflight(router: RouterProc) -> int:
    holders = router.http.get("/workers").json()["holders"]
    return sum(h["load"]["inflight_requests"] for h in holders)


def test_a_client_leaving_a_stream_ends_the_request_on_the_router(ctx: zmq.Context) -> None:
    """A client that closes its connection mid-stream ends the relay: the request stops
    counting as in flight while the engine still holds the rest of its answer."""
    engine, pubs = FakeEngine(), _publishers(ctx)
    try:
        proc = RouterProc([], *described(engine, pubs), "--load-interval", "0.2")
        try:
            wait_until(lambda: proc.connected() == 2, 20, "the router to follow both ranks")
            prefix = list(range(500, 508))
            held(proc, pubs, engine.url, 0, prefix)
            request = {"prompt": prefix, "stream": True, "max_tokens": 5}
            with proc.http.stream("POST", "/v1/completions", json=request) as response:
                assert response.status_code == 200
                chunks = response.iter_raw()
                first = b""
                while b"\n\n" not in first:  # bounded by the client's 30 s read timeout
                    first += next(chunks)
                assert first == b'data: {"i": 0}\n\n'  # the engine holds the rest
                assert _inflight(proc) == 1
            wait_until(lambda: _inflight(proc) == 0, 10, "the router to end the left request")
        finally:
            proc.stop()
    finally:
        engine.release()
        pubs.close()
        engine.close()
