"""A relayed completion whose engine times out or sends an oversized head gets a clear
gateway error, and the router's other clients notice nothing.

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
