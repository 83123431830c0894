"""The router's HTTP application: :class:`RouterService` (what feeds the router) and its routes.

The endpoints are listed in :mod:`kvevents.router.service` (the ``kvevents router``
command); the OpenAI endpoints live in :mod:`kvevents.router.openai`, engine polling in
:mod:`kvevents.router.engines`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvevents.engine_spec import EngineSpec
from kvevents.errors import SubscriberStateError
from kvevents.router.core import POLICIES, Router
from kvevents.router.engines import EngineState, watch_engine
from kvevents.router.metrics import make_registry, render
from kvevents.router.openai import add_openai_routes
from kvevents.router.request_stats import RequestStats, engine_usage
from kvevents.router.tokenize import (
    ByteTextTokenizer,
    ChatError,
    EndpointTokenizer,
    TextTokenizer,
    TokenizeError,
)
from kvevents.signals import Holder
from kvevents.subscriber import Subscriber

__all__ = ["BadRequest", "RouterService", "TokensBody", "create_app"]

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]


class TokensBody(msgspec.Struct):
    """A request given as token ids, text or chat messages (unknown keys are ignored).

    ``messages`` are rendered as ``/v1/chat/completions`` renders them (the body's
    template fields included), so a gateway asking ``/route`` about a chat gets the rank
    the chat endpoint would choose.
    """

    input_ids: list[TokenId] | None = None
    text: str | None = None
    messages: list[Any] | None = None
    lora: str | None = None
    cache_salt: str | None = None
    record: bool = False
    """``/route`` only: count the choice as sent (the caller forwards the request)."""


_TOKENS_DECODER = msgspec.json.Decoder(TokensBody)


class BadRequest(Exception):
    """A request body the router cannot use; answered with 400."""


class TokenizeFailed(Exception):
    """Tokenizing failed (the engine's /tokenize is down, or refused); answered with ``status``."""

    def __init__(self, error: TokenizeError) -> None:
        super().__init__(str(error))
        self.status = error.status


class RouterService:
    """The router plus what feeds it: the subscriber, the engine pollers, an HTTP client.

    ``engines``: URLs (discovered) or :class:`~kvevents.engine_spec.EngineSpec` values.
    The subscriber is the caller's (``build_service`` adds every spec's streams to it).
    """

    def __init__(
        self,
        router: Router,
        engines: Sequence[str | EngineSpec],
        *,
        subscriber: Subscriber | None = None,
        load_interval: float = 0.5,
        forward_timeout: float = 600.0,
        tokenizer: TextTokenizer | None = None,
        policy: str = "kv-aware",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.router = router
        specs = [e if isinstance(e, EngineSpec) else EngineSpec.create(e) for e in engines]
        self.states = {s.worker: EngineState(s) for s in specs}
        for spec in specs:  # before any event is handled: configured sizes come first
            if spec.block_size is None:
                continue
            origin = f"--block-size of engine {spec.worker}"
            if spec.described:
                for stream in spec.streams():
                    router.add_holder(
                        Holder(stream.worker, stream.dp_rank),
                        block_size=spec.block_size,
                        source="configured",
                        origin=origin,
                    )
            else:
                router.declare_block_size(
                    Holder(spec.worker, 0), spec.block_size, source="configured", origin=origin
                )
        self.engines = [s.url for s in specs]
        self.subscriber = subscriber
        self.load_interval = load_interval
        self.forward_timeout = forward_timeout
        self.text_tokenizer: TextTokenizer = tokenizer or ByteTextTokenizer()
        self.policy = policy
        self.requests = RequestStats()
        self.registry = make_registry(router, self._stream_stats, self.requests)
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    @property
    def engine_errors(self) -> dict[str, str | None]:
        """The last load/health error per engine URL (None: answering)."""
        return {st.spec.url: st.error for st in self.states.values()}

    def spec(self, worker: str) -> EngineSpec:
        """The engine a holder's worker name belongs to."""
        state = self.states.get(worker)
        if state is not None:
            return state.spec
        return EngineSpec.create(worker)  # a holder learned from events of an unknown worker

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("RouterService.start() has not run: the HTTP client is not open")
        return self._client

    def _stream_stats(self) -> dict[Holder, Any]:
        return {} if self.subscriber is None else dict(self.subscriber.stats())

    async def start(self) -> None:
        # Idle connections expire before the engine's (uvicorn: 5 s) keep-alive timeout, so a
        # request never goes out on a connection the server is closing (a ReadError, 502).
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.forward_timeout, connect=5.0),
            limits=httpx.Limits(keepalive_expiry=2.0),
        )
        if (
            isinstance(self.text_tokenizer, EndpointTokenizer)
            and self.text_tokenizer.client is None
        ):
            self.text_tokenizer.client = self._client
        if self.subscriber is not None:
            self._tasks.append(asyncio.create_task(self._consume(self.subscriber)))
        for state in self.states.values():
            self._tasks.append(
                asyncio.create_task(
                    watch_engine(
                        self.router, state, self._client, self.load_interval, self._stopping
                    )
                )
            )

    async def stop(self) -> None:
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._client is not None:
            await self._client.aclose()
        if self.subscriber is not None:
            await asyncio.to_thread(self.subscriber.close)

    async def _consume(self, subscriber: Subscriber) -> None:
        while not self._stopping.is_set():
            try:
                item = await subscriber.aget(timeout=0.5)
            except SubscriberStateError:
                return
            if item is not None:
                self.router.handle(item)

    async def tokens(self, raw: bytes, *, chat: bool = True) -> tuple[list[int], TokensBody]:
        """The body's token ids (tokenizing text or a chat) and the body; ``chat=False``
        refuses ``messages`` (an engine's ``/generate`` takes no chat)."""
        try:
            body = _TOKENS_DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"request body: {exc}") from None
        if body.messages is not None and not chat:
            raise BadRequest('"messages" is for chats: send them to /v1/chat/completions')
        given = [body.input_ids, body.text, body.messages]
        if sum(x is not None for x in given) != 1:
            raise BadRequest(
                'give exactly one of "input_ids" (token ids), "text" or "messages" (a chat)'
            )
        if body.input_ids is not None:
            return body.input_ids, body
        try:
            if body.text is not None:
                return await self.text_tokenizer.encode(body.text), body
            whole = msgspec.json.decode(raw)  # an object: it decoded as a TokensBody
            return await self.text_tokenizer.encode_chat(whole), body
        except ChatError as exc:
            raise BadRequest(str(exc)) from None
        except TokenizeError as exc:
            raise TokenizeFailed(exc) from None

    async def forward(self, worker: str, body: dict[str, Any]) -> httpx.Response:
        return await self.client.post(f"{self.spec(worker).url}/generate", json=body)


def _scores_json(decision_scores: list[Any]) -> list[dict[str, Any]]:
    out = []
    for s in decision_scores:
        d = msgspec.structs.asdict(s)
        d["matched"] = s.matched._asdict()
        out.append(d)
    return out


def create_app(service: RouterService) -> FastAPI:
    """The router's HTTP API; starting and stopping ``service`` is the app's lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="kvevents router", lifespan=lifespan)
    router = service.router

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(TokenizeFailed)
    async def _untokenized(request: Request, exc: TokenizeFailed) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    def _not_ready(exc: ValueError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=503)

    @app.post("/query")
    async def query(request: Request) -> JSONResponse:
        tokens, body = await service.tokens(await request.body())
        try:
            matches = router.query(tokens, lora=body.lora, cache_salt=body.cache_salt)
        except ValueError as exc:
            return _not_ready(exc)
        bs = router.index.block_size or 0
        return JSONResponse(
            {
                "prompt_tokens": len(tokens),
                "block_size": bs,
                "matches": [
                    {
                        "worker": h.worker,
                        "dp_rank": h.dp_rank,
                        "matched_blocks": m.blocks,
                        "matched_tokens": m.blocks * bs,
                        "tiers": {"gpu": m.gpu * bs, "cpu": m.cpu * bs, "disk": m.disk * bs},
                    }
                    for h, m in matches.items()
                ],
            }
        )

    @app.post("/route")
    async def route(request: Request) -> JSONResponse:
        tokens, body = await service.tokens(await request.body())
        try:
            decision = router.route(tokens, lora=body.lora, cache_salt=body.cache_salt)
        except ValueError as exc:
            return _not_ready(exc)
        if body.record:
            router.record(decision)
        return JSONResponse(
            {
                "worker": decision.worker,
                "dp_rank": decision.dp_rank,
                "recorded": body.record,
                "n_blocks": decision.n_blocks,
                "block_size": decision.block_size,
                "scores": _scores_json(decision.scores),
            }
        )

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        raw = await request.body()
        tokens, body = await service.tokens(raw, chat=False)
        try:
            payload = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:  # pragma: no cover - tokens() decoded it already
            raise BadRequest(f"request body: {exc}") from None
        if not isinstance(payload, dict):
            raise BadRequest("request body must be a JSON object")
        try:
            decision = router.route(
                tokens, lora=body.lora, cache_salt=body.cache_salt, policy=service.policy
            )
        except ValueError as exc:
            return _not_ready(exc)
        payload.pop("data_parallel_rank", None)
        payload["routed_dp_rank"] = decision.dp_rank
        ticket = router.begin(decision)
        try:
            response = await service.forward(decision.worker, payload)
        except httpx.HTTPError as exc:
            service.requests.record("generate", decision, len(tokens), 502)
            return JSONResponse(
                {"error": f"forwarding to {decision.worker} failed: {type(exc).__name__}: {exc}"},
                status_code=502,
            )
        finally:
            router.finish(ticket)
        service.requests.record("generate", decision, len(tokens), response.status_code)
        chosen = decision.chosen
        info = {
            "worker": decision.worker,
            "dp_rank": decision.dp_rank,
            "cost": chosen.cost,
            "cached_blocks": chosen.cached_blocks,
            "prefill_blocks": chosen.prefill_blocks,
            "pending_blocks": chosen.pending_blocks,
        }
        try:
            answer = response.json()
        except ValueError:
            return Response(response.content, status_code=response.status_code)
        if response.status_code == 200:
            service.requests.record_usage(decision.holder, engine_usage(answer))
        if isinstance(answer, dict):
            answer["router"] = info
        return JSONResponse(answer, status_code=response.status_code)

    @app.get("/workers")
    async def workers() -> JSONResponse:
        sub = service.subscriber
        streams = [] if sub is None else [msgspec.to_builtins(s) for s in sub.stats().values()]
        engines = {} if sub is None else msgspec.to_builtins(sub.engines())
        return JSONResponse(
            {
                "engines": [
                    {
                        "url": st.spec.url,
                        "worker": st.spec.worker,
                        "kind": st.spec.engine_kind,
                        "described": st.spec.to_dict() if st.spec.described else None,
                        "registered": st.registered,
                        "advertised_block_size": st.advertised_block_size,
                        "load_error": st.error,
                        "load_source": st.load_source,
                        "metrics_error": st.metrics_error,
                        "discovery": engines.get(st.spec.url),
                    }
                    for st in service.states.values()
                ],
                "streams": streams,
                "holders": router.holder_summary(),
                "index": {
                    "entries": len(router.index),
                    "blocks": router.index.num_blocks,
                    "block_size": router.index.block_size,
                    "batches_applied": router.batches_applied,
                },
                "block_size_mismatches": [
                    msgspec.to_builtins(m) for m in router.block_sizes.mismatches.values()
                ],
                "policy": service.policy,
                "tokenizer": service.text_tokenizer.name,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(service.registry), media_type="text/plain; version=0.0.4")

    @app.get("/dump")
    async def dump() -> Response:
        return Response(router.index.to_bytes(), media_type="application/octet-stream")

    add_openai_routes(app, service)
    return app
