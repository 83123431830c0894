"""SGLang's two legs leave together, in the step that builds them, on real sockets.

The engines here are plain HTTP servers in threads of their own, so they receive what
the router's client writes while the router's event loop is not running at all: a leg
sent by a task, a callback or anything else that waits for the loop's next step would
not arrive until the loop runs again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from kvevents.http.upstream import Upstream
from kvevents.router.serve.pd_exchange import Leg, PDExchange
from kvevents.router.serve.pd_stats import PDStats
from thread_engine import ThreadEngine


class _Tickets:
    """The router's part the exchange uses: each ticket finished once."""

    def __init__(self) -> None:
        self.finished: list[tuple[Any, bool]] = []

    def finish(self, ticket: Any, *, failed: bool = False) -> None:
        self.finished.append((ticket, failed))


@pytest.fixture
def engines() -> Iterator[tuple[ThreadEngine, ThreadEngine]]:
    prefill, decode = ThreadEngine(), ThreadEngine()
    yield prefill, decode
    prefill.close()
    decode.close()


def _leg(pool: str, engine: ThreadEngine, body: bytes) -> Leg:
    headers = b"content-type: application/json\r\n"
    return Leg(pool, None, engine.url, "/v1/completions", body, headers, pool, 5.0)  # type: ignore[arg-type]


def test_both_legs_are_on_the_wire_before_the_exchange_first_waits(
    engines: tuple[ThreadEngine, ThreadEngine],
) -> None:
    """Run up to its first wait and no further, with the event loop stopped, the exchange
    has written the prefill leg and the decode leg on their kept-alive connections: both
    engines receive them though the loop has not run one step since; given up, both legs'
    connections close."""
    prefill, decode = engines
    loop = asyncio.new_event_loop()
    upstream = Upstream(timeout=5)
    try:

        async def warm() -> None:
            await asyncio.gather(*(upstream.get(e.url, "/health", timeout=5) for e in engines))

        loop.run_until_complete(warm())
        for engine in engines:  # each origin now has a kept-alive connection
            assert engine.arrived.get(timeout=5)[0] == b"/health"
        tickets = _Tickets()
        exchange = PDExchange(
            upstream,
            tickets,  # type: ignore[arg-type]
            PDStats(),
            set(),
            _leg("decode", decode, b'{"leg": "decode"}'),
            _leg("prefill", prefill, b'{"leg": "prefill"}'),
            loop=loop,
        )
        step = exchange.concurrent(lambda whole: None)
        waiting = step.send(None)  # the coroutine's first step, outside any loop run
        assert isinstance(waiting, asyncio.Future) and not waiting.done()
        assert prefill.arrived.get(timeout=5) == (b"/v1/completions", b'{"leg": "prefill"}')
        assert decode.arrived.get(timeout=5) == (b"/v1/completions", b'{"leg": "decode"}')
        step.close()  # given up, as a shutdown gives a request up: both legs cancelled
        loop.run_until_complete(asyncio.sleep(0))  # their connections close
        for engine in engines:
            assert engine.left.get(timeout=5) is None
        exchange.cancel()  # what the relay does then: each ticket ends once, failed
        assert sorted(tickets.finished) == [("decode", True), ("prefill", True)]
        loop.run_until_complete(upstream.close())
    finally:
        loop.close()
