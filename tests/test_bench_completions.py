"""The router benchmark's /v1/completions comparison: the bare relay, and the rounds.

The bare relay (``kvevents.bench.bare_server --relay-to``) is served by a real uvicorn
on loopback in front of a scripted engine (a plain asyncio server writing fixed
answers); :func:`run_completions` is driven with a recording load function in place of
wrk, so its ordering and arithmetic are checked exactly.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from kvevents.bench.bare_server import BareApp
from kvevents.bench.completions import run_completions
from kvevents.http.serving import bind_http, start_http

ANSWER = b'{"object": "text_completion", "usage": {"prompt_tokens": 3}}'


async def _engine(
    seen: list[bytes], handlers: list[asyncio.Task[Any]]
) -> tuple[str, asyncio.Server]:
    """An engine answering every POST with 201 and ANSWER, recording each request; each
    connection's handler task is added to ``handlers``."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.append(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                )
                seen.append(head + await reader.readexactly(length))
                writer.write(
                    b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the relay closed its connection
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", server


def test_the_bare_relay_forwards_a_completion_as_it_came_and_answers_the_engines_bytes() -> None:
    async def go() -> None:
        seen: list[bytes] = []
        handlers: list[asyncio.Task[Any]] = []
        engine_url, engine = await _engine(seen, handlers)
        app = BareApp(engine_url)
        sock = bind_http("127.0.0.1", 0, "bare relay")
        server, task = await start_http(app, sock, lifespan="off")
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        body = b'{"model": "sim", "prompt": [1, 2, 3], "max_tokens": 1}'
        try:
            async with httpx.AsyncClient(timeout=10.0) as client:
                for _ in range(3):  # the engine's connection is kept alive
                    answer = await client.post(f"{url}/v1/completions", content=body)
                    assert (answer.status_code, answer.content) == (201, ANSWER)
                    assert answer.headers["content-type"] == "application/json"
                parsed = await client.post(f"{url}/route", json={"input_ids": [1, 2, 3]})
                assert parsed.json() == {"prompt_tokens": 3}  # still the ceiling server
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 20.0)
            await app.close()  # its kept-alive connection: the engine's handler ends
            await asyncio.wait_for(asyncio.gather(*handlers), 10.0)
            engine.close()
            await engine.wait_closed()
        assert len(seen) == 3
        assert all(r.startswith(b"POST /v1/completions HTTP/1.1\r\n") for r in seen)
        assert all(r.endswith(b"\r\n\r\n" + body) for r in seen)

    asyncio.run(go())


def test_the_bare_relay_answers_502_when_the_engine_cannot_be_reached() -> None:
    async def go() -> None:
        gone = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = gone.sockets[0].getsockname()[1]
        gone.close()
        await gone.wait_closed()
        sock = bind_http("127.0.0.1", 0, "bare relay")
        server, task = await start_http(BareApp(f"http://127.0.0.1:{port}"), sock, lifespan="off")
        try:
            async with httpx.AsyncClient(timeout=10.0) as client:
                answer = await client.post(
                    f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions", content=b"{}"
                )
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 20.0)
        assert answer.status_code == 502
        assert f"relaying to http://127.0.0.1:{port} failed" in answer.text

    asyncio.run(go())


def test_rounds_alternate_every_side_and_report_what_each_relay_adds(tmp_path: Path) -> None:
    """Each round runs the direct load between the two it is compared with (the machine's
    speed drifts), the order reversed every other round."""
    p50 = {"direct": [10.0, 12.0, 11.0], "bare": [10.5, 12.2, 12.0], "via": [13.0, 14.5, 13.0]}
    asked: list[str] = []

    def load(url: str, bodies: Path) -> dict[str, Any]:  # stands in for wrk
        side = {"e": "direct", "b": "bare", "r": "via"}[url.split("//")[1][0]]
        asked.append(side)
        return {"requests": 100, "p50_ms": p50[side][asked.count(side) - 1]}

    compared = run_completions(
        "http://e", "http://r", tmp_path, load, pids={}, rounds=3, bare_url="http://b"
    )
    assert asked == ["via", "direct", "bare", "bare", "direct", "via", "via", "direct", "bare"]
    assert compared["added_p50_ms"] == [3.0, 2.5, 2.0]
    assert compared["added_p50_ms_median"] == 2.5
    assert [round(a, 6) for a in compared["bare_added_p50_ms"]] == [0.5, 0.2, 1.0]
    assert round(compared["bare_added_p50_ms_median"], 6) == 0.5
    asked.clear()
    plain = run_completions("http://e", "http://r", tmp_path, load, pids={}, rounds=1)
    assert asked == ["direct", "via"]
    assert "bare_added_p50_ms" not in plain and set(plain["rounds"][0]) == {
        "direct",
        "via",
        "added_p50_ms",
    }
