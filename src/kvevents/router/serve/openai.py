"""OpenAI-compatible routing to the engine rank holding the prefix.

``POST /v1/completions``: ``prompt`` is text, a list of token ids, or a list of several
of either (a batch). Text is tokenized as the engine would
(:mod:`kvevents.router.prompts.tokenize`, honouring vLLM's ``add_special_tokens``). A batch is
forwarded whole to the one holder with the lowest summed cost over its prompts
(:mod:`kvevents.router.decide.batch` says why it is not split), so the engine's answer, its
``choices[i].index`` and usage come back as the engine gave them.

``POST /v1/chat/completions``: ``messages`` are rendered with the engine's chat template
and tokenized (with ``--tokenize-endpoint``, by the engine's own ``/tokenize``; with the
default byte tokenizer, the simulated engine's template; ``--tokenizer FILE`` answers
501, as a ``tokenizer.json`` holds no template).

``model`` (both endpoints) limits the candidates to the engines serving it, and a LoRA
adapter's name keys the request under the adapter (:mod:`kvevents.router.decide.models`); a
model no engine serves answers 404 (``type`` ``NotFoundError``, ``param`` ``model``)
listing the models served. ``GET /v1/models`` answers the union of the engines' models
in vLLM's shape.

The router then chooses ``(engine, rank)`` and the request goes to the same path on that
engine:

* ``vllm`` engines: the body bytes unchanged, with the header ``X-data-parallel-rank: r``;
* ``sglang`` and ``kvevents`` engines: ``routed_dp_rank: r`` set in the JSON body (a
  client's ``data_parallel_rank`` removed).

The client's headers go along except hop-by-hop ones, any ``X-data-parallel-rank`` of
its own and its ``Authorization``: the engine gets the router's own key
(``--engine-api-key``) instead, or none. ``"stream": true`` relays the engine's
server-sent events chunk by chunk as they arrive; an engine failing midway ends the
stream with an SSE ``error`` event. Every answer carries the decision::

    x-kvevents-worker: http://10.0.0.5:8000      x-kvevents-dp-rank: 1
    x-kvevents-matched-tokens: 96                x-kvevents-prompt-tokens: 130
    x-kvevents-policy: kv-aware                  x-kvevents-predicted-tokens: 0

(``matched-tokens`` counts blocks the engine reported, ``predicted-tokens`` the
predicted ones after them, :mod:`kvevents.index.predictions`)

and it is counted (:mod:`kvevents.router.serve.request_stats`, endpoint ``completions`` or
``chat``), with the engine's own ``cached_tokens`` when it reports them. Errors use
OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 413 for a body over
``--max-body-bytes`` (refused before it is buffered whole), 400 for a bad body (the
engine's own 400, 413 or 422 when its ``/tokenize`` refused the input), 501 for a chat
the tokenizer cannot render, 404 for an unknown model, 502 when tokenizing failed
otherwise, 503 with no rank
available, and 502 when the engine cannot be reached.

How it is served: :mod:`kvevents.router.serve.openai_relay` answers both endpoints off the
framework (the hot path hands them over before FastAPI sees them); the FastAPI routes
here hand the request to the same relay unread, so the FastAPI app alone answers alike.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvevents.http.auth import Receive, Scope, Send
from kvevents.router.serve.bodies import DEFAULT_MAX_BODY_BYTES
from kvevents.router.serve.openai_relay import (
    RANK_HEADER,
    OpenAIError,
    OpenAIRelay,
    decision_headers,
    prompts_of,
)
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
