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
    "OpenAIErrorAnswer",
    "OpenAIErrorDetail",
    "StreamOptions",
    "TextPart",
    "TokenizeAnswer",
    "TokenizeRequest",
    "Usage",
]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
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
                {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
                {"type": "array", "items": _IDS, "minItems": 1, "maxItems": 1},
            ]
        }
    ),
]
"""One prompt. A union of several list types is more than msgspec decodes, so the
handlers check it by hand (``prompt_of`` in the router, ``_prompt`` in the engine) and
this schema states what they accept."""


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
    """``POST /v1/completions``: one prompt, as text or token ids (or a list of one)."""

    prompt: Prompt
    """Text, a non-empty list of token ids, or a list holding one text or one list of
    ids (a batch of one). A batch of several prompts is refused: each may belong on
    another rank."""
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
