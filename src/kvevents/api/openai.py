"""The OpenAI bodies both services serve, as msgspec structs (the fields kvevents reads).

``/v1/completions``, ``/v1/chat/completions`` and the engine's ``/tokenize`` check their
bodies by hand (the router forwards the body it got, with every field the engine may
use, so it must not refuse keys it does not know); these structs state what those
handlers accept, for the OpenAPI documents: the fields they read, with the types they
check (unknown fields are allowed, as the handlers allow them). The answer structs are
what the simulated engine sends, and what the router relays; the tests check live
answers against them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

__all__ = [
    "ChatAnswer",
    "ChatChoice",
    "ChatMessage",
    "ChatRequest",
    "CompletionAnswer",
    "CompletionChoice",
    "CompletionRequest",
    "ModelCard",
    "ModelList",
    "OpenAIErrorAnswer",
    "OpenAIErrorDetail",
    "StreamOptions",
    "TextPart",
    "TokenizeAnswer",
    "TokenizeRequest",
    "Usage",
]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Samples = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Room = Annotated[int, msgspec.Meta(ge=0)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
_IDS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1},
    "minItems": 1,
}
Prompt = Annotated[
    Any,
    msgspec.Meta(
        extra_json_schema={
            "anyOf": [
                {"type": "string"},
                _IDS,
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                {"type": "array", "items": _IDS, "minItems": 1},
            ]
        }
    ),
]
"""A prompt or a batch of them. A union of several list types is more than msgspec
decodes, so the handlers check it by hand (``prompts_of`` in the router, ``_prompts`` in
the engine) and this schema states what they accept."""


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    """With ``stream``, a last chunk carries ``usage`` (and the router counts it)."""


class TextPart(msgspec.Struct):
    """One part of a message's content; only text parts are rendered."""

    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct):
    role: Annotated[str, msgspec.Meta(min_length=1)]
    content: str | list[TextPart] | None = None


class CompletionRequest(msgspec.Struct):
    """``POST /v1/completions``: a prompt as text or token ids, or a batch of them."""

    prompt: Prompt
    """Text, a non-empty list of token ids, or a batch: a list of texts or a list of
    lists of ids. A batch runs on one rank, the one with the lowest cost summed over its
    prompts (docs/routing.md, Models and LoRA adapters)."""
    model: str | None = None
    max_tokens: NonNegative | None = None
    """Tokens to generate (default 16); the engine refuses more than its limit."""
    stream: bool = False
    """Answer server-sent events, one ``data:`` chunk per token, then ``data: [DONE]``."""
    stream_options: StreamOptions | None = None
    add_special_tokens: bool = True
    """vLLM's: whether the tokenizer adds its special tokens (the router honours it)."""
    cache_salt: str | None = None
    """Keeps this request's cached blocks apart from those of other salts."""
    routed_dp_rank: NonNegative | None = None
    """SGLang's: the data-parallel rank to run on (the router sets it)."""
    data_parallel_rank: NonNegative | None = None
    n: Samples | None = None
    """Samples per prompt. The simulated engine generates one; on a disaggregated engine
    ``n`` sizes the list of SGLang rooms (one per sample)."""
    bootstrap_host: str | list[str] | None = None
    """SGLang's P/D hand-off (the router sets it on both legs): the prefill engine's host."""
    bootstrap_port: Port | list[Port] | None = None
    """SGLang's P/D hand-off: the prefill engine's bootstrap port."""
    bootstrap_room: Room | list[Room] | None = None
    """SGLang's P/D hand-off: a random room, new per request; a list holds one per item
    (prompt × sample, SGLang's order)."""
    disagg_prefill_dp_rank: NonNegative | None = None
    """SGLang's P/D hand-off, decode leg: the rank the prefill leg runs on."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's P/D hand-off: ``do_remote_decode: true`` on the prefill leg; on the decode
    leg what the prefill's answer carried (``do_remote_prefill``, ``remote_host``,
    ``remote_port``, ``remote_request_id``, ...)."""


class ChatRequest(msgspec.Struct):
    """``POST /v1/chat/completions``: messages rendered with the engine's chat template."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    model: str | None = None
    max_tokens: NonNegative | None = None
    max_completion_tokens: NonNegative | None = None
    """OpenAI's newer name for ``max_tokens``; wins when both are given."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    add_generation_prompt: bool = True
    """End the prompt with the assistant's turn opening (not with continue_final_message)."""
    continue_final_message: bool = False
    """Leave the last message open so the model continues it."""
    cache_salt: str | None = None
    routed_dp_rank: NonNegative | None = None
    data_parallel_rank: NonNegative | None = None
    n: Samples | None = None
    """Samples per prompt. The simulated engine generates one; on a disaggregated engine
    ``n`` sizes the list of SGLang rooms (one per sample)."""
    bootstrap_host: str | list[str] | None = None
    """SGLang's P/D hand-off (the router sets it on both legs): the prefill engine's host."""
    bootstrap_port: Port | list[Port] | None = None
    """SGLang's P/D hand-off: the prefill engine's bootstrap port."""
    bootstrap_room: Room | list[Room] | None = None
    """SGLang's P/D hand-off: a random room, new per request; a list holds one per item
    (prompt × sample, SGLang's order)."""
    disagg_prefill_dp_rank: NonNegative | None = None
    """SGLang's P/D hand-off, decode leg: the rank the prefill leg runs on."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's P/D hand-off: ``do_remote_decode: true`` on the prefill leg; on the decode
    leg what the prefill's answer carried (``do_remote_prefill``, ``remote_host``,
    ``remote_port``, ``remote_request_id``, ...)."""


class TokenizeRequest(msgspec.Struct):
    """``POST /tokenize`` (vLLM's): ``prompt`` text, or chat ``messages``."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True
    model: str | None = None


class TokenizeAnswer(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int
    """Prompt tokens the rank found in its prefix cache."""


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: Any = None
    finish_reason: str | None = None


class CompletionAnswer(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    dp_rank: int | None = None
    """Not OpenAI's: the rank that answered (the simulated engine's)."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's P/D hand-off: a prefill leg's answer names the prefill for the decode leg."""


class AssistantMessage(msgspec.Struct):
    role: str
    content: str | None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: Any = None
    finish_reason: str | None = None


class ChatAnswer(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    dp_rank: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's P/D hand-off: a prefill leg's answer names the prefill for the decode leg."""


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    """What was wrong, naming the field or the limit, and how to fix it."""
    type: str
    """``invalid_request_error`` for the client's input; else what failed."""
    code: int
    """The HTTP status."""


class OpenAIErrorAnswer(msgspec.Struct):
    """Every error of an OpenAI endpoint: ``{"error": {"message", "type", "code"}}``."""

    error: OpenAIErrorDetail


class ModelCard(msgspec.Struct):
    """One model of ``GET /v1/models``, in vLLM's shape (an adapter names its base in
    ``parent``)."""

    id: str
    object: str
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[Any] = []


class ModelList(msgspec.Struct):
    """``GET /v1/models``: every model served (base models and LoRA adapters)."""

    object: str
    data: list[ModelCard]
