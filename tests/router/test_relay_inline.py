"""The relay answered from uvicorn's parser callbacks answers exactly as through ASGI.

A completions body whose prompt is one list of token ids, not asking for a stream, is
relayed by a coroutine the inline protocol runs (:mod:`kvevents.http.inline`,
:meth:`OpenAIRelay.inline`), its answer written whole. Two real uvicorn servers on
loopback serve one router service in front of a fake engine: one through the inline
protocol, one through uvicorn's own (the same app behind a plain ASGI function). Raw
sockets check pipelining order, a client that leaves before its answer, and a shutdown
while an answer is on its way.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Literal

import httpx
import pytest
from openai_support import FakeEngine
from upstream_support import Script, Server, serving

from kvevents import Holder, Router, kernels
from kvevents.http.auth import ApiKey
from kvevents.http.inline import AsyncInlineApp, protocol_for
from kvevents.http.serving import bind_http, start_http
from kvevents.router.serve.app import create_app
from kvevents.router.serve.hot_path import HotPath
from kvevents.router.serve.openai_relay import OpenAIRelay
from kvevents.router.serve.relay_stream import until_gone
from kvevents.router.serve.service import RouterService
from kvevents.subscribe.engine_spec import EngineSpec
from kvevents.wire.hashing import content_keys

BS = 4
PROMPT = list(range(500, 540))
TIMEOUT = 10.0


@pytest.fixture(scope="module", autouse=True)
def compiled() -> kernels.Kernels:
    loaded = kernels.load()  # the inline relay takes token prompts the kernels read
    assert loaded is not None, f"the kernels did not load: {kernels.status()}"
    return loaded


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    fake = FakeEngine()
    yield fake
    fake.close()


class _Counting(HotPath):
    """The router's hot path, counting the requests it relayed inline."""

    relayed_inline = 0

    def answer_async_inline(self, *args: Any) -> Any:
        pending = super().answer_async_inline(*args)
        if pending is not None:
            type(self).relayed_inline += 1
        return pending


class _Plane:
    def __init__(self, service: RouterService, inline: str, plain: str, server: Any) -> None:
        self.service, self.inline, self.plain, self.server = service, inline, plain, server

    def inflight(self) -> int:
        return sum(load.inflight_requests for load in self.service.router.loads.values())


async def _serve(app: Any, lifespan: Literal["on", "off"]) -> tuple[str, Any, Any]:
    sock = bind_http("127.0.0.1", 0, "test server")
    server, task = await start_http(app, sock, lifespan=lifespan)
    return f"127.0.0.1:{sock.getsockname()[1]}", server, task


def _run(
    engine: FakeEngine,
    kind: str,
    check: Callable[[_Plane], Awaitable[None]],
    router_class: type[Router] = Router,
    api_key: ApiKey | None = None,
) -> None:
    async def go() -> None:
        router = router_class(block_size=BS)
        spec = EngineSpec.create(
            engine.url, kv_endpoint="tcp://127.0.0.1:5999", dp_size=2, kind=kind, block_size=BS
        )
        service = RouterService(router, [spec], load_interval=60.0)
        router.index.store_keys(Holder(engine.url, 1), content_keys(PROMPT, BS))
        built = create_app(service, api_key=api_key)
        hot = _Counting(service, built.fallback, open_paths=built.open_paths, api_key=api_key)
        assert isinstance(hot, AsyncInlineApp) and protocol_for(hot, "httptools") != "httptools"

        async def plain(scope: Any, receive: Any, send: Any) -> None:  # no inline answer
            await hot(scope, receive, send)

        inline_at, s1, t1 = await _serve(hot, "on")  # the service starts and stops once
        plain_at, s2, t2 = await _serve(plain, "off")
        try:
            await check(_Plane(service, inline_at, plain_at, s1))
        finally:
            s1.should_exit = s2.should_exit = True
            await asyncio.wait_for(asyncio.gather(t1, t2), 20.0)

    asyncio.run(go())


def _bodies() -> list[bytes]:
    ids = {"model": "m", "prompt": PROMPT, "max_tokens": 1}
    return [
        json.dumps(ids).encode(),
        json.dumps({**ids, "routed_dp_rank": 0}).encode(),  # rewritten, not appended to
        json.dumps({**ids, "data_parallel_rank": 0}).encode(),
        json.dumps({**ids, "fail_status": 503}).encode(),  # the engine's error, relayed
        json.dumps({**ids, "stream": True}).encode(),  # a stream: the ASGI path
        json.dumps({"prompt": "w1 w2 w3", "max_tokens": 1}).encode(),  # text: the ASGI path
        json.dumps({**ids, "prompt": [[*PROMPT, 7], PROMPT[:9]]}).encode(),  # a batch: ASGI
        b'{"prompt": [1, -2]}',  # refused in the whole decode's words
        b"{not json",
    ]


_SHOWN = ("content-type", "x-kvevents-worker", "x-kvevents-dp-rank", "x-kvevents-matched-tokens")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_inline_relay_answers_and_forwards_as_the_asgi_relay(engine: FakeEngine, kind: str) -> None:
    """Same status, answer and decision headers both ways, and the engine receives the
    same request (body, rank header) both ways."""

    async def check(plane: _Plane) -> None:
        before = _Counting.relayed_inline
        engine.release()  # its streams run to the end at once
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            for raw in _bodies():
                seen = []
                for at in (plane.inline, plane.plain):
                    answer = await client.post(
                        f"http://{at}/v1/completions",
                        content=raw,
                        headers={"content-type": "application/json", "x-trace": "t1"},
                    )
                    sent = engine.received[-1] if engine.received else None
                    shown = tuple(answer.headers.get(h) for h in _SHOWN)
                    seen.append((answer.status_code, answer.content, shown, sent))
                    engine.received.clear()
                assert seen[0][:3] == seen[1][:3], raw
                if seen[0][3] is not None:
                    (h1, b1), (h2, b2) = seen[0][3], seen[1][3]
                    assert b1 == b2 and h1.get("x-trace") == h2.get("x-trace") == "t1"
                    assert h1.get("x-data-parallel-rank") == h2.get("x-data-parallel-rank")
        assert _Counting.relayed_inline - before == 4  # the first four bodies
        assert plane.inflight() == 0

    _run(engine, kind, check)


def _post(path: bytes, body: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (path, len(body), body)
    )


def _raw(at: str, data: bytes, answers: int) -> list[bytes]:
    """Send ``data`` in one write; read ``answers`` whole HTTP answers (content-length)."""
    host, port = at.split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(data)
        buffer, out = b"", []
        while len(out) < answers:
            head, sep, rest = buffer.partition(b"\r\n\r\n")
            if sep:
                length = next(
                    int(line.split(b":")[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                )
                if len(rest) >= length:
                    out.append(head + sep + rest[:length])
                    buffer = rest[length:]
                    continue
            chunk = sock.recv(65536)
            assert chunk, f"the server closed after {len(out)} of {answers} answers"
            buffer += chunk
        return out


def _body(answer: bytes) -> Any:
    return json.loads(answer.partition(b"\r\n\r\n")[2])


@pytest.mark.slow
def test_pipelined_requests_around_a_relayed_one_keep_their_order(engine: FakeEngine) -> None:
    """A slow relayed completion, then /route, /health and another completion, in one
    write: four answers, in the order asked, the requests behind it waiting for it."""

    async def check(plane: _Plane) -> None:
        slow = json.dumps({"prompt": PROMPT, "max_tokens": 1, "delay_s": 0.5}).encode()
        fast = json.dumps({"prompt": PROMPT[:8], "max_tokens": 1}).encode()
        data = (
            _post(b"/v1/completions", slow)
            + _post(b"/route", json.dumps({"input_ids": PROMPT}).encode())
            + b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n"
            + _post(b"/v1/completions", fast)
        )
        answers = await asyncio.to_thread(_raw, plane.inline, data, 4)
        assert [int(a.split(b" ", 2)[1]) for a in answers] == [200, 200, 200, 200]
        assert _body(answers[0])["object"] == "text_completion"
        assert _body(answers[1])["dp_rank"] == 1
        assert _body(answers[2]) == {"status": "ok"}
        assert b"x-kvevents-prompt-tokens: 8" in answers[3]
        assert plane.inflight() == 0

    _run(engine, "sglang", check)


async def _forwarded_slow_completion(
    plane: _Plane,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, float]:
    """A completion the engine answers 0.5 s late, sent on a connection of its own; back
    once the router has forwarded it (with the connection and a deadline for the test)."""
    slow = json.dumps({"prompt": PROMPT, "max_tokens": 1, "delay_s": 0.5}).encode()
    host, port = plane.inline.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(_post(b"/v1/completions", slow))
    await writer.drain()
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while plane.inflight() == 0:  # forwarded, the engine not answered yet
        assert asyncio.get_running_loop().time() < deadline, "never forwarded"
        await asyncio.sleep(0.01)
    return reader, writer, deadline


@pytest.mark.slow
def test_a_client_leaving_before_its_answer_ends_the_request(engine: FakeEngine) -> None:
    """The engine's answer comes after the client left: nothing is written, the request
    leaves the in-flight count, and the server goes on answering."""

    async def check(plane: _Plane) -> None:
        _reader, writer, deadline = await _forwarded_slow_completion(plane)
        writer.close()
        while plane.inflight() != 0:
            assert asyncio.get_running_loop().time() < deadline, "the request never ended"
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            answer = await client.post(
                f"http://{plane.inline}/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 1},
            )
        assert answer.status_code == 200 and answer.headers["x-kvevents-dp-rank"] == "1"

    _run(engine, "sglang", check)


@pytest.mark.parametrize("text", [False, True], ids=["token-prompt", "text-prompt"])
def test_a_relayed_request_cancelled_while_the_engine_answers_leaves_the_count(
    engine: FakeEngine, text: bool
) -> None:
    """The relay's answer cancelled (a forced shutdown, a caller's own timeout) while it
    waits for the engine's: the request leaves the in-flight count, whichever way its
    prompt was read."""

    async def check(plane: _Plane) -> None:
        relay = OpenAIRelay(plane.service, max_body_bytes=1 << 20)
        prompt: Any = " ".join(f"w{t}" for t in PROMPT) if text else PROMPT
        raw = json.dumps({"prompt": prompt, "max_tokens": 1, "delay_s": 2.0}).encode()
        answering = asyncio.ensure_future(relay.answer(False, {}, raw))
        deadline = asyncio.get_running_loop().time() + TIMEOUT
        while plane.inflight() != 1:
            assert asyncio.get_running_loop().time() < deadline, "the request never began"
            await asyncio.sleep(0.02)
        answering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await answering
        assert plane.inflight() == 0

    _run(engine, "sglang", check)


@pytest.mark.slow
def test_a_shutdown_while_the_engine_answers_gets_the_answer_then_closes(
    engine: FakeEngine,
) -> None:
    """uvicorn's graceful shutdown waits for the relayed answer, which says
    ``connection: close``, and the connection then closes."""

    async def check(plane: _Plane) -> None:
        reader, writer, _ = await _forwarded_slow_completion(plane)
        plane.server.should_exit = True
        answer = await asyncio.wait_for(reader.read(), TIMEOUT)  # to EOF: the server closes
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert b"connection: close" in answer.lower()
        assert _body(answer)["object"] == "text_completion"

    _run(engine, "sglang", check)


class _BuggyRouter(Router):
    """A router whose decision code has a bug (a plain KeyError, not a refusal)."""

    def route(self, tokens: Any, **kwargs: Any) -> Any:
        raise KeyError("an internal bug")

    route_batch = route


def test_an_unexpected_error_is_uvicorns_500_and_the_connection_closes(
    engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in the relay answers as uvicorn answers an ASGI app that raised: a plain
    500, then the connection closes; the error is logged."""

    async def check(plane: _Plane) -> None:
        raw = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
        answers = []
        for at in (plane.inline, plane.plain):
            host, port = at.split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(_post(b"/v1/completions", raw))
            await writer.drain()
            answers.append(await asyncio.wait_for(reader.read(), TIMEOUT))  # to EOF
            writer.close()
        for answer in answers:
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 500 ") and b"connection: close" in head.lower()
            assert body == b"Internal Server Error"
        assert "an internal bug" in caplog.text

    _run(engine, "sglang", check, router_class=_BuggyRouter)


def test_without_the_key_the_relay_refuses_as_asgi_and_with_it_relays_inline(
    engine: FakeEngine,
) -> None:
    """With ``--api-key``, a completion without the key is refused (the ASGI path writes
    the 401) and never reaches the engine; with it, it is relayed inline."""

    async def check(plane: _Plane) -> None:
        before = _Counting.relayed_inline
        engine.received.clear()
        body = {"prompt": PROMPT, "max_tokens": 1}
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            url = f"http://{plane.inline}/v1/completions"
            refused = await client.post(url, json=body)
            wrong = await client.post(url, json=body, headers={"authorization": "Bearer no"})
            assert refused.status_code == wrong.status_code == 401
            assert not engine.received and _Counting.relayed_inline == before
            answer = await client.post(url, json=body, headers={"authorization": "Bearer k1"})
        assert answer.status_code == 200 and answer.headers["x-kvevents-dp-rank"] == "1"
        assert _Counting.relayed_inline == before + 1 and len(engine.received) == 1
        assert "authorization" not in engine.received[0][0]  # the client's key stays here

    _run(engine, "vllm", check, api_key=ApiKey("k1"))


def test_a_stream_left_to_the_asgi_path_is_decoded_once(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The inline check reads a ``"stream": true`` body, leaves it to the ASGI relay,
    and that relay takes the same decode instead of reading the body again; its stream
    is the plain server's. A stream that arrives straight on the ASGI path (the plain
    server) is decoded once too."""
    import kvevents.router.serve.openai_relay as relay_module

    calls: list[bytes] = []
    real = relay_module.token_prompt

    def counting(raw: bytes) -> Any:
        calls.append(raw)
        return real(raw)

    monkeypatch.setattr(relay_module, "token_prompt", counting)
    body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 2, "stream": True}).encode()

    async def check(plane: _Plane) -> None:
        engine.release()
        streams = []
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            for at in (plane.inline, plane.plain):
                calls.clear()
                answer = await client.post(
                    f"http://{at}/v1/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                )
                assert answer.status_code == 200 and b"data: [DONE]" in answer.content
                assert calls == [body], at
                streams.append(answer.content)
        assert streams[0] == streams[1]
        assert plane.service.router.loads and plane.inflight() == 0

    _run(engine, "sglang", check)


def test_a_relay_on_a_kept_alive_engine_connection_runs_no_task(engine: FakeEngine) -> None:
    """Relayed inline, a completion is answered from callbacks: the first opens the
    engine's connection (one task, for the connect) unless a load poll already did, the
    ones after reuse it and create no task at all, neither for the client's answer nor
    for the engine's."""

    async def check(plane: _Plane) -> None:
        loop = asyncio.get_running_loop()
        created: list[str] = []

        def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
            created.append(getattr(coro, "__qualname__", repr(coro)))
            return asyncio.Task(coro, loop=loop, **kwargs)

        raw = _bodies()[0]
        loop.set_task_factory(counting)
        try:
            first = await asyncio.to_thread(_raw, plane.inline, _post(b"/v1/completions", raw), 1)
            opened = list(created)
            created.clear()
            more = _post(b"/v1/completions", raw) * 3
            after = await asyncio.to_thread(_raw, plane.inline, more, 3)
        finally:
            loop.set_task_factory(None)
        assert [int(a.split(b" ", 2)[1]) for a in [*first, *after]] == [200] * 4
        assert _body(after[-1])["usage"]["prompt_tokens"] == 10
        ours = ("Upstream.", "OpenAIRelay.", "HttpToolsProtocol.")  # qualnames: nested ones too

        def relaying(names: list[str]) -> list[str]:
            return [name for name in names if any(part in name for part in ours)]

        # the engine's load polls share the client: one may have opened the connection
        assert relaying(opened) in ([], ["Upstream._connect_then_send"])
        assert relaying(created) == []
        assert plane.inflight() == 0

    _run(engine, "sglang", check)


@pytest.mark.slow
def test_a_stream_a_client_stops_reading_leaves_the_count_when_the_engine_is_done() -> None:
    """A streamed completion whose client stops reading (its socket open): the relay
    stops reading the engine too, and once the engine's side ends (here the forward
    timeout) the request leaves the in-flight count, though the client still holds
    its stream. Before, it stayed counted as long as the client's socket lived."""

    def make(server: Server) -> Script:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            while True:
                head = (await server.request(r), server.requests[-1][0])[1]
                if head.startswith(b"GET /health "):
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    continue
                if not head.startswith(b"POST /v1/completions"):
                    w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
                w.write(b"transfer-encoding: chunked\r\n\r\n")
                event = b"data: " + b"x" * 65_000 + b"\n\n"
                for _ in range(1024):  # far more than the sockets between hold
                    w.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await w.drain()

        return serve

    async def go() -> None:
        async with serving(make) as engine:
            router = Router(block_size=BS)
            spec = EngineSpec.create(
                engine.url, kv_endpoint="tcp://127.0.0.1:5999", dp_size=2, kind="vllm"
            )
            service = RouterService(router, [spec], load_interval=60.0, forward_timeout=1.0)
            at, server, task = await _serve(create_app(service), "on")
            host, port = at.split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                body = json.dumps({"prompt": PROMPT, "max_tokens": 1, "stream": True}).encode()
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                    b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
                inflight = lambda: sum(x.inflight_requests for x in router.loads.values())  # noqa: E731
                assert inflight() == 1
                deadline = asyncio.get_running_loop().time() + TIMEOUT
                while inflight() != 0:  # the client reads nothing more meanwhile
                    assert asyncio.get_running_loop().time() < deadline, "still counted"
                    await asyncio.sleep(0.05)
                assert not writer.is_closing()
            finally:
                writer.close()
                server.should_exit = True
                await asyncio.wait_for(task, 20.0)

    asyncio.run(go())


async def _relay_that_fails(starts: bool) -> list[str]:
    """What released the stream when the relay fails, having read it (``starts``) or not."""
    released: list[str] = []

    async def stream() -> Any:
        try:
            yield b"chunk"
        finally:
            released.append("by the stream")

    chunks = stream()

    async def relay() -> None:
        if starts:
            async for _ in chunks:
                pass
        raise OSError("the client is gone")

    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    await until_gone(relay(), gone, chunks, lambda: released.append("by the answer"))
    return released


def test_a_stream_the_relay_never_started_is_released_all_the_same() -> None:
    """The relay failing before it reads the engine's stream (a server refusing to start
    the answer for a client already gone): the stream generator never ran its cleanup,
    so the answer's own release frees the engine connection (and with it the request's
    in-flight count); after a stream that ran, that release is a second call, which
    :meth:`Response.release <kvevents.http.upstream_answers.Response.release>` ignores."""
    assert asyncio.run(_relay_that_fails(starts=False)) == ["by the answer"]
    assert asyncio.run(_relay_that_fails(starts=True)) == ["by the stream", "by the answer"]
