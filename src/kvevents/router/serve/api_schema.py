"""The router's HTTP API as OpenAPI operations: every endpoint, its body, its answers.

``/openapi.json`` and ``/docs`` are built from :data:`OPERATIONS` (see
:mod:`kvevents.api.document`). The request bodies are the structs the handlers decode
with (:class:`~kvevents.router.prompts.token_body.TokensBody`), or, for the OpenAI routes
that check by hand, the structs of :mod:`kvevents.api.openai`; the answers are the structs
the hot path encodes, or those :func:`kvevents.router.serve.fastapi_app.create_fastapi_app` builds
its answers from. ``/route`` and ``/query`` are served by the bare ASGI hot path in
front of FastAPI, so only this table puts them in the document. A router in
disaggregated mode describes itself with :data:`PD_OPERATIONS`: ``/route`` answers both
holders, and the relayed answers carry the prefill's headers too.

For Kubernetes: the ``livenessProbe`` goes to ``/health`` (the process serves), the
``readinessProbe`` to ``/ready`` (it can route now; 503 with the reasons otherwise); both
are open without ``--api-key``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec

from kvevents.api import Body, Operation
from kvevents.api.openai import (
    ChatAnswer,
    ChatRequest,
    CompletionAnswer,
    CompletionRequest,
    ModelList,
    OpenAIErrorAnswer,
)
from kvevents.router.prompts.token_body import GenerateBody
from kvevents.router.serve.hot_path import ErrorAnswer, QueryAnswer, RouteAnswer
from kvevents.router.serve.pd_route import PDRouteAnswer
from kvevents.router.serve.readiness import Readiness
from kvevents.router.serve.service import TokensBody

__all__ = ["OPERATIONS", "PD_OPERATIONS", "GenerateAnswer", "RoutedTo", "WorkersAnswer"]


class RoutedTo(msgspec.Struct):
    """Where ``/generate`` sent a request, and the chosen holder's cost terms (in blocks)."""

    worker: str
    dp_rank: int
    cost: float
    cached_blocks: float
    prefill_blocks: float
    pending_blocks: float


class GenerateAnswer(msgspec.Struct):
    """The engine's own ``/generate`` answer (SGLang's or the simulated engine's fields,
    relayed as they are) with the router's decision added as ``router``."""

    router: RoutedTo


class EngineStatus(msgspec.Struct):
    url: str
    worker: str
    kind: str
    """``sglang``, ``vllm`` or ``kvevents``."""
    described: dict[str, Any] | None
    """The engine as given by hand or in a file; null when discovered."""
    registered: bool
    advertised_block_size: int | None
    load_error: str | None
    load_slow_polls: int
    """Load polls in a row that got no answer in time; up to 3 keep the ranks as last known."""
    load_slow: str | None
    """Why the last known state is kept while those slow polls are tolerated."""
    load_source: str | None
    metrics_error: str | None
    discovery: Any


class IndexSummary(msgspec.Struct):
    entries: int
    blocks: int
    block_size: int | None
    batches_applied: int
    apply_failures: int
    """Batches whose applying failed (a bug; logged): their holder's entries were dropped."""


class WorkersAnswer(msgspec.Struct):
    """``GET /workers``: the engines, their streams, holders, the index and this process."""

    ready: Readiness
    """What ``GET /ready`` answers: whether the router can route now, and why not."""
    engines: list[EngineStatus]
    streams: list[dict[str, Any]]
    holders: list[dict[str, Any]]
    index: IndexSummary
    block_size_mismatches: list[dict[str, Any]]
    process: dict[str, Any]
    warm_start: dict[str, Any] | None
    policy: str
    tokenizer: str


_TOKENS = Body(
    TokensBody,
    description='Exactly one of "input_ids", "text" or "messages" (a chat, rendered as '
    "/v1/chat/completions renders it). Token ids must be in 0..2**32-1. Any other member "
    "is refused (400, naming it).",
    example={"input_ids": [1, 2, 3, 4, 5, 6, 7, 8]},
)
_GENERATE = Body(
    GenerateBody,
    description='An engine /generate body: exactly one of "input_ids" or "text", and any '
    "other member of the engine's (forwarded as it is).",
    example={"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "max_new_tokens": 4},
)
_BAD = "The body cannot be used: malformed JSON, nesting too deep, a wrong field type, a member it does not take, text that is not valid Unicode, or not exactly one prompt field; the message says which"
_POST_ONLY = " Any other method than POST answers 405 with `Allow: POST`."
_TOO_LARGE = "The body is over kvevents router --max-body-bytes (refused before it is read whole)"
_NOT_READY = "No engine rank is known or available yet"
_TOKENIZE = "Tokenizing the text failed: the engine's /tokenize was unreachable (502) or refused the input (its own status)"
_NATIVE_ERRORS = {
    400: _BAD,
    413: _TOO_LARGE,
    422: "The engine's /tokenize refused the text",
    501: "A chat the configured tokenizer has no template for (--tokenizer FILE)",
    502: _TOKENIZE,
    503: _NOT_READY,
}
_OPENAI_ERRORS = {
    400: "A bad body (the message names the field), or the engine's own 400",
    413: _TOO_LARGE + ", or the engine's own 413",
    422: "The engine's /tokenize refused the input",
    501: "A chat the configured tokenizer has no template for (--tokenizer FILE)",
    502: "Tokenizing failed, the engine could not be reached, or its answer's head was too large",
    503: "No rank available, or the engine's own 503",
    504: "The engine did not answer in time (--forward-timeout), or its head came too slowly",
}


class RouterHealth(msgspec.Struct):
    """``GET /health``: the router process is serving."""

    status: str


_READY = (
    "200 when at least one engine rank is routable (in disaggregated mode, one in each "
    "pool): known and available, its event stream "
    "connected, at the router's block size. Otherwise 503 with the reasons (an engine "
    "unreachable or publishing no events, streams not connected, a block-size mismatch); "
    "the reasons of ranks that cannot be routed to are listed when ready too. For "
    "Kubernetes: readinessProbe on /ready, livenessProbe on /health. Open even with --api-key."
)


OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "get",
        "/v1/models",
        "The models the engines serve (their union; adapters with their base as parent)",
        Body(ModelList),
    ),
    Operation(
        "post",
        "/route",
        "Choose the engine rank for a prompt",
        Body(RouteAnswer, description="The choice, and the best scores, chosen first"),
        description="Scores every holder by cached, prefill and pending blocks and answers "
        'the cheapest. `"record": true` counts the choice as sent (the caller forwards '
        'the request); `top` caps the scores answered, `"all_scores": true` answers all.'
        + _POST_ONLY,
        request=_TOKENS,
        errors=_NATIVE_ERRORS,
        error_type=ErrorAnswer,
    ),
    Operation(
        "post",
        "/query",
        "What every holder has cached of a prompt",
        Body(QueryAnswer, description="One entry per holder of a prefix, tiers in tokens"),
        description="Per holder, the blocks and tokens of the prompt it holds, per tier."
        + _POST_ONLY,
        request=_TOKENS,
        errors=_NATIVE_ERRORS,
        error_type=ErrorAnswer,
    ),
    Operation(
        "post",
        "/generate",
        "Route a /generate request and forward it to the chosen engine",
        Body(GenerateAnswer, description="The engine's answer, with the router's decision"),
        description="The body goes to the chosen engine's /generate with `routed_dp_rank` "
        "set; any status the engine answers is relayed. Chats go to /v1/chat/completions.",
        request=_GENERATE,
        errors={
            **_NATIVE_ERRORS,
            502: _TOKENIZE + ", or the engine could not be reached",
            504: "The engine did not answer in time (--forward-timeout)",
        },
        error_type=ErrorAnswer,
    ),
    Operation(
        "post",
        "/v1/completions",
        "OpenAI completions, routed to the rank holding the prefix",
        Body(CompletionAnswer, also=("text/event-stream",)),
        description="Forwarded to the chosen engine (vLLM: the header X-data-parallel-rank; "
        "SGLang and kvevents: `routed_dp_rank` in the body); the answer carries "
        "x-kvevents-* headers saying where it went and why." + _POST_ONLY,
        request=Body(CompletionRequest, example={"prompt": "Hello, world", "max_tokens": 4}),
        errors=_OPENAI_ERRORS,
        error_type=OpenAIErrorAnswer,
    ),
    Operation(
        "post",
        "/v1/chat/completions",
        "OpenAI chat completions, routed to the rank holding the conversation",
        Body(ChatAnswer, also=("text/event-stream",)),
        description="Rendered with the engine's chat template, then routed and forwarded as "
        "/v1/completions is." + _POST_ONLY,
        request=Body(
            ChatRequest,
            example={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        ),
        errors=_OPENAI_ERRORS,
        error_type=OpenAIErrorAnswer,
    ),
    Operation(
        "get",
        "/workers",
        "Engines, streams, holders and the index, as this router process sees them",
        Body(WorkersAnswer),
    ),
    Operation(
        "get",
        "/health",
        "200 while the router serves (open even with --api-key, for probes)",
        Body(RouterHealth),
        description="Liveness: the process answers. Whether it can route is /ready's.",
    ),
    Operation(
        "get",
        "/ready",
        "Whether the router can route now, and why not",
        Body(Readiness, description="Ready: at least one engine rank is routable"),
        description=_READY,
        other={503: ("Not ready: no engine rank is routable; `reasons` say why", Body(Readiness))},
    ),
    Operation(
        "get",
        "/metrics",
        "Prometheus metrics",
        Body(media_type="text/plain", description="The Prometheus text format, version 0.0.4"),
    ),
    Operation(
        "get",
        "/dump",
        "A snapshot of the prefix index",
        Body(
            media_type="application/octet-stream",
            description="The index's snapshot bytes (kvevents.index.snapshot); a peer "
            "router starts from them (--peer)",
        ),
    ),
)


_PD_HEADERS = (
    " In disaggregated mode the answer also carries x-kvevents-prefill (`skipped`, or why "
    "the prefill holder was chosen: `cache`, `prediction`, `load`), "
    "x-kvevents-prefill-worker, x-kvevents-prefill-dp-rank and x-kvevents-uncached-tokens; "
    "x-kvevents-worker and x-kvevents-dp-rank name the decode holder."
)
_PD_RELAYED = ("/generate", "/v1/completions", "/v1/chat/completions")


def _pd_operation(op: Operation) -> Operation:
    """``op`` as a router in disaggregated mode serves it."""
    if op.path == "/route":
        return replace(
            op,
            summary="Choose the decode and prefill ranks for a prompt",
            ok=Body(
                PDRouteAnswer,
                description="The decode holder (it answers the client), whether the prefill "
                "is skipped and why, and each pool's choice with its scores",
            ),
            description="Chooses the decode holder by cost; when its uncached part of the "
            "prompt is over --max-local-prefill-tokens, the prefill holder by the prefill "
            "pool's cost too (`prefill` is null when skipped). "
            '`"record": true` counts both as sent (a gateway sending the legs itself).'
            + _POST_ONLY,
        )
    if op.path in _PD_RELAYED:
        return replace(op, description=op.description + _PD_HEADERS)
    return op


PD_OPERATIONS: tuple[Operation, ...] = tuple(_pd_operation(op) for op in OPERATIONS)
"""The router's API in disaggregated mode (``--prefill``/``--decode``)."""
