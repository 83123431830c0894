"""OpenAI-compatible routing to the engine rank holding the prefix.

``POST /v1/completions``: ``prompt`` is text, a list of token ids, or a list of several
of either (a batch). Text is tokenized as the engine would
(:mod:`kvevents.router.prompts.tokenize`, honouring vLLM's ``add_special_tokens``). A
batch is forwarded whole to the one holder with the lowest summed cost
(:mod:`kvevents.router.decide.batch` says why it is not split). ``POST
/v1/chat/completions``: ``messages`` are rendered with the engine's chat template and
tokenized (by the engine's own ``/tokenize`` with ``--tokenize-endpoint``; with the byte
tokenizer, the simulated engine's template; ``--tokenizer FILE`` answers 501). ``model``
limits the candidates to the engines serving it (:mod:`kvevents.router.decide.models`);
``GET /v1/models`` answers the union of the engines' models in vLLM's shape.

The request goes to the same path on the chosen engine: to ``vllm`` engines the body
bytes unchanged with ``X-data-parallel-rank: r``; to ``sglang`` and ``kvevents`` engines
with ``routed_dp_rank: r`` set in the body. The client's headers go along except
hop-by-hop ones, its own rank header and its ``Authorization`` (the engine gets
``--engine-api-key`` instead, or none). ``"stream": true`` relays the engine's events as
they arrive; an engine failing midway ends the stream with an SSE ``error`` event. Every
answer carries the decision::

    x-kvevents-worker: http://10.0.0.5:8000      x-kvevents-dp-rank: 1
    x-kvevents-matched-tokens: 96                x-kvevents-prompt-tokens: 130
    x-kvevents-policy: kv-aware                  x-kvevents-predicted-tokens: 0

and is counted (:mod:`kvevents.router.serve.request_stats`). Errors use OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``: 413 past ``--max-body-bytes``, 400
for a bad body (or the engine's own 400, 413 or 422 from ``/tokenize``), 501 for a chat
the tokenizer cannot render, 404 for an unknown model, 503 with no rank available, 502
when tokenizing or the engine fails otherwise.

:mod:`kvevents.router.serve.openai_relay` answers both endpoints off the framework; the
FastAPI routes here hand the request to the same relay unread, so the FastAPI app alone
answers alike.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvevents.http.auth import Receive, Scope, Send
from kvevents.router.serve.bodies import DEFAULT_MAX_BODY_BYTES
from kvevents.router.serve.openai_relay import OpenAIRelay
from kvevents.router.serve.relay_answer import OpenAIError
from kvevents.router.serve.relay_body import prompts_of
from kvevents.router.serve.relay_headers import RANK_HEADER, decision_headers
from kvevents.router.serve.service import RouterService

__all__ = ["RANK_HEADER", "OpenAIError", "add_openai_routes", "decision_headers", "prompts_of"]


class _Relayed(Response):
    """A response that is the relay answering the request itself (body still unread)."""

    def __init__(self, relay: OpenAIRelay) -> None:
        super().__init__()
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.relay.asgi(scope, receive, send)


def add_openai_routes(
    app: FastAPI, service: RouterService, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> None:
    """Serve the OpenAI endpoints of the module docstring on ``app`` for ``service``; a
    body over ``max_body_bytes`` answers 413."""
    router = service.router
    relay = OpenAIRelay(service, max_body_bytes=max_body_bytes)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(router.models.v1_models())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return _Relayed(relay)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return _Relayed(relay)
