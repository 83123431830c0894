"""The P/D relay answered from uvicorn's parser callbacks answers exactly as through ASGI.

A disaggregated request whose answer is written whole (no stream asked for) is relayed
by a coroutine the inline protocol runs (:mod:`kvevents.http.inline`,
:meth:`PDRelay.inline_path`), its legs spliced into the client's bytes when its body
allows (:mod:`kvevents.router.serve.pd_body`). Two real uvicorn servers on loopback
serve one router service in P/D mode in front of a fake prefill and a fake decode
engine (:mod:`pd_support`, one rank each, so every choice is the same both ways): one
through the inline protocol, one through uvicorn's own (the same app behind a plain
ASGI function). Both must answer the same, and the engines receive the same legs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from pd_support import FakePD, Handoffs

from kvevents import Holder, Router, kernels
from kvevents.http.inline import AsyncInlineApp, protocol_for
from kvevents.http.serving import bind_http, start_http
from kvevents.router.serve import pd_read
from kvevents.router.serve.app import create_app
from kvevents.router.serve.pd_mode import PDEngine, PDMode
from kvevents.router.serve.pd_relay import PDRelay
from kvevents.router.serve.service import RouterService
from kvevents.subscribe.engine_spec import EngineSpec
from kvevents.transport.endpoints import free_port_range

BS = 4
PROMPT = list(range(700, 740))
TIMEOUT = 10.0
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def compiled() -> kernels.Kernels:
    loaded = kernels.load()  # plain bodies are read with the kernels' parser
    assert loaded is not None, f"the kernels did not load: {kernels.status()}"
    return loaded


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakePD, FakePD]]:
    handoffs = Handoffs()
    prefill, decode = FakePD("prefill", handoffs), FakePD("decode", handoffs)
    yield prefill, decode
    prefill.close()
    decode.close()


class _Plane:
    def __init__(self, service: RouterService, inline: str, plain: str) -> None:
        self.service, self.inline, self.plain = service, inline, plain

    def inflight(self) -> int:
        return sum(load.inflight_requests for load in self.service.router.loads.values())


async def _serve(app: Any, lifespan: str) -> tuple[str, Any, Any]:
    sock = bind_http("127.0.0.1", 0, "test server")
    server, task = await start_http(app, sock, lifespan=lifespan)  # type: ignore[arg-type]
    return f"127.0.0.1:{sock.getsockname()[1]}", server, task


def _run(
    fakes: tuple[FakePD, FakePD], protocol: str, check: Callable[[_Plane], Awaitable[None]]
) -> None:
    prefill, decode = fakes
    kind = "vllm" if protocol == "vllm" else "sglang"

    async def go() -> None:
        router = Router(block_size=BS)
        specs = [
            EngineSpec.create(
                url,
                kv_endpoint=f"tcp://127.0.0.1:{free_port_range(1)}",
                dp_size=1,
                kind=kind,
                block_size=BS,
            )
            for url in (prefill.url, decode.url)
        ]
        for spec in specs:
            router.add_holder(Holder(spec.worker, 0), block_size=BS)
        pools = (PDEngine(specs[0].url, specs[0].worker, "prefill"),)
        pools += (PDEngine(specs[1].url, specs[1].worker, "decode"),)
        pd = PDMode(list(pools), protocol, max_local_prefill_tokens=0)  # type: ignore[arg-type]
        service = RouterService(router, specs, load_interval=60.0, pd=pd)
        hot = create_app(service)
        assert isinstance(hot, AsyncInlineApp) and protocol_for(hot, "httptools") != "httptools"

        async def plain(scope: Any, receive: Any, send: Any) -> None:  # no inline answer
            await hot(scope, receive, send)

        inline_at, s1, t1 = await _serve(hot, "on")  # the service starts and stops once
        plain_at, s2, t2 = await _serve(plain, "off")
        try:
            await check(_Plane(service, inline_at, plain_at))
        finally:
            s1.should_exit = s2.should_exit = True
            await asyncio.wait_for(asyncio.gather(t1, t2), 20.0)

    for fake in fakes:
        fake.received.clear()
    asyncio.run(go())


def _requests() -> list[tuple[str, bytes, bool]]:
    """``(path, body, relayed inline)`` of every kind of body the relay reads."""
    ids = {"model": "m", "prompt": PROMPT, "max_tokens": 1}
    gen = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
    completions: list[tuple[Any, bool]] = [
        (ids, True),  # plain: legs spliced
        ({**ids, "stream": False, "n": 2}, True),  # spliced, a room per sample
        ({**ids, "routed_dp_rank": 0}, True),  # read plain, legs rebuilt
        ({**ids, "prompt": [PROMPT, PROMPT[:8]]}, True),  # a batch: decoded whole
        ({**ids, "stream": True}, False),  # a stream: the ASGI path
        (b'{"prompt": [1, -2]}', True),  # refused in the whole decode's words, whole
        (b"{not json", False),  # refused by the ASGI path
    ]
    generates: list[tuple[Any, bool]] = [
        (gen, True),
        ({**gen, "return_logprob": True}, True),  # the prefill's logprobs merged in
        ({**gen, "input_ids": [PROMPT, PROMPT[:8]]}, True),  # a batch
    ]
    out = []
    for path, bodies in (("/v1/completions", completions), ("/generate", generates)):
        for body, inline in bodies:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            out.append((path, raw, inline))
    return out


_SHOWN = (
    "content-type",
    "x-kvevents-worker",
    "x-kvevents-dp-rank",
    "x-kvevents-prefill",
    "x-kvevents-prefill-worker",
    "x-kvevents-prefill-dp-rank",
    "x-kvevents-uncached-tokens",
    "x-kvevents-prompt-tokens",
)


def _answer(content: bytes) -> Any:
    """An answer with the router's figures that change request by request left out."""
    try:
        answer = json.loads(content)
    except ValueError:
        return content
    routed = answer.get("router") if isinstance(answer, dict) else None
    if isinstance(routed, dict):
        for pool in ("decode", "prefill"):
            if isinstance(routed.get(pool), dict):
                routed[pool] = {k: routed[pool][k] for k in ("worker", "dp_rank")}
    return answer


def _legs(fakes: tuple[FakePD, FakePD]) -> list[Any]:
    """What each engine received (path, the client's trace header, body without its
    room or vLLM request id, new per request), and the legs' rooms agreeing."""
    out = []
    rooms = set()
    for fake in fakes:
        for path, headers, body in fake.received:
            room = body.pop("bootstrap_room", None)
            params = body.get("kv_transfer_params")
            if isinstance(params, dict):
                params.pop("remote_request_id", None)
            if room is not None:
                rooms.add(json.dumps(room))
            out.append((fake.role, path, headers.get("x-trace"), body))
        fake.received.clear()
    assert len(rooms) <= 1, rooms  # both legs of the request joined by the same room(s)
    return out


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_inline_pd_relay_answers_and_sends_legs_as_the_asgi_relay(
    fakes: tuple[FakePD, FakePD], protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same status, answer and decision headers both ways, the engines receive the same
    legs both ways, and exactly the bodies whose answer is written whole go inline."""
    inline: list[str] = []
    real = PDRelay.inline_path

    def counting(self: PDRelay, path: bytes, headers: Any, raw: bytes) -> Any:
        pending = real(self, path, headers, raw)
        if pending is not None:
            inline.append(path.decode())
        return pending

    monkeypatch.setattr(PDRelay, "inline_path", counting)

    async def check(plane: _Plane) -> None:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            want_inline = 0
            for path, raw, goes_inline in _requests():
                if protocol == "vllm" and path == "/generate":
                    goes_inline = raw.startswith(b"{")  # its 501, written whole
                want_inline += goes_inline
                seen = []
                for at in (plane.inline, plane.plain):
                    answer = await client.post(
                        f"http://{at}{path}",
                        content=raw,
                        headers={"content-type": "application/json", "x-trace": "t1"},
                    )
                    shown = tuple(answer.headers.get(h) for h in _SHOWN)
                    seen.append((answer.status_code, _answer(answer.content), shown))
                    seen.append(await asyncio.to_thread(_legs, fakes))
                assert seen[0] == seen[2] and seen[1] == seen[3], (raw, seen)
                if path == "/v1/completions" and raw.startswith(b'{"model"'):
                    assert seen[0][0] == 200, seen[0]
            assert len(inline) == want_inline, inline
        assert plane.inflight() == 0

    _run(fakes, protocol, check)


def test_a_pd_stream_left_to_the_asgi_path_is_read_once(
    fakes: tuple[FakePD, FakePD], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The inline check reads a ``"stream": true`` body, leaves it to the ASGI path, and
    that path takes the same read instead of reading the body again; both servers relay
    the decode's stream alike."""
    calls: list[bytes] = []
    real = pd_read.plain_request

    def counting(endpoint: Any, raw: bytes) -> Any:
        calls.append(raw)
        return real(endpoint, raw)

    monkeypatch.setattr(pd_read, "plain_request", counting)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2, "stream": True}).encode()

    async def check(plane: _Plane) -> None:
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
        assert plane.inflight() == 0

    _run(fakes, "sglang", check)
