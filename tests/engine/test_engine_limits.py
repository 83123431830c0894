"""The simulated engine's bounds: hostile bodies answer 4xx on a connection that stays usable,
bodies and max_new_tokens have ceilings, and SIGTERM has a deadline."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from engine_support import Engine

LIMIT_BODY = 64 << 10
LIMIT_TOKENS = 50


pytestmark = pytest.mark.slow  # every test talks to an engine subprocess


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Engine:
    limits = ["--max-body-bytes", str(LIMIT_BODY), "--max-new-tokens-limit", str(LIMIT_TOKENS)]
    return make_engine(["--page-size", "4", *limits], None)


def client_port(response: httpx.Response) -> int:
    """The local port of the connection that carried ``response``."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


DEEP = b"[" * 1000 + b"]" * 1000
LONE = b'"\\ud800"'  # a JSON string holding an unpaired surrogate

BAD_BODIES = [
    ("/generate", b'{"text": "a", "extra": ' + DEEP + b"}", "nested"),
    ("/generate", b'{"input_ids": ' + DEEP + b"}", "input_ids"),
    ("/generate", b'{"text": ' + LONE + b"}", "surrogate"),
    ("/v1/completions", b'{"prompt": ' + DEEP + b"}", "nested"),
    ("/v1/completions", b'{"prompt": ' + LONE + b"}", "surrogate"),
    ("/v1/completions", b'{"prompt": "hi", "model": ' + LONE + b"}", "surrogate"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": ' + LONE + b"}]}",
        "surrogate",
    ),
    ("/v1/chat/completions", b'{"messages": ' + DEEP + b"}", "nested"),
    ("/tokenize", b'{"prompt": ' + LONE + b"}", "surrogate"),
    ("/tokenize", b'{"prompt": ' + DEEP + b"}", "nested"),
]

GOOD = {
    "/generate": {"text": "hello", "max_new_tokens": 1},
    "/v1/completions": {"prompt": "hello", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/tokenize": {"prompt": "hello"},
}


def error_text(response: httpx.Response) -> str:
    error = response.json()["error"]
    return str(error["message"] if isinstance(error, dict) else error)


@pytest.mark.parametrize(("path", "body", "problem"), BAD_BODIES)
def test_hostile_json_answers_400_and_the_connection_stays_usable(
    engine: Engine, path: str, body: bytes, problem: str
) -> None:
    """JSON nested 1,000 deep or holding a lone surrogate answers 400 naming the problem;
    the next request on the same keep-alive connection succeeds."""
    with httpx.Client(base_url=engine.url, timeout=30.0) as client:
        bad = client.post(path, content=body, headers={"content-type": "application/json"})
        assert bad.status_code == 400, bad.text
        assert problem in error_text(bad)
        good = client.post(path, json=GOOD[path])
        assert good.status_code == 200, good.text
        assert client_port(good) == client_port(bad)


def test_max_new_tokens_above_the_limit_is_400_naming_the_flag(engine: Engine) -> None:
    """max_new_tokens (or max_tokens) past --max-new-tokens-limit answers 400; at it, 200."""
    over = LIMIT_TOKENS + 1
    for path, body in (
        ("/generate", {"input_ids": [1, 2], "max_new_tokens": over}),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": over}}),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": over}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": over},
        ),
    ):
        answer = engine.http.post(path, json=body)
        assert answer.status_code == 400, (path, answer.text)
        assert str(LIMIT_TOKENS) in error_text(answer), answer.text
    at = engine.http.post("/generate", json={"input_ids": [1, 2], "max_new_tokens": LIMIT_TOKENS})
    assert at.status_code == 200 and at.json()["completion_tokens"] == LIMIT_TOKENS


def test_a_body_past_the_limit_is_413_by_content_length(engine: Engine) -> None:
    """A body larger than --max-body-bytes answers 413 naming the limit; one just under is served."""
    big = b'{"prompt": "' + b"a" * LIMIT_BODY + b'"}'
    for path in ("/tokenize", "/generate", "/v1/completions"):
        answer = engine.http.post(path, content=big, headers={"content-type": "application/json"})
        assert answer.status_code == 413, (path, answer.text)
        assert "--max-body-bytes" in answer.text and str(LIMIT_BODY) in answer.text
    fits = engine.http.post("/tokenize", json={"prompt": "a" * (LIMIT_BODY - 100)})
    assert fits.status_code == 200 and fits.json()["count"] == LIMIT_BODY - 100


def test_a_chunked_body_is_refused_once_it_passes_the_limit(engine: Engine) -> None:
    """A chunked body without Content-Length is counted as it streams: 413 once past the
    limit, while the client is still sending (the server does not wait for the end)."""
    sent = 0
    stop = threading.Event()

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"prompt": "'
        while not stop.is_set() and sent < 100 * LIMIT_BODY:
            sent += 4096
            yield b"a" * 4096

    url = httpx.URL(engine.url)
    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        sock.sendall(
            b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        sock.settimeout(30)
        reply = b""
        try:
            for chunk in chunks():
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sock.setblocking(False)
                try:
                    reply += sock.recv(65536)
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
                if b"\r\n\r\n" in reply:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were still sending
        stop.set()
        sock.settimeout(30)
        while b"\r\n\r\n" not in reply:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert sent < 100 * LIMIT_BODY, "the server read the whole body before answering"


def test_sigterm_with_a_request_in_flight_exits_within_the_shutdown_timeout() -> None:
    """An engine serving a request of 10,000 slow tokens exits 0 after SIGTERM once
    --shutdown-timeout (1 s) passed, instead of waiting for the request."""
    eng = Engine(
        [
            "--decode-steps-per-s",
            "10",
            "--shutdown-timeout",
            "1",
            "--max-new-tokens-limit",
            "10000",
        ],
        None,
    )
    result: dict[str, Any] = {}

    def long_request() -> None:
        try:
            with httpx.Client(base_url=eng.url, timeout=120.0) as client:
                result["answer"] = client.post(
                    "/generate", json={"input_ids": [1, 2, 3], "max_new_tokens": 10_000}
                )
        except httpx.HTTPError as exc:
            result["error"] = exc

    thread = threading.Thread(target=long_request, daemon=True)
    thread.start()
    try:
        deadline_polls = 0
        while eng.http.get("/load").json()["ranks"][0]["running"] < 1:
            deadline_polls += 1
            assert deadline_polls < 500, "the long request never started running"
            assert thread.is_alive(), result
            threading.Event().wait(0.02)
        os.kill(eng.proc.pid, signal.SIGTERM)
        assert eng.wait_exit(timeout=30) == 0
    finally:
        eng.stop(expect=None)
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert "answer" not in result or result["answer"].status_code >= 500


def test_extra_keys_that_cannot_be_keyed_are_400(engine: Engine) -> None:
    """An int past 64 bits in /generate's extra_keys is a 400 naming the field (the rank's
    control message failed to encode: a 500, and the connection dropped)."""
    for value in (2**64, -(2**63) - 1):
        body = {"input_ids": [1, 2, 3, 4], "extra_keys": [[value]]}
        answer = engine.http.post("/generate", json=body)
        assert answer.status_code == 400 and "extra_keys" in error_text(answer), answer.text
    assert engine.http.post("/generate", json={"input_ids": [1, 2]}).status_code == 200


def test_the_default_number_of_new_tokens_never_passes_the_limit() -> None:
    """With --max-new-tokens-limit 8 (below the default 16), a request that asks for no
    number gets 8 tokens, on /generate (it got 16) and /v1/completions (a 400 naming
    max_tokens, which the client never sent)."""
    small = Engine(["--page-size", "4", "--max-new-tokens-limit", "8"], None)
    try:
        generated = small.http.post("/generate", json={"input_ids": [1, 2]})
        assert generated.status_code == 200 and generated.json()["completion_tokens"] == 8
        completed = small.http.post("/v1/completions", json={"prompt": [1, 2]})
        assert completed.status_code == 200, completed.text
        assert completed.json()["usage"]["completion_tokens"] == 8
    finally:
        small.stop()
