"""A relayed completion whose engine times out, sends an oversized head, a broken chunked
body or closes midway gets a clear gateway error, and the router's other clients and its
next requests notice nothing.

A scripted engine on a real loopback socket answers ``GET /health`` (the router's load
poll for a vLLM engine) and misbehaves on ``POST /v1/completions``; a real uvicorn server
runs the router's app in front of it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from upstream_support import Script, Server, serving

from kvevents import Router
from kvevents.http.serving import bind_http, start_http
from kvevents.router.serve.app import create_app
from kvevents.router.serve.service import RouterService
from kvevents.subscribe.engine_spec import EngineSpec

TIMEOUT = 10.0
_BROKEN = {
    "bad chunk": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n",
    "closed midway": b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"choices": ',
}


def _engine(misbehave: str) -> Any:
    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            while True:
                await server.request(r)
                head = server.requests[-1][0]
                if head.startswith(b"GET "):
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    await w.drain()
                    continue
                if misbehave == "silent":
                    await r.read()  # never answers; returns once the router closes
                    return
                if server.requests[-1][1].find(b'"ok"') >= 0:  # the request after: answered
                    body = b'{"choices": [{"text": "fine"}]}'
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
                    w.write(b"content-length: %d\r\n\r\n%s" % (len(body), body))
                    await w.drain()
                    continue
                if misbehave in _BROKEN:
                    w.write(_BROKEN[misbehave])
                    await w.drain()
                    w.close()
                    return
                w.write(b"HTTP/1.1 200 OK\r\nx-filler: ")
                try:
                    for _ in range(32):  # 32 MiB of one header if nobody stops it
                        w.write(b"a" * (1 << 20))
                        await w.drain()
                except ConnectionError:
                    pass
                return

        return serve

    return make


async def _relay(misbehave: str, forward_timeout: float) -> tuple[httpx.Response, list[int]]:
    async with serving(_engine(misbehave)) as engine:
        spec = EngineSpec.create(
            engine.url, kv_endpoint="tcp://127.0.0.1:5999", dp_size=1, kind="vllm", block_size=4
        )
        router = Router(block_size=4)
        service = RouterService(router, [spec], load_interval=60.0, forward_timeout=forward_timeout)
        sock = bind_http("127.0.0.1", 0, "test router")
        server, task = await start_http(create_app(service), sock, lifespan="on")
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
                body = {"prompt": list(range(40)), "max_tokens": 1}
                relayed = asyncio.ensure_future(client.post("/v1/completions", json=body))
                healths = []
                while not relayed.done():
                    healths.append((await client.get("/health")).status_code)
                    await asyncio.sleep(0.05)
                return await relayed, healths
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 20.0)


@pytest.mark.slow
def test_a_relayed_request_past_its_deadline_answers_504() -> None:
    """An engine that never answers within --forward-timeout is a 504 gateway_timeout."""
    answer, healths = asyncio.run(_relay("silent", forward_timeout=0.5))
    assert answer.status_code == 504, answer.text
    error = answer.json()["error"]
    assert error["type"] == "gateway_timeout" and "failed" in error["message"]
    assert healths and set(healths) == {200}


def test_an_engine_head_past_the_bound_answers_502_and_others_are_served() -> None:
    """An engine sending a head of many MiB is cut off at the router's bound with a 502
    naming it, long before the forward deadline, while /health keeps answering."""
    answer, healths = asyncio.run(_relay("huge head", forward_timeout=30.0))
    assert answer.status_code == 502, answer.text
    assert "larger than" in json.loads(answer.text)["error"]["message"]
    assert set(healths) <= {200}


@pytest.mark.parametrize("misbehave", sorted(_BROKEN))
@pytest.mark.parametrize("stream", [False, True])
def test_a_broken_answer_is_a_clear_error_and_the_next_request_is_served(
    misbehave: str, stream: bool
) -> None:
    """An engine whose answer breaks after its head (an invalid chunk, or the connection
    closed before the promised length): a whole answer is a 502 naming it, a stream ends
    with an error event; the broken connection is not reused, so the next request is
    answered."""

    async def go() -> tuple[httpx.Response, str, httpx.Response]:
        async with serving(_engine(misbehave)) as engine:
            spec = EngineSpec.create(
                engine.url, kv_endpoint="tcp://127.0.0.1:5999", dp_size=1, kind="vllm", block_size=4
            )
            service = RouterService(Router(block_size=4), [spec], load_interval=60.0)
            sock = bind_http("127.0.0.1", 0, "test router")
            server, task = await start_http(create_app(service), sock, lifespan="on")
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            try:
                async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
                    body = {"prompt": list(range(40)), "max_tokens": 1, "stream": stream}
                    broken = await client.post("/v1/completions", json=body)
                    text = broken.text
                    after = await client.post(
                        "/v1/completions", json={"prompt": "ok", "max_tokens": 1}
                    )
                    return broken, text, after
            finally:
                server.should_exit = True
                await asyncio.wait_for(task, 20.0)

    broken, text, after = asyncio.run(go())
    if stream:  # the head went out before the body broke: the stream says so
        assert broken.status_code == 200 and "event: error" in text and "midway" in text
    else:
        assert broken.status_code == 502, text
        assert "failed midway" in json.loads(text)["error"]["message"]
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == "fine"
