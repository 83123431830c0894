"""`kvevents engine --disaggregation-mode prefill|decode`: both hand-off protocols between a
real prefill and a real decode engine, over HTTP, with the decode's KV events checked."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import zmq
from engine_support import Engine, RankStreams, published_counts, stream_events

from kvevents import BlockStored
from process_support import run_kvevents

pytestmark = pytest.mark.slow

PAGE = 4
TIMEOUT = 3.0  # --disaggregation-timeout of both engines: a room that never comes, quickly
KV_CONFIG = {"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}
COMMON = ["--dp-size", "2", "--page-size", str(PAGE), "--disaggregation-timeout", str(TIMEOUT)]


@pytest.fixture(scope="module")
def prefill() -> Iterator[Engine]:
    eng = Engine(
        [*COMMON, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"],
        KV_CONFIG,
    )
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def decode() -> Iterator[Engine]:
    eng = Engine([*COMMON, "--disaggregation-mode", "decode"], KV_CONFIG)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def bootstrap(prefill: Engine) -> dict[str, Any]:
    """The SGLang fields naming the prefill's bootstrap server."""
    port = prefill.server_info()["disaggregation_bootstrap_port"]
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}


def prompt(length: int = 10) -> list[int]:
    """Token ids no other test uses (so caches never mix tests)."""
    return [random.randrange(1, 50_000) for _ in range(length)]


def room() -> int:
    return random.getrandbits(63)


def post(url: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=TIMEOUT + 20) as client:
        return client.post(path, json=body, headers=headers)


def both(first: Callable[[], httpx.Response], second: Callable[[], httpx.Response]) -> Any:
    """Run two legs at the same time; their responses in order."""
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(first), pool.submit(second)
        return a.result(timeout=60), b.result(timeout=60)


def hashes_added(engine: Engine, rank: int, before: set[int]) -> set[int]:
    return engine.kv_blocks(rank) - before


# --- discovery ---------------------------------------------------------------------------


def test_server_info_tells_the_role_and_the_bound_bootstrap_port(
    prefill: Engine, decode: Engine
) -> None:
    """/server_info has disaggregation_mode and, on a prefill only, the bootstrap port it
    bound; a decode says it prefills a request sent alone itself."""
    info = prefill.server_info()
    port = info["disaggregation_bootstrap_port"]
    assert info["disaggregation_mode"] == "prefill" and isinstance(port, int) and port > 0
    health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
    assert health["disaggregation_mode"] == "prefill"
    info = decode.server_info()
    assert (info["disaggregation_mode"], info["disaggregation_bootstrap_port"]) == ("decode", None)
    assert info["disaggregation_decode_local_prefill"] is True  # it prefills one sent alone
    assert "disaggregation_decode_local_prefill" not in prefill.server_info()


def test_openapi_describes_the_new_fields(decode: Engine) -> None:
    """The engine's OpenAPI document shows the P/D request fields and /server_info members."""
    schemas = decode.http.get("/openapi.json").json()["components"]["schemas"]
    assert "disaggregation_bootstrap_port" in schemas["ServerInfoAnswer"]["properties"]
    assert "disaggregation_decode_local_prefill" in schemas["ServerInfoAnswer"]["properties"]
    assert "bootstrap_room" in schemas["GenerateRequest"]["properties"]
    assert "kv_transfer_params" in schemas["CompletionRequest"]["properties"]


def test_a_default_engine_is_unchanged_and_ignores_pd_fields() -> None:
    """An engine without --disaggregation-mode reports null, binds no bootstrap port and serves
    a request carrying P/D fields locally, generating every token asked."""
    eng = Engine(["--page-size", str(PAGE)], None)
    try:
        info = eng.server_info()
        assert (info["disaggregation_mode"], info["disaggregation_bootstrap_port"]) == (
            "null",
            None,
        )
        body = {"input_ids": prompt(), "max_new_tokens": 3, "bootstrap_room": room()}
        body |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1}
        answer = eng.http.post("/generate", json=body).json()
        assert (answer["completion_tokens"], answer["cached_tokens"]) == (3, 0)
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1}
        response = eng.http.post(
            "/v1/completions",
            json={"prompt": "hello", "max_tokens": 2, "kv_transfer_params": params},
        )
        assert response.status_code == 200 and "kv_transfer_params" not in response.json()
    finally:
        eng.stop()


# --- SGLang's protocol -------------------------------------------------------------------


def test_sglang_generate_legs_at_once_decode_stores_and_publishes_the_blocks(
    prefill: Engine, decode: Engine, bootstrap: dict[str, Any]
) -> None:
    """Both /generate legs sent at once with one room: the prefill runs on its pinned rank and
    generates one token, the decode answers on its own pinned rank with the prompt's full
    blocks as cached tokens, holds the same blocks as the prefill, and publishes them."""
    tokens = prompt(10)
    fields = {"input_ids": tokens, "bootstrap_room": room(), **bootstrap}
    prefill_before, decode_before = prefill.kv_blocks(1), decode.kv_blocks(0)
    ctx = zmq.Context()
    streams = RankStreams(ctx, decode.server_info()["kv_events"], decode.url)
    try:
        p, d = both(
            lambda: post(
                prefill.url, "/generate", {**fields, "max_new_tokens": 5, "routed_dp_rank": 1}
            ),
            lambda: post(
                decode.url,
                "/generate",
                {**fields, "max_new_tokens": 5, "routed_dp_rank": 0, "disagg_prefill_dp_rank": 1},
            ),
        )
        assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
        assert (p.json()["dp_rank"], p.json()["completion_tokens"]) == (1, 1)
        answer = d.json()
        assert (answer["dp_rank"], answer["completion_tokens"]) == (0, 5)
        assert answer["cached_tokens"] == answer["meta_info"]["cached_tokens"] == 8
        sent = hashes_added(prefill, 1, prefill_before)
        received = hashes_added(decode, 0, decode_before)
        assert len(received) == 2 and received == sent
        streams.collect(published_counts(decode))
        stored = [
            e
            for b in streams.batches[0].values()
            for e in b.events
            if isinstance(e, BlockStored) and set(e.block_hashes) & received
        ]
        assert len(stored) == 1 and stored[0].token_ids == tokens[:8]
        assert received <= streams.held(0)
    finally:
        streams.close()
        ctx.term()


def test_sglang_completions_batch_decode_first(
    prefill: Engine, decode: Engine, bootstrap: dict[str, Any]
) -> None:
    """A batch on /v1/completions with one room per prompt: the decode leg may come first,
    waits for the prefill, and reports each prompt's received blocks as cached."""
    prompts, first = [prompt(9), prompt(13)], room()
    body = {"prompt": prompts, "max_tokens": 2, "bootstrap_room": [first, first + 1], **bootstrap}

    def late_prefill() -> httpx.Response:
        time.sleep(0.5)
        return post(prefill.url, "/v1/completions", body)

    d, p = both(lambda: post(decode.url, "/v1/completions", body), late_prefill)
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    answer = d.json()
    assert [len(c["text"]) for c in answer["choices"]] == [2, 2]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 + 12
    assert answer["usage"]["prompt_tokens"] == 22


def test_sglang_n_rooms_are_all_taken(
    prefill: Engine, decode: Engine, bootstrap: dict[str, Any]
) -> None:
    """With sampling_params.n=2 an int room stands for rooms r and r+1: the prefill registers
    both, the decode takes both, so a third leg naming r+1 finds it taken."""
    r = room() // 2
    body = {"input_ids": prompt(), "sampling_params": {"n": 2, "max_new_tokens": 2}}
    body |= {"bootstrap_room": r, **bootstrap}
    p, d = both(
        lambda: post(prefill.url, "/generate", body), lambda: post(decode.url, "/generate", body)
    )
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    again = post(decode.url, "/generate", {**body, "bootstrap_room": r + 1, "sampling_params": {}})
    assert again.status_code == 409 and f"room {r + 1}" in again.json()["error"]
    wrong = post(decode.url, "/generate", {**body, "bootstrap_room": [r]})
    assert wrong.status_code == 400 and "one room per item" in wrong.json()["error"]


def test_a_room_that_never_comes_is_504_after_the_wait(
    decode: Engine, bootstrap: dict[str, Any]
) -> None:
    """A decode leg whose prefill never comes answers 504 naming the room and the wait."""
    r = room()
    body = {"input_ids": prompt(), "bootstrap_room": r, **bootstrap}
    response = post(decode.url, "/generate", body)
    assert response.status_code == 504
    assert f"room {r}" in response.json()["error"] and f"{TIMEOUT:g} s" in response.json()["error"]


def test_an_unfetched_registration_expires(
    prefill: Engine, decode: Engine, bootstrap: dict[str, Any]
) -> None:
    """A prefilled room nobody takes expires after the timeout: a late decode gets 504 'expired'."""
    body = {"input_ids": prompt(), "bootstrap_room": room(), **bootstrap}
    assert post(prefill.url, "/generate", body).status_code == 200
    time.sleep(TIMEOUT + 0.5)
    late = post(decode.url, "/generate", body)
    assert late.status_code == 504 and "expired" in late.json()["error"]


def test_a_room_registered_twice_is_409(prefill: Engine, bootstrap: dict[str, Any]) -> None:
    """A second prefill with a room already registered answers 409 naming the room."""
    r = room()
    body = {"input_ids": prompt(), "bootstrap_room": r, **bootstrap}
    assert post(prefill.url, "/generate", body).status_code == 200
    again = post(prefill.url, "/v1/completions", {"prompt": "x", "bootstrap_room": r})
    assert again.status_code == 409
    assert f"room {r}" in again.json()["error"]["message"]


def test_a_room_taken_twice_is_409(
    prefill: Engine, decode: Engine, bootstrap: dict[str, Any]
) -> None:
    """A second decode leg with a room another decode took answers 409."""
    body = {"input_ids": prompt(), "bootstrap_room": room(), **bootstrap}
    p, d = both(
        lambda: post(prefill.url, "/generate", body), lambda: post(decode.url, "/generate", body)
    )
    assert p.status_code == 200 and d.status_code == 200
    again = post(decode.url, "/generate", body)
    assert again.status_code == 409 and "already taken" in again.json()["error"]


def test_a_wrong_disagg_prefill_dp_rank_is_400(
    prefill: Engine, decode: Engine, bootstrap: dict[str, Any]
) -> None:
    """A decode leg naming another prefill rank than the one the prefill ran on answers 400 naming both."""
    body = {"input_ids": prompt(), "bootstrap_room": room(), **bootstrap}
    p, d = both(
        lambda: post(prefill.url, "/generate", {**body, "routed_dp_rank": 0}),
        lambda: post(decode.url, "/generate", {**body, "disagg_prefill_dp_rank": 1}),
    )
    assert p.status_code == 200 and d.status_code == 400, (p.text, d.text)
    assert "disagg_prefill_dp_rank=1" in d.json()["error"] and "dp_rank 0" in d.json()["error"]


def test_legs_of_different_prompts_are_400(
    prefill: Engine, decode: Engine, bootstrap: dict[str, Any]
) -> None:
    """A decode leg whose prompt is not the one its room was prefilled for answers 400."""
    r = room()
    fields = {"bootstrap_room": r, **bootstrap}
    p, d = both(
        lambda: post(prefill.url, "/generate", {"input_ids": prompt(), **fields}),
        lambda: post(decode.url, "/generate", {"input_ids": prompt(), **fields}),
    )
    assert p.status_code == 200 and d.status_code == 400
    assert "another prompt" in d.json()["error"]


def test_bad_sglang_fields_are_400_or_502(decode: Engine) -> None:
    """A decode leg without a bootstrap server answers 400, one naming a closed port 502."""
    missing = post(decode.url, "/generate", {"input_ids": [1, 2], "bootstrap_room": room()})
    assert missing.status_code == 400 and "bootstrap_host" in missing.json()["error"]
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    body = {"input_ids": [1, 2], "bootstrap_room": room()}
    body |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
    unreachable = post(decode.url, "/generate", body)
    assert unreachable.status_code == 502
    assert f"127.0.0.1:{port}" in unreachable.json()["error"]


def test_requests_without_pd_fields_are_served_locally(prefill: Engine, decode: Engine) -> None:
    """Both roles serve a request without P/D fields as any engine does: every token, locally."""
    for engine in (prefill, decode):
        tokens = prompt()
        first = engine.generate(tokens, rank=1, max_new_tokens=4)
        again = engine.generate(tokens, rank=1, max_new_tokens=4)
        assert (first["completion_tokens"], first["cached_tokens"]) == (4, 0)
        assert again["cached_tokens"] == 8


# --- vLLM's protocol ---------------------------------------------------------------------

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.mark.parametrize("chat", [False, True])
def test_vllm_legs_in_sequence(prefill: Engine, decode: Engine, chat: bool) -> None:
    """The prefill leg answers kv_transfer_params naming its bootstrap server and request id;
    the decode leg with them decodes on its pinned rank with the blocks as cached tokens."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    text = f"a prompt of some length {random.random()}"
    client: dict[str, Any] = (
        {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    )
    first = {**client, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    p = post(prefill.url, path, first, **{"X-data-parallel-rank": "1"})
    assert p.status_code == 200, p.text
    params = p.json()["kv_transfer_params"]
    assert p.json()["dp_rank"] == 1
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    port = prefill.server_info()["disaggregation_bootstrap_port"]
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", port)
    prompt_tokens = p.json()["usage"]["prompt_tokens"]
    assert len(params["remote_block_ids"]) == prompt_tokens // PAGE
    assert params["remote_engine_id"] and params["remote_request_id"]
    second = {**client, "max_tokens": 3, "kv_transfer_params": params}
    d = post(decode.url, path, second, **{"X-data-parallel-rank": "0"})
    assert d.status_code == 200, d.text
    answer = d.json()
    assert answer["dp_rank"] == 0 and answer["usage"]["completion_tokens"] == 3
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt_tokens - 1) // PAGE * PAGE
    again = post(decode.url, path, second)
    assert again.status_code == 409


def test_vllm_decode_leg_streams(prefill: Engine, decode: Engine) -> None:
    """A streamed decode leg streams its tokens and counts the received blocks in its usage."""
    tokens = prompt(12)
    first = {"prompt": tokens, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    params = post(prefill.url, "/v1/completions", first).json()["kv_transfer_params"]
    body = {"prompt": tokens, "max_tokens": 3, "stream": True, "kv_transfer_params": params}
    body["stream_options"] = {"include_usage": True}
    _, chunks = stream_events(decode.http, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "abc"
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 8


def test_vllm_legs_on_the_wrong_engine_or_streamed_prefill_are_400(
    prefill: Engine, decode: Engine
) -> None:
    """do_remote_decode on a decode engine, do_remote_prefill on a prefill engine, a streamed
    prefill leg and a decode leg without remote_request_id are all 400 naming the field."""
    cases = [
        (decode, {"kv_transfer_params": PREFILL_PARAMS}, "do_remote_decode"),
        (prefill, {"kv_transfer_params": PREFILL_PARAMS, "stream": True}, "must not stream"),
        (
            prefill,
            {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "h"}},
            "remote_port",
        ),
        (
            decode,
            {
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "remote_host": "h",
                    "remote_port": 1,
                }
            },
            "remote_request_id",
        ),
    ]
    for engine, extra, word in cases:
        response = post(engine.url, "/v1/completions", {"prompt": "hi", **extra})
        assert response.status_code == 400, (extra, response.text)
        assert word in response.json()["error"]["message"]


def test_vllm_batch_is_one_registration(prefill: Engine, decode: Engine) -> None:
    """A batch's prefill leg registers every prompt under one request id; its decode leg takes
    them all and reports every prompt's blocks as cached; prompts in another order are a 400."""
    prompts = [prompt(8), prompt(6)]
    first = {"prompt": prompts, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    params = post(prefill.url, "/v1/completions", first).json()["kv_transfer_params"]
    assert len(params["remote_block_ids"]) == 2 + 1
    body = {"prompt": prompts, "max_tokens": 2, "kv_transfer_params": params}
    answer = post(decode.url, "/v1/completions", body).json()
    assert len(answer["choices"]) == 2
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    again = post(prefill.url, "/v1/completions", first).json()["kv_transfer_params"]
    swapped = {**body, "prompt": prompts[::-1], "kv_transfer_params": again}
    wrong = post(decode.url, "/v1/completions", swapped)
    assert wrong.status_code == 400 and "another prompt" in wrong.json()["error"]["message"]


def test_with_an_api_key_the_bootstrap_server_needs_it_and_the_decode_sends_it() -> None:
    """Engines sharing --api-key: /take without the key is 401, and a P/D request still works."""
    key = ["--api-key", "sesame"]
    p = Engine(
        [*COMMON, *key, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"],
        None,
    )
    d = Engine([*COMMON, *key, "--disaggregation-mode", "decode"], None)
    try:
        auth = {"Authorization": "Bearer sesame"}
        port = p.http.get("/server_info", headers=auth).json()["disaggregation_bootstrap_port"]
        bare = httpx.post(f"http://127.0.0.1:{port}/take", json={"room": 1}, timeout=10)
        assert bare.status_code == 401
        body = {"input_ids": prompt(), "bootstrap_room": room()}
        body |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
        legs = both(
            lambda: post(p.url, "/generate", body, **auth),
            lambda: post(d.url, "/generate", body, **auth),
        )
        assert [r.status_code for r in legs] == [200, 200], [r.text for r in legs]
        assert legs[1].json()["cached_tokens"] == 8
    finally:
        p.stop()
        d.stop()


# --- the command line ----------------------------------------------------------------------


def test_a_taken_bootstrap_port_is_refused_naming_the_flag() -> None:
    """A prefill whose bootstrap port is taken exits 2 naming --disaggregation-bootstrap-port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = run_kvevents(
            "engine",
            "--port",
            "0",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(port),
        )
    assert done.returncode == 2, done.stderr
    assert "--disaggregation-bootstrap-port" in done.stderr and str(port) in done.stderr
