"""The router's forwarding client against scripted HTTP servers on real sockets.

Each server here is a plain asyncio TCP server on an OS-chosen loopback port that reads
requests and writes exactly the bytes a test gives it, so every case an engine can
produce (kept-alive, ``Connection: close``, chunked, a body ended by the connection, a
connection dropped midway, bytes that are not HTTP, no answer at all) is the real thing
on the wire.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from pathlib import Path

import pytest
import trustme
from upstream_support import OK, Script, Server, answer_once, keep_alive, read_request, run, serving

from kvevents.http import auth as http_auth
from kvevents.http.upstream import Upstream
from kvevents.http.upstream_errors import MidwayError, UpstreamError


def test_requests_reuse_one_kept_alive_connection_and_send_what_they_are_given() -> None:
    async def main() -> None:
        async with serving(keep_alive()) as server:
            client = Upstream(timeout=5, headers={"authorization": "Bearer k"})
            for i in range(3):
                answer = await client.post(
                    server.url, "/v1/completions", b'{"n": %d}' % i, {"x-a": "1"}
                )
                assert (answer.status, answer.headers["content-type"]) == (200, "application/json")
                assert await answer.read() == b"{}"
            await client.close()
        assert server.connections == 1
        head, body = server.requests[2]
        assert body == b'{"n": 2}'
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /v1/completions HTTP/1.1"
        assert b"Content-Length: 8" in lines and b"authorization: Bearer k" in lines
        assert b"x-a: 1" in lines and lines[1] == b"Host: " + server.url[7:].encode()

    run(main())


def test_a_connection_close_answer_is_not_reused() -> None:
    closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"

    async def main() -> None:
        async with serving(keep_alive(closing)) as server:
            client = Upstream(timeout=5)
            for _ in range(2):
                answer = await client.post(server.url, "/x", b"{}", {})
                assert await answer.read() == b"ok"
            await client.close()
        assert server.connections == 2

    run(main())


def test_an_unread_body_closes_its_connection_instead_of_reusing_it() -> None:
    big = b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n" + b"a" * 100000

    async def main() -> None:
        async with serving(keep_alive(big)) as server:
            client = Upstream(timeout=5)
            answer = await client.post(server.url, "/x", b"{}", {})
            answer.release()  # the body was not read
            answer = await client.post(server.url, "/x", b"{}", {})
            assert len(await answer.read()) == 100000
            await client.close()
        assert server.connections == 2

    run(main())


def test_a_chunked_stream_arrives_chunk_by_chunk() -> None:
    gate = asyncio.Event()

    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await server.request(r)
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await w.drain()
            await gate.wait()
            w.write(b"6\r\nsecond\r\n0\r\n\r\n")
            await w.drain()
            await server.exchange(r, w, OK)  # the connection is reused after the stream
            await asyncio.sleep(1)

        return serve

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=5)
            answer = await client.post(server.url, "/x", b"{}", {})
            chunks = answer.chunks()
            assert await anext(chunks) == b"first"  # before the rest was even sent
            gate.set()
            assert [c async for c in chunks] == [b"second"]
            assert await (await client.post(server.url, "/x", b"{}", {})).read() == b"{}"
            await client.close()
        assert server.connections == 1

    run(main())


def test_a_body_without_a_length_ends_with_the_connection() -> None:
    make = answer_once(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=5)
            answer = await client.post(server.url, "/x", b"{}", {})
            assert await answer.read() == b"all of it"
            await client.close()

    run(main())


def test_a_body_without_a_length_cut_by_a_reset_is_an_error_not_the_whole_answer() -> None:
    """The end of the connection ends such a body only when the engine closes it: a reset
    (the engine crashed, a proxy gave up) leaves it cut short, which the client says."""

    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await server.request(r)
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\npart of it")
            await w.drain()
            await asyncio.sleep(0.2)  # the head and the part are read first
            sock = w.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()  # closed with a reset (linger 0)

        return serve

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=5)
            answer = await client.post(server.url, "/x", b"{}", {})
            with pytest.raises(UpstreamError, match="closed the connection midway"):
                await answer.read()
            await client.close()

    run(main())


@pytest.mark.slow
def test_a_body_without_a_length_past_the_deadline_fails_even_read_late() -> None:
    """The deadline closes the connection, which asyncio reports as a clean close: that
    is not the body's end. A reader that comes after it gets the part that came, then
    the timeout, not a whole answer."""

    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await server.request(r)
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\npart of it")
            await w.drain()
            await asyncio.sleep(5.0)  # and the rest never comes

        return serve

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=0.3)
            answer = await client.post(server.url, "/x", b"{}", {})
            await asyncio.sleep(0.8)  # past the deadline before reading anything
            chunks = answer.chunks()
            assert await chunks.__anext__() == b"part of it"
            with pytest.raises(TimeoutError):
                await chunks.__anext__()
            await client.close()

    run(main())


@pytest.mark.parametrize(
    ("sent", "words"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", "closed the connection midway"),
        (b"", "closed the connection midway"),
        (b"SSH-2.0-OpenSSH_9.2\r\n", "not HTTP"),
    ],
)
def test_an_answer_cut_short_or_not_http_is_an_upstream_error(sent: bytes, words: str) -> None:
    async def main() -> None:
        async with serving(answer_once(sent)) as server:
            client = Upstream(timeout=5)
            with pytest.raises(UpstreamError, match=words):
                answer = await client.post(server.url, "/x", b"{}", {})
                await answer.read()
            await client.close()

    run(main())


def test_no_answer_within_the_timeout_is_a_timeout_and_the_connection_closes() -> None:
    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await server.request(r)
            if n == 1:
                await r.read()  # never answers; returns once the client closes
                return
            w.write(OK)
            await w.drain()

        return serve

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=0.3)
            with pytest.raises(TimeoutError):
                await client.post(server.url, "/x", b"{}", {})
            assert len(client.deadlines) == 0  # expired: no longer watched
            answer = await client.post(server.url, "/x", b"{}", {})
            assert await answer.read() == b"{}"
            assert len(client.deadlines) == 0  # all of it in: forgotten
            await client.close()
        assert server.connections == 2

    run(main())


def test_a_stream_that_stalls_past_the_deadline_times_out() -> None:
    make = answer_once(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n", then_hold=True
    )

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=0.3)
            answer = await client.post(server.url, "/x", b"{}", {})
            chunks = answer.chunks()
            assert await anext(chunks) == b"hi"
            assert len(client.deadlines) == 1  # the stream goes on: still watched
            with pytest.raises(TimeoutError):
                await anext(chunks)
            assert len(client.deadlines) == 0
            answer.release()
            await client.close()

    run(main())


def test_an_engine_that_is_not_listening_is_named() -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        client = Upstream(timeout=5)
        with pytest.raises(UpstreamError, match=f"cannot connect to 127.0.0.1:{port}"):
            await client.post(f"http://127.0.0.1:{port}", "/x", b"{}", {})

    run(main())


def test_idle_connections_expire_and_ones_the_server_closed_are_skipped() -> None:
    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await server.exchange(r, w, OK)
            if n == 2:
                return  # closes while the client keeps it idle
            await server.exchange(r, w, OK)

        return serve

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=5, idle_s=0.2)
            await (await client.post(server.url, "/x", b"{}", {})).read()
            await asyncio.sleep(0.3)  # past idle_s: the first connection is not reused
            await (await client.post(server.url, "/x", b"{}", {})).read()
            await asyncio.sleep(0.1)  # the server has closed connection 2 by now
            await (await client.post(server.url, "/x", b"{}", {})).read()
            await client.close()
        assert server.connections == 3

    run(main())


def test_a_long_stream_read_slowly_arrives_whole() -> None:
    """Past 256 KiB unread the socket pauses; every byte still arrives, in order."""
    piece = bytes(range(256)) * 256  # 64 KiB

    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await server.request(r)
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (len(piece) * 32))
            for _ in range(32):
                w.write(piece)
                await w.drain()

        return serve

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=10)
            answer = await client.post(server.url, "/x", b"{}", {})
            await asyncio.sleep(0.3)  # let the server fill every buffer
            got = bytearray()
            async for chunk in answer.chunks():
                got += chunk
            assert bytes(got) == piece * 32
            await client.close()

    run(main())


async def _https_answering(served: ssl.SSLContext) -> tuple[asyncio.Server, str]:
    """A TLS server (``served``: its certificate) that answers each request with OK."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(OK)
        await w.drain()
        w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=served)
    return server, f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_https_engines_are_verified_with_the_given_context(tmp_path: Path) -> None:
    ca = trustme.CA()
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(served)
    trusted = ssl.create_default_context()
    ca.configure_trust(trusted)

    async def main() -> None:
        server, url = await _https_answering(served)
        client = Upstream(timeout=5, tls=trusted)
        assert await (await client.post(url, "/x", b"{}", {})).read() == b"{}"
        stranger = Upstream(timeout=5, tls=ssl.create_default_context())
        with pytest.raises(UpstreamError, match="CERTIFICATE_VERIFY_FAILED"):
            await stranger.post(url, "/x", b"{}", {})
        server.close()

    run(main())


def test_without_a_context_https_engines_are_verified_against_the_system_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Upstream made without ``tls`` (a tokenizer endpoint used on its own, say)
    still verifies engines, against the system's store as the router's own context
    does: a throwaway CA is refused, and trusted once ``SSL_CERT_FILE`` names it."""
    ca = trustme.CA()
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(served)
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))

    async def main() -> None:
        server, url = await _https_answering(served)
        try:
            with pytest.raises(UpstreamError, match="CERTIFICATE_VERIFY_FAILED"):
                await Upstream(timeout=5).post(url, "/x", b"{}", {})
            monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
            http_auth._trusting.cache_clear()
            assert await (await Upstream(timeout=5).post(url, "/x", b"{}", {})).read() == b"{}"
        finally:
            http_auth._trusting.cache_clear()
            server.close()

    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    http_auth._trusting.cache_clear()
    run(main())


def test_after_close_requests_are_refused() -> None:
    async def main() -> None:
        client = Upstream(timeout=5)
        await client.close()
        with pytest.raises(UpstreamError, match="shutting down"):
            await client.post("http://127.0.0.1:9", "/x", b"{}", {})

    run(main())


def test_a_url_that_is_not_http_is_refused_with_the_fix() -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="http://HOST"):
            await Upstream(timeout=5).post("ftp://h", "/x", b"{}", {})

    run(main())


# --- post_whole: the whole answer in one future -------------------------------------


def test_whole_answers_arrive_in_one_future_and_reuse_one_connection() -> None:
    async def main() -> None:
        async with serving(keep_alive()) as server:
            client = Upstream(timeout=5, headers={"authorization": "Bearer k"})
            first = client.post_whole(server.url, "/v1/completions", b'{"n": 0}', {"x-a": "1"})
            assert isinstance(first, asyncio.Task)  # no connection yet: a task opens one
            full = await first
            assert (full.status, full.headers["content-type"], full.body) == (
                200,
                "application/json",
                b"{}",
            )
            for i in (1, 2):
                kept = client.post_whole(server.url, "/v1/completions", b'{"n": %d}' % i, {})
                assert not isinstance(kept, asyncio.Task)  # the connection's own future
                assert (await kept).body == b"{}"
            await client.close()
        assert server.connections == 1
        head, body = server.requests[0]
        assert body == b'{"n": 0}'
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /v1/completions HTTP/1.1"
        assert b"authorization: Bearer k" in lines and b"x-a: 1" in lines

    run(main())


def test_a_whole_answer_without_a_length_ends_with_the_connection() -> None:
    make = answer_once(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=5)
            assert (await client.post_whole(server.url, "/x", b"{}", {})).body == b"all of it"
            await client.close()

    run(main())


def test_a_whole_answer_after_an_interim_one_is_the_final_one() -> None:
    make = answer_once(b"HTTP/1.1 100 Continue\r\n\r\n" + OK.replace(b"200 OK", b"201 Created"))

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=5)
            full = await client.post_whole(server.url, "/x", b"{}", {})
            assert (full.status, full.body) == (201, b"{}")
            await client.close()

    run(main())


@pytest.mark.parametrize(
    ("sent", "status", "words"),
    [
        (b"HTTP/1.1 503 Busy\r\ncontent-length: 10\r\n\r\nabc", 503, "closed the connection"),
        (b"", None, "closed the connection midway"),
        (b"SSH-2.0-OpenSSH_9.2\r\n", None, "not HTTP"),
    ],
)
def test_a_whole_answer_cut_short_says_whether_it_began(
    sent: bytes, status: int | None, words: str
) -> None:
    async def main() -> None:
        async with serving(answer_once(sent)) as server:
            client = Upstream(timeout=5)
            with pytest.raises(UpstreamError, match=words) as caught:
                await client.post_whole(server.url, "/x", b"{}", {})
            if status is None:
                assert not isinstance(caught.value, MidwayError)
            else:
                assert isinstance(caught.value, MidwayError)
                assert caught.value.status == status
                assert isinstance(caught.value.cause, UpstreamError)
            await client.close()

    run(main())


@pytest.mark.slow
def test_a_whole_answer_past_the_deadline_times_out_before_or_after_its_head() -> None:
    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await server.request(r)
            if n == 2:  # the head, then the body stalls
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
                await w.drain()
            if n <= 2:
                await r.read()  # returns once the client closes
                return
            w.write(OK)
            await w.drain()

        return serve

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=0.3)
            with pytest.raises(TimeoutError):
                await client.post_whole(server.url, "/x", b"{}", {})
            with pytest.raises(MidwayError) as caught:
                await client.post_whole(server.url, "/x", b"{}", {})
            assert caught.value.status == 200 and isinstance(caught.value.cause, TimeoutError)
            assert (await client.post_whole(server.url, "/x", b"{}", {})).body == b"{}"
            await client.close()
        assert server.connections == 3  # a connection that timed out is never reused

    run(main())


def test_a_whole_answer_nobody_waits_for_any_more_closes_its_connection() -> None:
    gate = asyncio.Event()

    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            while True:
                await server.request(r)
                if n == 1 and len(server.requests) == 2:
                    await gate.wait()  # answered after the caller gave up on it
                w.write(OK)
                await w.drain()

        return serve

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=5)
            assert (await client.post_whole(server.url, "/x", b"{}", {})).body == b"{}"
            given_up = client.post_whole(server.url, "/x", b"{}", {})  # the kept connection
            await asyncio.sleep(0.05)
            given_up.cancel()
            gate.set()
            await asyncio.sleep(0.1)  # its answer arrives and is dropped with the connection
            assert (await client.post_whole(server.url, "/x", b"{}", {})).body == b"{}"
            await client.close()
        assert server.connections == 2

    run(main())


def test_a_head_future_is_the_exchanges_own_and_cancelling_it_closes_the_connection() -> None:
    """post_head on a kept-alive connection is answered through the exchange's own future
    (no task), its Response once the head is in; one cancelled before its answer closes
    its connection, so the engine sees the client leave, and is never reused."""
    got, left = asyncio.Event(), asyncio.Event()

    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            while True:
                await server.request(r)
                if n == 1 and len(server.requests) == 2:
                    got.set()
                    await r.read()  # returns once the client closes
                    left.set()
                    return
                w.write(OK)
                await w.drain()

        return serve

    async def main() -> None:
        async with serving(make) as server:
            client = Upstream(timeout=5)
            first = client.post_head(server.url, "/x", b"{}", {})
            assert isinstance(first, asyncio.Task)  # no connection yet: a task opens one
            answer = await first
            assert (answer.status, await answer.read()) == (200, b"{}")
            given_up = client.post_head(server.url, "/x", b"{}", {}, timeout=3)
            assert not isinstance(given_up, asyncio.Task)  # the kept connection's own
            await asyncio.wait_for(got.wait(), 5)
            given_up.cancel()
            await asyncio.wait_for(left.wait(), 5)
            answer = await client.post_head(server.url, "/x", b"{}", {})
            assert await answer.read() == b"{}"
            await client.close()
        assert server.connections == 2

    run(main())


def test_after_close_a_whole_answer_is_refused() -> None:
    async def main() -> None:
        client = Upstream(timeout=5)
        await client.close()
        refused = client.post_whole("http://127.0.0.1:9", "/x", b"{}", {})
        with pytest.raises(UpstreamError, match="shutting down"):
            await refused

    run(main())


# --- get: the engines' load polls ----------------------------------------------------


def test_gets_send_no_body_and_reuse_one_kept_alive_connection() -> None:
    async def main() -> None:
        async with serving(keep_alive()) as server:
            client = Upstream(timeout=60, headers={"authorization": "Bearer k"})
            for _ in range(3):
                full = await client.get(server.url + "/base/", "/load", timeout=5)
                assert (full.status, full.body) == (200, b"{}")
            await client.close()
        assert server.connections == 1 and len(server.requests) == 3
        head, body = server.requests[0]
        lines = head.split(b"\r\n")
        assert lines[0] == b"GET /base/load HTTP/1.1" and body == b""
        assert (
            b"authorization: Bearer k" in lines and lines[1] == b"Host: " + server.url[7:].encode()
        )
        assert not any(line.lower().startswith(b"content-length") for line in lines)

    run(main())


def test_a_get_the_engine_dropped_on_a_kept_alive_connection_is_sent_again_once() -> None:
    """The engine reads the second GET on a kept-alive connection and closes it without
    a word (as a server closing an idle connection does): the GET goes out again on a
    new connection and is answered there. A new connection dropped the same way is an
    error, not another try."""

    def script(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            if n == 1:
                await server.exchange(r, w, OK)
                await server.request(r)  # then close, unanswered
            elif n == 2:
                await server.exchange(r, w, OK)
            else:
                await server.request(r)

        return serve

    async def main() -> None:
        async with serving(script) as server:
            client = Upstream(timeout=60)
            assert (await client.get(server.url, "/load", timeout=5)).status == 200
            assert (await client.get(server.url, "/load", timeout=5)).status == 200
            assert server.connections == 2 and len(server.requests) == 3
            await client.close()
            fresh = Upstream(timeout=60)  # its first GET opens connection 3
            with pytest.raises(UpstreamError, match="closed the connection"):
                await fresh.get(server.url, "/load", timeout=5)
            assert server.connections == 3
            await fresh.close()

    run(main())


def test_a_get_without_an_answer_times_out_at_its_own_timeout() -> None:
    """The GET's ``timeout``, not the client's forwarding one, bounds it; after close, refused."""

    def script(server: Server) -> Script:
        async def hold(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await r.read()  # never answers; returns once the client closes

        return hold

    async def main() -> None:
        async with serving(script) as server:
            client = Upstream(timeout=600)
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(TimeoutError):
                await client.get(server.url, "/load", timeout=0.2)
            assert loop.time() - began < 5
            await client.close()
            with pytest.raises(UpstreamError, match="shutting down"):
                await client.get(server.url, "/load", timeout=5)

    run(main())
