"""The engine client bounds an answer's head in bytes and in time, apart from its body.

Scripted servers on real loopback sockets send heads that are too large or that trickle
in; the client must fail those exchanges alone, close their connections, and go on
serving answers whose heads are ordinary.
"""

from __future__ import annotations

import asyncio

import pytest
from upstream_support import OK, Script, Server, answer_once, run, serving

from kvevents.http.upstream import Upstream
from kvevents.http.upstream_errors import HeadTooLarge, MidwayError


def _huge_head(size: int) -> bytes:
    return b"HTTP/1.1 200 OK\r\nx-filler: " + b"a" * size + b"\r\ncontent-length: 2\r\n\r\n{}"


@pytest.mark.parametrize("whole", [False, True])
def test_a_head_past_the_bound_fails_and_closes_its_connection(whole: bool) -> None:
    """A head larger than max_head_bytes is a HeadTooLarge, whether streamed or taken whole."""
    make = answer_once(_huge_head(200_000), then_hold=True)

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=10, max_head_bytes=64 * 1024)
            with pytest.raises(HeadTooLarge, match="larger than 65536 bytes"):
                if whole:
                    await client.post_whole(server.url, "/x", b"{}", {})
                else:
                    await client.post(server.url, "/x", b"{}", {})
            assert len(client.deadlines) == 0
            await client.close()

    run(main())


def test_a_head_within_the_bound_is_answered() -> None:
    """A large but allowed head (with its body in the same reads) arrives whole."""
    make = answer_once(_huge_head(30_000))

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=10, max_head_bytes=64 * 1024)
            answer = await client.post(server.url, "/x", b"{}", {})
            assert answer.status == 200
            assert await answer.read() == b"{}"
            await client.close()

    run(main())


def test_a_head_that_trickles_in_times_out_at_the_head_timeout() -> None:
    """A head whose end does not follow its first byte within head_timeout is a TimeoutError
    naming the head, long before the exchange's own deadline."""

    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await server.request(r)
            w.write(b"HTTP/1.1 200 OK\r\nx-slow: ")
            await w.drain()
            for _ in range(200):
                await asyncio.sleep(0.05)
                w.write(b"a")
                await w.drain()

        return serve

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=30, head_timeout=0.3)
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(TimeoutError, match=r"head did not arrive whole within 0\.3 s"):
                await client.post_whole(server.url, "/x", b"{}", {})
            assert loop.time() - started < 5  # the head's bound, not the 30 s deadline
            assert len(client.deadlines) == 0
            await client.close()

    run(main())


@pytest.mark.slow
def test_a_head_in_pieces_then_a_slow_body_keeps_the_exchange_deadline() -> None:
    """Once a head that came in pieces is whole, the body runs on the exchange's deadline,
    not the head's."""

    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await server.request(r)
            w.write(b"HTTP/1.1 200 OK\r\n")
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(b"transfer-encoding: chunked\r\n\r\n")
            await w.drain()
            for _ in range(4):
                await asyncio.sleep(0.2)
                w.write(b"2\r\nhi\r\n")
                await w.drain()
            w.write(b"0\r\n\r\n")
            await w.drain()

        return serve

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=10, head_timeout=0.3)
            answer = await client.post(server.url, "/x", b"{}", {})
            assert await answer.read() == b"hi" * 4  # 0.8 s of body: past the head's 0.3 s
            await client.close()

    run(main())


def test_other_exchanges_go_on_while_a_huge_head_is_refused() -> None:
    """A connection sending a huge head costs the others nothing: an ordinary answer on
    another connection is served while the huge one is cut off."""

    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await server.request(r)
            if n == 1:
                w.write(b"HTTP/1.1 200 OK\r\nx-filler: ")
                try:
                    for _ in range(64):  # 64 MiB if nobody stops it
                        w.write(b"a" * (1 << 20))
                        await w.drain()
                except ConnectionError:
                    return
                return
            w.write(OK)
            await w.drain()

        return serve

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=10)
            huge = asyncio.ensure_future(client.post_whole(server.url, "/x", b"{}", {}))
            await asyncio.sleep(0)
            fine = await client.post_whole(server.url, "/y", b"{}", {})
            assert fine.status == 200
            with pytest.raises((HeadTooLarge, MidwayError)):
                await huge
            await client.close()

    run(main())


def test_bounds_must_be_positive() -> None:
    """A zero or negative bound is refused with the parameter named."""
    with pytest.raises(ValueError, match="max_head_bytes=0"):
        Upstream(timeout=1, max_head_bytes=0)
    with pytest.raises(ValueError, match="head_timeout=0"):
        Upstream(timeout=1, head_timeout=0)
