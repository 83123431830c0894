"""Slow and idle clients are bounded on the router's server: a request's head and body
must arrive in time, a connection that never sends a request is idle like one between
requests, and the idle connections of a process are capped.

Real uvicorn servers on loopback serve the router's app through the inline protocol;
raw sockets play the slow and silent clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import pytest
from router_support import RouterProc

from kvevents import Holder, Router
from kvevents.cli.router import add_arguments, build_service
from kvevents.http.inline import HttpLimits
from kvevents.http.serving import bind_http, start_http
from kvevents.router.serve.app import create_app
from kvevents.router.serve.service import RouterService

BODY = json.dumps({"input_ids": list(range(64))}).encode()


def _router() -> Router:
    router = Router(block_size=16)
    router.add_holder(Holder("http://engine", 0))
    return router


async def _serving(limits: HttpLimits, keep_alive: float = 5.0) -> tuple[str, int, Any, Any]:
    sock = bind_http("127.0.0.1", 0, "test server")
    app = create_app(RouterService(_router(), []))
    server, task = await start_http(app, sock, lifespan="on", limits=limits)
    server.config.timeout_keep_alive = keep_alive  # each new connection reads it
    return "127.0.0.1", sock.getsockname()[1], server, task


async def _closed(reader: asyncio.StreamReader, within: float) -> bytes:
    """What the server sent before it closed the connection (within ``within`` seconds)."""
    rest = await asyncio.wait_for(reader.read(), within)
    assert reader.at_eof()
    return rest


@pytest.mark.slow
def test_a_body_that_stops_halfway_is_answered_408_and_closed() -> None:
    """Headers and half a body, then nothing: 408 at the request timeout, and the
    connection closes; a whole request on another connection meanwhile is answered."""

    async def go() -> None:
        host, port, server, task = await _serving(HttpLimits(request_timeout=0.5))
        try:
            r, w = await asyncio.open_connection(host, port)
            w.write(
                b"POST /route HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY[: len(BODY) // 2])
            )
            r2, w2 = await asyncio.open_connection(host, port)
            w2.write(
                b"POST /route HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n%s"
                % (len(BODY), BODY)
            )
            assert b"HTTP/1.1 200 " in await asyncio.wait_for(r2.readuntil(b"\r\n\r\n"), 10)
            rest = await _closed(r, 10)
            assert rest.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
            w.close()
            w2.close()
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 20.0)

    asyncio.run(go())


@pytest.mark.slow
def test_a_head_that_never_ends_is_closed_at_the_request_timeout() -> None:
    """A request line and a header trickling forever: 408 and closed."""

    async def go() -> None:
        host, port, server, task = await _serving(HttpLimits(request_timeout=0.5))
        try:
            r, w = await asyncio.open_connection(host, port)
            w.write(b"POST /route HTTP/1.1\r\nx-slow: ")

            async def trickle() -> None:
                while not w.is_closing():
                    w.write(b"a")
                    await asyncio.sleep(0.05)

            dripping = asyncio.ensure_future(trickle())
            try:
                assert (await _closed(r, 10)).startswith(b"HTTP/1.1 408 ")
            finally:
                dripping.cancel()
                w.close()
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 20.0)

    asyncio.run(go())


@pytest.mark.slow
def test_a_connection_that_sends_nothing_is_closed_at_the_keep_alive_timeout() -> None:
    """A connection opened and left silent is idle: closed at the keep-alive timeout."""

    async def go() -> None:
        host, port, server, task = await _serving(HttpLimits(), keep_alive=0.3)
        try:
            r, w = await asyncio.open_connection(host, port)
            assert await _closed(r, 10) == b""
            w.close()
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 20.0)

    asyncio.run(go())


def test_past_the_idle_limit_the_oldest_idle_connections_are_closed() -> None:
    """With room for 3 idle connections, opening 5 closes the 2 oldest; the 3 newest stay
    open and serve a request."""

    async def go() -> None:
        host, port, server, task = await _serving(HttpLimits(max_idle_connections=3))
        conns = []
        try:
            for _ in range(5):
                conns.append(await asyncio.open_connection(host, port))
                await asyncio.sleep(0.05)  # in order: the first opened is the oldest
            for r, _ in conns[:2]:
                assert await _closed(r, 5) == b""
            for r, w in conns[2:]:
                w.write(
                    b"POST /route HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(BODY), BODY)
                )
                assert b"HTTP/1.1 200 " in await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
        finally:
            for _, w in conns:
                w.close()
            server.should_exit = True
            await asyncio.wait_for(task, 20.0)

    asyncio.run(go())


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"request_timeout": 0}, "request_timeout=0"), ({"max_idle_connections": 0}, "=0")],
)
def test_limits_must_be_positive(kwargs: dict[str, float], named: str) -> None:
    """A zero bound is refused, naming it."""
    with pytest.raises(ValueError, match=named):
        HttpLimits(**kwargs)  # type: ignore[arg-type]


@pytest.mark.slow
def test_kvevents_router_takes_the_limits_from_its_options() -> None:
    """`kvevents router --request-timeout 0.5` answers a stalled body 408; its engine link
    takes --engine-max-head-bytes and --engine-head-timeout (shown by its service)."""
    proc = RouterProc(
        ["http://127.0.0.1:9"],
        "--request-timeout",
        "0.5",
        "--max-idle-connections",
        "8",
        "--kv-endpoint",
        "tcp://127.0.0.1:5999",
    )
    try:
        host, port = proc.url.removeprefix("http://").rsplit(":", 1)

        async def stall() -> bytes:
            r, w = await asyncio.open_connection(host, int(port))
            w.write(b"POST /route HTTP/1.1\r\nhost: r\r\ncontent-length: 100\r\n\r\n{")
            try:
                return await _closed(r, 10)
            finally:
                w.close()

        assert asyncio.run(stall()).startswith(b"HTTP/1.1 408 ")
    finally:
        proc.stop()


def test_the_router_options_reach_its_service_and_engine_link() -> None:
    """The four options land where they apply: the service's limits and its Upstream."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--engine", "http://127.0.0.1:9", "--kv-endpoint", "tcp://127.0.0.1:5557"]
    argv += ["--request-timeout", "7", "--max-idle-connections", "9"]
    argv += ["--engine-max-head-bytes", "1000", "--engine-head-timeout", "3"]
    service = build_service(parser.parse_args(argv), warn=False)
    assert service.http_limits.request_timeout == 7
    assert service.http_limits.max_idle_connections == 9

    async def link() -> tuple[int, float]:
        await service.start()
        try:
            return service.upstream.max_head_bytes, service.upstream.head_timeout
        finally:
            await service.stop()

    assert asyncio.run(link()) == (1000, 3.0)
