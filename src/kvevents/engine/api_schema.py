"""The simulated engine's HTTP API as OpenAPI operations: every endpoint, body and answer.

``/openapi.json`` and ``/docs`` are built from :data:`OPERATIONS` (see
:mod:`kvevents.api.document`). :class:`GenerateRequest` is the struct ``/generate``
decodes its body with; the OpenAI bodies, checked by hand in
:mod:`kvevents.engine.openai_api`, are the structs of :mod:`kvevents.api.openai`; the
answers are what :mod:`kvevents.engine.server` sends, checked against the live
engine by the tests.

For Kubernetes: the ``livenessProbe`` goes to ``/health`` (no rank dead), the
``readinessProbe`` to ``/ready`` (every rank running, its publisher bound; 503 with the
reasons otherwise); both are open without ``--api-key``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvevents.api import Body, Operation, Query
from kvevents.api.openai import (
    ChatAnswer,
    ChatRequest,
    CompletionAnswer,
    CompletionRequest,
    ModelList,
    OpenAIErrorAnswer,
    TokenizeAnswer,
    TokenizeRequest,
)
from kvevents.engine.readiness import EngineReadiness

__all__ = ["OPERATIONS", "GenerateRequest"]

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
NewTokens = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Room = Annotated[int, msgspec.Meta(ge=0)]


class SamplingParams(msgspec.Struct):
    max_new_tokens: NewTokens | None = None
    n: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Samples per prompt: the simulated engine generates one; on a disaggregated engine
    ``n`` sizes the list of rooms (one per sample)."""


class GenerateRequest(msgspec.Struct):
    """The body of ``POST /generate`` (unknown keys are ignored, as SGLang does).

    Exactly one of ``input_ids`` and ``text``; ``routed_dp_rank`` (SGLang's name) or
    ``data_parallel_rank`` picks the rank, else round-robin over the live ranks;
    ``max_new_tokens`` at the top level or in ``sampling_params`` (default 16).
    """

    input_ids: list[TokenId] | None = None
    text: str | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    max_new_tokens: NewTokens | None = None
    sampling_params: SamplingParams | None = None
    lora_path: str | None = None
    """SGLang's name for the adapter to run under (``kvevents engine --lora-modules``)."""
    cache_salt: str | None = None
    """vLLM's cache salt: the request's blocks are cached (and published) under it."""
    extra_keys: list[list[Any] | None] | None = None
    """Per block, the extra keys vLLM would hash in (an image's ``[identifier, offset]``)."""
    bootstrap_host: str | list[str] | None = None
    """SGLang's P/D hand-off (``--disaggregation-mode``): the prefill engine's host."""
    bootstrap_port: Port | list[Port] | None = None
    """SGLang's P/D hand-off: the prefill engine's ``disaggregation_bootstrap_port``."""
    bootstrap_room: Room | list[Room] | None = None
    """SGLang's P/D hand-off: a random room, new per request, sent on both legs (a list:
    one per sample with ``sampling_params.n``). Ignored by a non-disaggregated engine."""
    disagg_prefill_dp_rank: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """SGLang's P/D hand-off, decode leg: the rank the prefill ran on (checked)."""


class FinishReason(msgspec.Struct):
    type: str
    length: int


class GenerateMeta(msgspec.Struct):
    """SGLang's ``meta_info``; the same figures are also at the answer's top level."""

    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens the rank found in its prefix cache."""
    completion_tokens: int
    dp_rank: int
    finish_reason: FinishReason


class GenerateAnswer(msgspec.Struct):
    text: str
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    dp_rank: int
    finish_reason: FinishReason
    meta_info: GenerateMeta


class ErrorAnswer(msgspec.Struct):
    error: str
    """What was wrong, naming the field, parameter or limit, and how to fix it."""


class RankStatus(msgspec.Struct):
    dp_rank: int
    state: str
    alive: bool
    pid: int | None
    restarts: int
    exit_code: int | None
    endpoint: str | None
    replay_endpoint: str | None


class HealthAnswer(msgspec.Struct):
    status: str
    """``ok``, or ``unhealthy`` while a rank is dead."""
    dead_ranks: list[int]
    ranks: list[RankStatus]


class LoadAnswer(msgspec.Struct):
    dp_size: int
    ranks: list[dict[str, Any]]
    """Per rank: ``dp_rank``, ``available`` and the scheduler's load figures, or
    ``available: false`` with ``error`` when the rank did not answer in time. ``running``
    counts a request until its answer leaves, through the step that finishes it."""


class KvBlocksAnswer(msgspec.Struct):
    dp_rank: int
    block_size: int
    num_blocks: int
    block_hashes: list[int]


class FlushAnswer(msgspec.Struct):
    flushed: list[int]
    """The ranks whose caches were emptied."""


class ServerInfoAnswer(msgspec.Struct):
    dp_size: int
    tp_size: int
    enable_dp_attention: bool
    page_size: int
    max_blocks_per_rank: int
    hash_scheme: str
    kv_events_config: str
    schedulers: list[dict[str, Any]]
    kv_events: dict[str, Any] | None = None
    """The discovery block (kvevents.wire.server_info); absent when not publishing on TCP."""
    disaggregation_mode: str = "null"
    """``null``, ``prefill`` or ``decode`` (``--disaggregation-mode``, SGLang's values)."""
    disaggregation_bootstrap_port: int | None = None
    """A prefill engine's bootstrap server port, as bound (null on other engines)."""
    disaggregation_decode_local_prefill: bool | None = None
    """``true`` on a decode engine: it prefills a request sent without a prefill itself
    (an SGLang decode server cannot, and never says so)."""


_RANK = Query("dp_rank", {"type": "integer", "minimum": 0}, "The data-parallel rank")
_BAD = "A malformed body or parameter; the message names it and how to fix it"
_TOO_LARGE = "The body is over kvevents engine --max-body-bytes (refused before it is read whole)"
_UNAVAILABLE = "The rank is not running (dead or restarting), or its queue is full"
_TIMEOUT = "The rank did not answer within --request-timeout"
_PD_TWICE = "A P/D room registered twice (two prefills) or taken twice (two decodes)"
_PD_FAILED = "A P/D hand-off failed: its prefill failed, or its bootstrap server is out of reach"
_PD_TIMEOUT = "The rank did not answer within --request-timeout, or (a P/D decode leg) its room "
_PD_TIMEOUT += "was not prefilled within --disaggregation-timeout"
_GENERATE_ERRORS = {
    400: _BAD,
    409: _PD_TWICE,
    413: _TOO_LARGE,
    502: _PD_FAILED,
    503: _UNAVAILABLE,
    504: _PD_TIMEOUT,
}
_PD = (
    " On an engine run with --disaggregation-mode prefill|decode, a request carrying "
    "SGLang's bootstrap_room (or, on the OpenAI routes, vLLM's kv_transfer_params) is one "
    "leg of a disaggregated request: the prefill registers the prompt's KV with its "
    "bootstrap server, the decode takes it from there and decodes."
)

OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "get",
        "/v1/models",
        "The served model names and LoRA adapters (--served-model-name, --lora-modules)",
        Body(ModelList),
    ),
    Operation(
        "post",
        "/generate",
        "Generate tokens for a prompt (SGLang's API)",
        Body(GenerateAnswer),
        description="The rank is `routed_dp_rank` (or `data_parallel_rank`); without one, "
        "round-robin." + _PD,
        request=Body(GenerateRequest, example={"input_ids": [1, 2, 3, 4], "max_new_tokens": 4}),
        errors=_GENERATE_ERRORS,
        error_type=ErrorAnswer,
    ),
    Operation(
        "post",
        "/v1/completions",
        "OpenAI completions (vLLM-style)",
        Body(CompletionAnswer, also=("text/event-stream",)),
        description="The rank is the header X-data-parallel-rank (vLLM's) or "
        "`routed_dp_rank` in the body; without one, round-robin." + _PD,
        request=Body(CompletionRequest, example={"prompt": "Hello", "max_tokens": 4}),
        errors=_GENERATE_ERRORS,
        error_type=OpenAIErrorAnswer,
    ),
    Operation(
        "post",
        "/v1/chat/completions",
        "OpenAI chat completions (vLLM-style)",
        Body(ChatAnswer, also=("text/event-stream",)),
        description="The messages are rendered with the engine's chat template; the rank "
        "as for /v1/completions." + _PD,
        request=Body(
            ChatRequest,
            example={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        ),
        errors=_GENERATE_ERRORS,
        error_type=OpenAIErrorAnswer,
    ),
    Operation(
        "post",
        "/tokenize",
        "Token ids of a prompt or a chat, as generation would see them",
        Body(TokenizeAnswer),
        request=Body(TokenizeRequest, example={"prompt": "Hello"}),
        errors={400: _BAD, 413: _TOO_LARGE},
        error_type=OpenAIErrorAnswer,
    ),
    Operation(
        "get",
        "/kv_blocks",
        "The block hashes one rank holds now (ground truth for consistency checks)",
        Body(KvBlocksAnswer),
        query=(Query(_RANK.name, _RANK.schema, _RANK.description, required=True),),
        errors={400: _BAD, 503: _UNAVAILABLE, 504: _TIMEOUT},
        error_type=ErrorAnswer,
    ),
    Operation(
        "get",
        "/load",
        "Every rank's load; a rank that does not answer in time is reported unavailable",
        Body(LoadAnswer),
    ),
    Operation(
        "get",
        "/server_info",
        "Topology, block size, the KV-events discovery block and the P/D role",
        Body(ServerInfoAnswer),
    ),
    Operation(
        "post",
        "/admin/restart_rank",
        "Kill one rank and start it again on the same endpoints",
        Body(RankStatus, description="The rank's status once it is running again"),
        query=(
            Query(_RANK.name, _RANK.schema, _RANK.description, required=True),
            Query(
                "signal",
                {"type": "string", "enum": ["kill", "term"], "default": "kill"},
                "How to stop it: SIGKILL or SIGTERM",
            ),
        ),
        errors={
            400: _BAD,
            409: "The rank is already starting, stopping or restarting; try again later",
            503: _UNAVAILABLE,
        },
        error_type=ErrorAnswer,
    ),
    Operation(
        "post",
        "/flush_cache",
        "Empty the prefix cache of one rank, or of every rank",
        Body(FlushAnswer),
        query=(Query(_RANK.name, _RANK.schema, "Only this rank (default: every rank)"),),
        errors={400: _BAD, 503: _UNAVAILABLE, 504: _TIMEOUT},
        error_type=ErrorAnswer,
    ),
    Operation(
        "get",
        "/health",
        "Whether every rank is running",
        Body(HealthAnswer),
        description="Liveness: 503 only while a rank is dead (the engine then exits). "
        "For Kubernetes: livenessProbe on /health, readinessProbe on /ready.",
        other={503: ("A rank is dead", Body(HealthAnswer))},
    ),
    Operation(
        "get",
        "/ready",
        "Whether the engine can serve now, and why not",
        Body(EngineReadiness, description="Every rank is running and, publishing, bound"),
        description="Readiness: 200 when every rank is running and, when KV events are "
        "published, its publisher is bound; 503 with the reasons otherwise (a rank starting, "
        "restarting or dead). Open even with --api-key.",
        other={503: ("A rank cannot serve; `reasons` say which and why", Body(EngineReadiness))},
    ),
)
