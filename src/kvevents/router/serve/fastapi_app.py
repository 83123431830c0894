"""The FastAPI part of the router: every path the hot path does not answer itself.

``/generate``, ``/metrics``, ``/dump``, ``/v1/models``, ``/openapi.json`` and ``/docs``
(and, so that this app alone answers like the whole router, ``/workers``, ``/health``,
``/ready`` and the OpenAI relay's routes too). :mod:`kvevents.router.serve.app` builds it
once the router serves, in a thread, because importing FastAPI is a large part of
start-up.
"""

from __future__ import annotations

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvevents.api import install
from kvevents.errors import RouterNotReadyError
from kvevents.router.decide.models import UnknownModelError
from kvevents.router.fleet.warm_start import dump_bytes
from kvevents.router.serve.api_schema import OPERATIONS, PD_OPERATIONS, RoutedTo
from kvevents.router.serve.bodies import BodyTooLarge, Disconnected, read_body
from kvevents.router.serve.hot_path import DEFAULT_MAX_BODY_BYTES, keyed
from kvevents.router.serve.openai import add_openai_routes
from kvevents.router.serve.request_stats import engine_usage
from kvevents.router.serve.service import (
    FORWARD_ERRORS,
    BadRequest,
    RouterService,
    TokenizeFailed,
    gateway_status,
)
from kvevents.router.serve.status import HEALTHY, ready_answer, workers_document

__all__ = ["create_fastapi_app"]


def create_fastapi_app(
    service: RouterService, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    """The FastAPI part of the router: ``/generate``, ``/workers``, ``/health``,
    ``/metrics``, ``/dump``, ``/v1/models`` and the other OpenAI routes, ``/docs``; a
    body over ``max_body_bytes`` answers 413. It has no lifespan: the hot path in front
    starts and stops the service."""

    # /docs is kvevents.api's page (install, below): FastAPI's own load their assets from a CDN
    app = FastAPI(title="kvevents router", docs_url=None, redoc_url=None)
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
        # keyed under its adapter, so it must run under it: an engine's /generate
        # (SGLang's, ours) takes the adapter as lora_path only
        if body.adapter is not None:
            payload["lora_path"] = body.adapter
        elif body.model is not None and router.models.adapter(body.model):
            payload["lora_path"] = body.model
        # keyed as /route keys it: the adapter, the salt and the per-block extra keys
        decision = keyed(router.route, tokens, body, policy=service.policy, top=1)
        payload.pop("data_parallel_rank", None)
        payload["routed_dp_rank"] = decision.dp_rank
        ticket = router.begin(decision)
        status = 502
        try:
            status, content = await service.forward(decision.worker, payload)
        except FORWARD_ERRORS as exc:
            failed, _ = gateway_status(exc)
            service.requests.record("generate", decision, len(tokens), failed)
            return JSONResponse(
                {"error": f"forwarding to {decision.worker} failed: {type(exc).__name__}: {exc}"},
                status_code=failed,
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
        return JSONResponse(workers_document(service))

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the router serves; open even with an API key (for probes)."""
        return JSONResponse(HEALTHY)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """200 when the router can route, else 503; the reasons either way (for probes)."""
        status, state = ready_answer(service)
        return JSONResponse(msgspec.to_builtins(state), status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/dump")
    async def dump() -> Response:
        snapshot = await dump_bytes(router.index, service.applying)
        return Response(snapshot, media_type="application/octet-stream")

    add_openai_routes(app, service, max_body_bytes=max_body_bytes)
    install(app, OPERATIONS if service.pd is None else PD_OPERATIONS)
    return app
