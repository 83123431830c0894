"""The router's HTTP app: the hot path in front, FastAPI for ``/generate``, ``/workers``, ``/metrics``, ``/dump``, ``/health``.

The endpoints are listed in :mod:`kvevents.cli.router` (the ``kvevents router``
command) and described, bodies and answers, in :mod:`kvevents.router.api_schema`
(``/openapi.json``, ``/docs``); what feeds them is :class:`~kvevents.router.service.RouterService`; the OpenAI
endpoints live in :mod:`kvevents.router.openai`, engine polling in
:mod:`kvevents.router.engines`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvevents.api import install
from kvevents.errors import RouterNotReadyError
from kvevents.http_auth import ApiKey
from kvevents.router.api_schema import OPERATIONS, RoutedTo
from kvevents.router.bodies import BodyTooLarge, Disconnected, read_body
from kvevents.router.hot_path import DEFAULT_MAX_BODY_BYTES, HotPath
from kvevents.router.metrics import render
from kvevents.router.models import UnknownModelError
from kvevents.router.openai import add_openai_routes
from kvevents.router.request_stats import engine_usage
from kvevents.router.service import FORWARD_ERRORS, BadRequest, RouterService, TokenizeFailed
from kvevents.router.warm_start import dump_bytes

__all__ = ["OPEN_PATHS", "create_app"]


OPEN_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
"""Paths answered without the API key: health for probes, and the API's description
(it holds no state, and a browser opening ``/docs`` cannot send the header)."""


def create_app(
    service: RouterService,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_key: ApiKey | None = None,
    metrics_auth: bool = False,
) -> HotPath:
    """The router's HTTP API as one ASGI app; starting and stopping ``service`` is its lifespan.

    ``/route`` and ``/query`` are answered by :class:`~kvevents.router.hot_path.HotPath`;
    everything else by the FastAPI app behind it (:func:`create_fastapi_app`).

    ``api_key``: every path but :data:`OPEN_PATHS` (and ``/metrics``, unless
    ``metrics_auth``) needs ``Authorization: Bearer KEY``; the hot path checks it for all.
    """
    open_paths = OPEN_PATHS if metrics_auth else OPEN_PATHS | {"/metrics"}
    return HotPath(
        service,
        create_fastapi_app(service, max_body_bytes=max_body_bytes),
        max_body_bytes=max_body_bytes,
        api_key=api_key,
        open_paths=open_paths,
    )


def create_fastapi_app(
    service: RouterService, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    """The FastAPI part of the router: lifespan, ``/generate``, ``/workers``, ``/metrics``,
    ``/dump`` and the OpenAI routes; a body over ``max_body_bytes`` answers 413."""

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

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=413)

    @app.exception_handler(UnknownModelError)
    async def _unknown_model(request: Request, exc: UnknownModelError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=404)

    @app.exception_handler(RouterNotReadyError)
    async def _not_ready(request: Request, exc: RouterNotReadyError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=503)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            raw = await read_body(request.scope, request.receive, max_body_bytes)
        except Disconnected:
            return Response(status_code=400)  # nobody is left to read it
        tokens, body = await service.tokens(raw, chat=False)
        try:
            payload = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:  # pragma: no cover - tokens() decoded it already
            raise BadRequest(f"request body: {exc}") from None
        if not isinstance(payload, dict):
            raise BadRequest("request body must be a JSON object")
        decision = router.route(
            tokens,
            lora=body.lora,
            cache_salt=body.cache_salt,
            policy=service.policy,
            model=body.model,
        )
        payload.pop("data_parallel_rank", None)
        payload["routed_dp_rank"] = decision.dp_rank
        ticket = router.begin(decision)
        status = 502
        try:
            status, content = await service.forward(decision.worker, payload)
        except FORWARD_ERRORS as exc:
            service.requests.record("generate", decision, len(tokens), 502)
            return JSONResponse(
                {"error": f"forwarding to {decision.worker} failed: {type(exc).__name__}: {exc}"},
                status_code=502,
            )
        finally:
            router.finish(ticket, failed=status != 200)
        service.requests.record("generate", decision, len(tokens), status)
        chosen = decision.chosen
        info = msgspec.to_builtins(
            RoutedTo(
                decision.worker,
                decision.dp_rank,
                chosen.cost,
                chosen.cached_blocks,
                chosen.prefill_blocks,
                chosen.pending_blocks,
            )
        )
        try:
            answer = msgspec.json.decode(content)
        except msgspec.DecodeError:
            return Response(content, status_code=status)
        if status == 200:
            service.requests.record_usage(decision.holder, engine_usage(answer))
        if isinstance(answer, dict):
            answer["router"] = info
        return JSONResponse(answer, status_code=status)

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
                        "load_slow_polls": st.slow_polls,
                        "load_slow": st.slow,
                        "load_source": st.load_source,
                        "metrics_error": st.metrics_error,
                        "models": None if st.models is None else st.models.names(),
                        "models_source": None if st.models is None else st.models.source,
                        "models_error": st.models_error,
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
                "process": service.process_info(),
                "warm_start": None
                if service.warm_start is None
                else msgspec.to_builtins(service.warm_start),
                "policy": service.policy,
                "tokenizer": service.text_tokenizer.name,
            }
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the router serves; open even with an API key (for probes)."""
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(service.registry), media_type="text/plain; version=0.0.4")

    @app.get("/dump")
    async def dump() -> Response:
        return Response(await dump_bytes(router.index), media_type="application/octet-stream")

    add_openai_routes(app, service, max_body_bytes=max_body_bytes)
    install(app, OPERATIONS)
    return app
