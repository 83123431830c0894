"""The inline path on uvicorn answers exactly as the ASGI path, and only where it may.

Two real uvicorn servers on loopback serve one router: one through the inline protocol
(:mod:`kvevents.http.inline`), one through uvicorn's own (the same app behind a plain
ASGI function, which offers no inline answer). Raw sockets check what a client library
would hide: pipelining order, HTTP/1.0, chunked bodies, ``Expect: 100-continue``.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import httpx
import pytest

from kvevents import Holder, Router
from kvevents.http.auth import ApiKey
from kvevents.http.held_writes import HeldWrites
from kvevents.http.inline import InlineApp, protocol_for
from kvevents.http.serving import bind_http, start_http
from kvevents.router.serve.app import create_app
from kvevents.router.serve.hot_path import HotPath
from kvevents.router.serve.service import RouterService
from kvevents.wire.hashing import content_keys

LIMIT = 4096
PROMPT = list(range(1000, 1064))
KEY = "test-key-inline"


class _Counting(HotPath):
    """The router's hot path, counting the requests it answered inline."""

    inline_answers = 0

    def answer_inline(self, *args: Any) -> tuple[int, bytes] | None:
        answered = super().answer_inline(*args)
        if answered is not None:
            type(self).inline_answers += 1
        return answered


def _router() -> Router:
    router = Router(block_size=16)
    for rank in range(2):
        router.add_holder(Holder("http://engine", rank))
    router.index.store_keys(Holder("http://engine", 1), content_keys(PROMPT, 16))
    router.index.store_keys(Holder("http://engine", 0), content_keys(PROMPT[:32], 16))
    return router


async def _serve(app: Any, lifespan: Literal["on", "off"]) -> tuple[str, Any, Any]:
    sock = bind_http("127.0.0.1", 0, "test server")
    server, task = await start_http(app, sock, lifespan=lifespan)
    return f"127.0.0.1:{sock.getsockname()[1]}", server, task


class _Servers:
    def __init__(self, inline: str, plain: str) -> None:
        self.inline, self.plain = inline, plain


async def _with_servers(check: Callable[[_Servers], Awaitable[None]]) -> None:
    """Run ``check`` against an inline and a plain server over one router service."""
    service = RouterService(_router(), [])
    built = create_app(service, max_body_bytes=LIMIT, api_key=ApiKey(KEY))
    hot = _Counting(
        service,
        built.fallback,
        max_body_bytes=LIMIT,
        api_key=ApiKey(KEY),
        open_paths=built.open_paths,
    )
    assert isinstance(hot, InlineApp) and protocol_for(hot, "httptools") != "httptools"

    async def plain(scope: Any, receive: Any, send: Any) -> None:  # no inline answer
        await hot(scope, receive, send)

    assert protocol_for(plain, "httptools") == "httptools"
    inline_at, s1, t1 = await _serve(hot, "on")  # the service starts and stops once
    plain_at, s2, t2 = await _serve(plain, "off")
    try:
        await check(_Servers(inline_at, plain_at))
    finally:
        s1.should_exit = s2.should_exit = True
        await asyncio.wait_for(asyncio.gather(t1, t2), 20.0)


def _run(check: Callable[[_Servers], Awaitable[None]]) -> None:
    asyncio.run(_with_servers(check))


_AUTH = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}

_BODIES: Sequence[bytes] = (
    json.dumps({"input_ids": PROMPT}).encode(),
    json.dumps({"input_ids": PROMPT[:40], "top": 1}).encode(),
    json.dumps({"input_ids": PROMPT, "all_scores": True}).encode(),
    json.dumps({"text": "some text to tokenize, byte by byte"}).encode(),  # async: ASGI
    b'{"input_ids": [1, 2, 3, 4.5]}',
    b'{"input_ids": "nope"}',
    b"[1, 2]",
    b"{not json",
    b"",
    b'{"input_ids": [1], "model": "no-such-model"}',
    b'{"input_ids": [1], "extra_keys": [[1, 2, 3]]}',
    b"[" * 300 + b"]" * 300,
    b'{"input_ids": [' + b"7, " * 2000 + b"7]}",  # over LIMIT: 413
)


def test_inline_answers_equal_the_asgi_answers() -> None:
    """Every body, good or refused, on /route and /query: the same status and JSON from
    both servers, and the inline server answered the plain-id ones inline."""

    async def check(servers: _Servers) -> None:
        before = _Counting.inline_answers
        async with httpx.AsyncClient(timeout=10.0) as client:
            for path in ("/route", "/query"):
                for body in _BODIES:
                    ours, theirs = [
                        await client.post(f"http://{at}{path}", content=body, headers=_AUTH)
                        for at in (servers.inline, servers.plain)
                    ]
                    assert ours.status_code == theirs.status_code, (path, body[:60])
                    assert ours.json() == theirs.json(), (path, body[:60])
                    assert ours.headers["content-type"] == "application/json"
            route = await client.post(
                f"http://{servers.inline}/route", content=_BODIES[0], headers=_AUTH
            )
            assert route.json()["dp_rank"] == 1 and route.json()["scores"][0]["matched"]["gpu"] == 3
        # the plain-id bodies (and the refusals decoded on the way) went inline; text did not
        assert _Counting.inline_answers - before >= 2 * 8

    _run(check)


def test_without_the_key_the_inline_server_refuses_as_asgi() -> None:
    """A missing or wrong key is not answered inline: the ASGI side's 401 is the answer."""

    async def check(servers: _Servers) -> None:
        async with httpx.AsyncClient(timeout=10.0) as client:
            for at in (servers.inline, servers.plain):
                missing = await client.post(f"http://{at}/route", content=_BODIES[0])
                wrong = await client.post(
                    f"http://{at}/route", content=_BODIES[0], headers={"authorization": "Bearer x"}
                )
                assert (missing.status_code, wrong.status_code) == (401, 401)
                assert missing.headers["www-authenticate"].startswith("Bearer")

    _run(check)


def _raw(at: str, data: bytes, *, answers: int) -> list[bytes]:
    """Send ``data`` on one connection; read ``answers`` responses (Content-Length framed)."""
    host, port = at.split(":")
    with socket.create_connection((host, int(port)), timeout=10.0) as sock:
        sock.sendall(data)
        buffer, out = b"", []
        while len(out) < answers:
            while b"\r\n\r\n" not in buffer:
                chunk = sock.recv(65536)
                assert chunk, f"connection closed after {len(out)} answers: {buffer!r}"
                buffer += chunk
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            if head.startswith(b"HTTP/1.1 100 "):  # an interim answer: the real one follows
                continue
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            while len(buffer) < length:
                chunk = sock.recv(65536)
                assert chunk, "connection closed mid-body"
                buffer += chunk
            out.append(head + b"\r\n\r\n" + buffer[:length])
            buffer = buffer[length:]
        if b"connection: close" in out[-1].lower():
            assert sock.recv(1) == b"", "the server kept a closing connection open"
        return out


def _post(path: bytes, body: bytes, *extra: bytes, version: bytes = b"1.1") -> bytes:
    head = [b"POST " + path + b" HTTP/" + version, b"host: test", _AUTH_LINE]
    head += [b"content-length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


_AUTH_LINE = b"authorization: Bearer " + KEY.encode()


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _body(answer: bytes) -> Any:
    return json.loads(answer.partition(b"\r\n\r\n")[2])


@pytest.mark.parametrize("which", ["inline", "plain"])
def test_pipelined_requests_keep_their_order(which: str) -> None:
    """Inline, ASGI-only and inline again, in one write: three answers, in order."""

    async def check(servers: _Servers) -> None:
        at = getattr(servers, which)
        text = json.dumps({"text": "tokenized the slow way"}).encode()
        data = (
            _post(b"/route", _BODIES[0])
            + _post(b"/query", text)
            + b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n"
            + _post(b"/query", _BODIES[1])
        )
        answers = await asyncio.to_thread(_raw, at, data, answers=4)
        assert [_status(a) for a in answers] == [200, 200, 200, 200]
        assert _body(answers[0])["dp_rank"] == 1
        assert _body(answers[1])["prompt_tokens"] == len("tokenized the slow way")
        assert _body(answers[2]) == {"status": "ok"}
        assert len(_body(answers[3])["matches"]) == 2

    _run(check)


@pytest.mark.parametrize("which", ["inline", "plain"])
def test_http_10_chunked_and_100_continue_are_served(which: str) -> None:

    async def check(servers: _Servers) -> None:
        at = getattr(servers, which)
        body = _BODIES[0]
        old = await asyncio.to_thread(_raw, at, _post(b"/route", body, version=b"1.0"), answers=1)
        assert _status(old[0]) == 200 and b"connection: close" in old[0].lower()
        chunks = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        chunked = (
            b"POST /route HTTP/1.1\r\nhost: test\r\n" + _AUTH_LINE + b"\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + chunks
        )
        answered = await asyncio.to_thread(_raw, at, chunked, answers=1)
        assert _status(answered[0]) == 200 and _body(answered[0])["dp_rank"] == 1
        expect = _post(b"/query", body, b"expect: 100-continue")
        answers = await asyncio.to_thread(_raw, at, expect, answers=1)
        assert _status(answers[0]) == 200 and len(_body(answers[0])["matches"]) == 2

    _run(check)


def test_a_connection_stays_usable_after_refusals() -> None:
    """Good, refused (400, 413) and good again on one kept-alive connection, inline."""

    async def check(servers: _Servers) -> None:
        data = b"".join(
            _post(b"/route", body) for body in (_BODIES[0], b"{not json", _BODIES[-1], _BODIES[1])
        )
        answers = await asyncio.to_thread(_raw, servers.inline, data, answers=4)
        assert [_status(a) for a in answers] == [200, 400, 413, 200]

    _run(check)


class _BuggyRouter(Router):
    """A router whose decision code has a bug (a plain ValueError, not a refusal)."""

    def route(self, token_ids: Any, **kwargs: Any) -> Any:
        raise KeyError("an internal bug")


def test_an_unexpected_error_inline_is_a_json_500_and_the_connection_stays(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def go() -> None:
        router = _BuggyRouter(block_size=16)
        router.add_holder(Holder("http://engine", 0))
        at, server, task = await _serve(create_app(RouterService(router, [])), "on")
        try:
            data = _post(b"/route", _BODIES[0]) + _post(b"/query", _BODIES[0])
            answers = await asyncio.to_thread(_raw, at, data, answers=2)
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 20.0)
        assert _status(answers[0]) == 500
        assert _body(answers[0]) == {"error": "internal error: see the router's log"}
        assert _status(answers[1]) == 200  # /query does not route: the same connection
        assert "the router failed answering /route" in caplog.text

    asyncio.run(go())


_LONG_TEXT = json.dumps({"text": "a prompt of text, tokenized by the ASGI side " * 8}).encode()


@pytest.mark.parametrize("body", [_BODIES[0], _LONG_TEXT], ids=["inline", "asgi"])
def test_a_request_arriving_during_shutdown_is_answered_then_closed(body: bytes) -> None:
    """uvicorn's graceful shutdown closes idle connections; one whose inline request's
    body is still arriving gets its answer first, with ``connection: close``, whether it
    is then answered inline or (a text body to tokenize) by the ASGI side."""

    async def go() -> None:
        at, server, task = await _serve(create_app(RouterService(_router(), [])), "on")
        host, port = at.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        whole = _post(b"/route", body)
        writer.write(whole[:-100])
        await writer.drain()
        deadline = asyncio.get_running_loop().time() + 10.0
        while not any(getattr(c, "_inline_path", None) for c in server.server_state.connections):
            assert asyncio.get_running_loop().time() < deadline, "the head never arrived"
            await asyncio.sleep(0.02)  # until the head is in and the body is arriving
        server.should_exit = True
        deadline = asyncio.get_running_loop().time() + 10.0
        while not any(getattr(c, "_close_after", False) for c in server.server_state.connections):
            assert asyncio.get_running_loop().time() < deadline, "the shutdown never told us"
            await asyncio.sleep(0.02)  # until uvicorn's shutdown has reached the connection
        writer.write(whole[-100:])
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10.0)  # to EOF: the server closes
        writer.close()
        await asyncio.wait_for(task, 20.0)
        assert _status(answer) == 200 and b"connection: close" in answer.lower()
        assert _body(answer)["worker"] == "http://engine"

    asyncio.run(go())


@pytest.mark.slow
def test_a_request_read_with_an_inline_one_is_not_cut_off_by_the_keep_alive_timer() -> None:
    """Two requests in one write, the second's last bytes sent after uvicorn's keep-alive
    timeout: the first, answered inline, armed that timer from inside the parser, and the
    second began in the same data; it is answered all the same."""

    async def go() -> None:
        at, server, task = await _serve(create_app(RouterService(_router(), [])), "on")
        server.config.timeout_keep_alive = 0.3  # each new connection reads it
        host, port = at.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            second = _post(b"/query", _BODIES[1])
            writer.write(_post(b"/route", _BODIES[0]) + second[:-10])
            await writer.drain()
            first = await asyncio.wait_for(reader.readuntil(b'"scores"'), 10.0)
            assert _status(first) == 200
            await asyncio.sleep(0.8)  # past the keep-alive timeout
            writer.write(second[-10:])
            await writer.drain()
            rest = await asyncio.wait_for(reader.readuntil(b'"matches"'), 10.0)
            assert b"HTTP/1.1 200 " in rest
        finally:
            writer.close()
            server.should_exit = True
            await asyncio.wait_for(task, 20.0)

    asyncio.run(go())


@pytest.mark.slow
def test_an_idle_connection_is_closed_at_the_keep_alive_timeout_and_a_busy_one_is_not() -> None:
    """The keep-alive timeout is watched by one timer for every connection of the server:
    a connection that goes idle after an inline answer, or after an ASGI one, is closed
    by the server about then; one that sends a request before each timeout stays open
    past many of them, and is closed once it goes idle in turn."""

    async def go() -> None:
        at, server, task = await _serve(create_app(RouterService(_router(), [])), "on")
        server.config.timeout_keep_alive = 0.3  # each new connection reads it
        host, port = at.split(":")
        loop = asyncio.get_running_loop()
        idle_r, idle_w = await asyncio.open_connection(host, int(port))
        busy_r, busy_w = await asyncio.open_connection(host, int(port))
        asgi_r, asgi_w = await asyncio.open_connection(host, int(port))
        try:
            idle_w.write(_post(b"/route", _BODIES[0]))
            assert _status(await asyncio.wait_for(idle_r.readuntil(b'"scores"'), 10.0)) == 200
            went_idle = loop.time()
            asgi_w.write(b"GET /health HTTP/1.1\r\nhost: router\r\n\r\n")  # an ASGI answer
            assert _status(await asyncio.wait_for(asgi_r.readuntil(b"\r\n\r\n"), 10.0)) == 200
            for i in range(6):  # 0.9 s in all, three keep-alive timeouts
                busy_w.write(_post(b"/query", _BODIES[i % 2]))
                answer = await asyncio.wait_for(busy_r.readuntil(b'"matches"'), 10.0)
                assert b"HTTP/1.1 200 " in answer
                busy_idle = loop.time()
                await asyncio.sleep(0.15)
            rest = await asyncio.wait_for(idle_r.read(), 10.0)  # EOF: closed by the server
            assert b"HTTP/1.1" not in rest and idle_r.at_eof()
            assert b"HTTP/1.1" not in await asyncio.wait_for(asgi_r.read(), 10.0)
            assert asgi_r.at_eof()
            assert busy_idle - went_idle > 0.6  # the busy one outlived the idle one's timeout
            await asyncio.wait_for(busy_r.read(), 10.0)
            assert busy_r.at_eof()
            assert 0.25 <= loop.time() - busy_idle < 3.0
        finally:
            idle_w.close()
            busy_w.close()
            asgi_w.close()
            server.should_exit = True
            await asyncio.wait_for(task, 20.0)

    asyncio.run(go())


def test_an_upgrade_request_is_left_to_uvicorn() -> None:
    """A POST to /route that asks to upgrade the connection (a WebSocket) is uvicorn's
    to decide, not answered inline (uvicorn's upgrade reads what its own header handling
    sets): both servers answer it alike, and none of it inline."""

    async def check(servers: _Servers) -> None:
        before = _Counting.inline_answers
        data = _post(
            b"/route",
            _BODIES[0],
            b"connection: Upgrade",
            b"upgrade: websocket",
            b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==",
            b"sec-websocket-version: 13",
        )
        ours, theirs = [
            (await asyncio.to_thread(_raw, at, data, answers=1))[0]
            for at in (servers.inline, servers.plain)
        ]
        assert _status(ours) == _status(theirs)  # the body is the upgrade's: not read
        assert _body(ours) == _body(theirs)
        assert _Counting.inline_answers == before

    _run(check)


def test_an_answer_held_to_the_round_end_still_precedes_the_400_behind_it() -> None:
    """A good request and an unparsable one in one write: uvicorn writes its 400 and
    closes while the inline answer is still held (:mod:`kvevents.http.held_writes`); the
    client reads the 200 first, then the 400, then the end of the connection. (uvicorn's
    own protocol answers only the 400 here: its ASGI task had not written the 200 yet.)"""

    async def check(servers: _Servers) -> None:
        data = _post(b"/route", _BODIES[0]) + b"NOT HTTP AT ALL\r\n\r\n"
        answers = await asyncio.to_thread(_raw, servers.inline, data, answers=2)
        assert [_status(a) for a in answers] == [200, 400]
        assert _body(answers[0])["dp_rank"] == 1

    _run(check)


@pytest.mark.parametrize("hold", ["1", "0"])
def test_inline_answers_are_held_unless_switched_off(
    hold: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KVEVENTS_HOLD_WRITES=0``: the connection writes at once (no wrapper); either
    way the answers are the same."""
    monkeypatch.setenv("KVEVENTS_HOLD_WRITES", hold)

    async def go() -> None:
        at, server, task = await _serve(create_app(RouterService(_router(), [])), "on")
        host, port = at.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(_post(b"/route", _BODIES[0]) + _post(b"/query", _BODIES[1]))
            await writer.drain()
            data = b""
            while data.count(b"HTTP/1.1 200 ") < 2 or not data.endswith(b"}"):
                chunk = await asyncio.wait_for(reader.read(65536), 10.0)
                assert chunk, f"closed after {data!r}"
                data += chunk
            transports = [c.transport for c in server.server_state.connections]
        finally:
            writer.close()
            server.should_exit = True
            await asyncio.wait_for(task, 20.0)
        assert [isinstance(t, HeldWrites) for t in transports] == [hold == "1"]
        first, second = data.split(b"HTTP/1.1 ")[1:]
        assert _body(b"HTTP/1.1 " + first)["dp_rank"] == 1
        assert len(_body(b"HTTP/1.1 " + second)["matches"]) == 2

    asyncio.run(go())


class _LaterApp:
    """An app answering ``/coroutine`` with a coroutine and ``/future`` with a future it
    resolves on the loop's next round; a body of ``fail`` makes either raise. Through
    ASGI (a request pipelined behind one still being answered) it answers alike, with
    ``x-via: asgi``."""

    inline_paths = frozenset({b"/never"})
    async_inline_paths = frozenset({b"/coroutine", b"/future"})
    inline_limit = LIMIT

    def answer_inline(self, path: bytes, headers: Any, body: bytes) -> None:
        return None

    def answer_async_inline(self, path: bytes, headers: Any, body: bytes) -> Awaitable[Any]:
        answer = (201, [(b"content-type", b"text/plain"), (b"x-via", path)], b"later:" + body)
        if path == b"/coroutine":

            async def compute() -> Any:
                await asyncio.sleep(0)
                if body == b"fail":
                    raise KeyError("an internal bug")
                return answer

            return compute()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if body == b"fail":
            asyncio.get_running_loop().call_soon(future.set_exception, KeyError("a bug"))
        else:
            asyncio.get_running_loop().call_soon(future.set_result, answer)
        return future

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        answer = b"later:" + body
        headers = [(b"x-via", b"asgi"), (b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


@pytest.mark.parametrize("path", [b"/coroutine", b"/future"])
def test_an_answer_to_come_is_written_whole_from_a_coroutine_or_a_future(
    path: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Two requests in one write: the first answered from the app's coroutine or future,
    the second (pipelined behind it) by ASGI, in order; then one that fails is
    uvicorn's plain 500, logged, and the connection closes."""

    async def go() -> None:
        at, server, task = await _serve(_LaterApp(), "off")
        try:
            data = _post(path, b"one") + _post(path, b"two")
            answers = await asyncio.to_thread(_raw, at, data, answers=2)
            assert [_status(a) for a in answers] == [201, 201]
            assert [a.partition(b"\r\n\r\n")[2] for a in answers] == [b"later:one", b"later:two"]
            assert b"x-via: " + path in answers[0] and b"x-via: asgi" in answers[1]
            failed = await asyncio.to_thread(_raw_to_end, at, _post(path, b"fail"))
            assert _status(failed) == 500 and b"connection: close" in failed.lower()
            assert "the app failed answering a request" in caplog.text
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 20.0)

    asyncio.run(go())


def _raw_to_end(at: str, data: bytes) -> bytes:
    """Send ``data`` on one connection and read until the server closes it."""
    host, port = at.split(":")
    with socket.create_connection((host, int(port)), timeout=10.0) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


class _RaisingApp:
    """An app whose inline answers raise at once: ``/sync`` from ``answer_inline``,
    ``/async`` from ``answer_async_inline`` (before any answer to come is made)."""

    inline_paths = frozenset({b"/sync"})
    async_inline_paths = frozenset({b"/async"})
    inline_limit = LIMIT

    def answer_inline(self, path: bytes, headers: Any, body: bytes) -> None:
        raise KeyError("a bug answering inline")

    def answer_async_inline(self, path: bytes, headers: Any, body: bytes) -> None:
        raise KeyError("a bug before the answer to come")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("every request here is answered inline")


@pytest.mark.parametrize("path", [b"/sync", b"/async"])
def test_an_app_that_raises_inline_is_a_logged_500_and_the_connection_closes(
    path: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception out of the app's inline answer is not the parser's: the client gets
    uvicorn's plain 500 with ``connection: close`` (not a 400 for its request), and the
    error is logged with its traceback."""

    async def go() -> None:
        at, server, task = await _serve(_RaisingApp(), "off")
        try:
            answer = await asyncio.to_thread(_raw_to_end, at, _post(path, b"{}"))
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 20.0)
        assert _status(answer) == 500 and b"connection: close" in answer.lower()
        assert answer.endswith(b"Internal Server Error")
        assert "the app failed answering a request" in caplog.text and "KeyError" in caplog.text

    asyncio.run(go())
