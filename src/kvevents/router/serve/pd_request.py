"""What the P/D relay reads from a request, and what it tells the client of the decision.

:class:`PDRequest` is one request as read (its body, its prompts as token ids, how many
prompts and samples, whether it streams); :func:`generate_request` reads SGLang's
``/generate`` body (``input_ids`` or ``text``, one prompt or a list: a batch).
:func:`pd_headers` and :func:`routed_info` say where a request went (response headers;
a ``/generate`` answer's ``router`` member, :func:`generate_answer`), :func:`error_answer` words an error in the
route's shape: OpenAI's ``{"error": {...}}`` on ``/v1/*``, ``{"error": message}`` on
``/generate`` (the one-pool router's shape there).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal
from urllib.parse import quote

import msgspec

from kvevents.router.decide.pd import PDDecision
from kvevents.router.decide.router import RouteDecision
from kvevents.router.prompts.tokenize import TextTokenizer, TokenizeError
from kvevents.router.serve.openai_relay import (
    Answer,
    OpenAIError,
    _tokenize_error,
    decision_headers,
)
from kvevents.router.serve.pd_exchange import Whole
from kvevents.router.serve.pd_legs import merge_input_logprobs

__all__ = [
    "PD_PATHS",
    "Endpoint",
    "PDRequest",
    "error_answer",
    "error_kind",
    "generate_answer",
    "generate_request",
    "pd_headers",
    "routed_info",
    "samples_of",
]

Endpoint = Literal["completions", "chat", "generate"]
PD_PATHS: Mapping[str, Endpoint] = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/generate": "generate",
}
"""The paths the P/D relay answers (``POST``), each with its endpoint's name."""

_ENCODER = msgspec.json.Encoder()
_JSON = (b"content-type", b"application/json")
_URL_SAFE = ":/?&=@[]+,;~!$'()*"
"""Kept as they are in a worker's header value (as ``x-kvevents-worker`` keeps them)."""


class PDRequest:
    """One request as read: its body, prompts (token ids) and what shapes its legs."""

    __slots__ = ("batched", "body", "endpoint", "logprob", "lora", "prompts", "samples", "stream")

    def __init__(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        prompts: list[Sequence[int]],
        *,
        batched: bool,
        samples: int,
        stream: bool,
        lora: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.body = body
        self.prompts = prompts
        self.batched = batched
        """The prompt was given as a list (even of one): its legs take lists of rooms."""
        self.samples = samples
        self.stream = stream
        self.lora = lora
        self.logprob = endpoint == "generate" and _any_true(body.get("return_logprob"))

    @property
    def model(self) -> str | None:
        model = self.body.get("model")
        return model if isinstance(model, str) else None

    @property
    def salt(self) -> str | None:
        salt = self.body.get("cache_salt")
        return salt if isinstance(salt, str) else None


def pd_headers(decision: PDDecision) -> list[tuple[bytes, bytes]]:
    """The decision's response headers: the decode holder's, then the prefill's."""
    shown = decision_headers(decision.decode, decision.prompt_tokens)
    prefill = decision.prefill
    shown.append((b"x-kvevents-uncached-tokens", b"%d" % decision.uncached_tokens))
    if prefill is None:
        shown.append((b"x-kvevents-prefill", b"skipped"))
        return shown
    reason = (decision.prefill_reason or "load").encode("latin-1")
    shown.append((b"x-kvevents-prefill", reason))
    shown.append((b"x-kvevents-prefill-worker", quote(prefill.worker, safe=_URL_SAFE).encode()))
    shown.append((b"x-kvevents-prefill-dp-rank", b"%d" % prefill.dp_rank))
    return shown


async def generate_request(body: dict[str, Any], tokenizer: TextTokenizer) -> PDRequest:
    """A ``/generate`` body read: ``input_ids`` or ``text``, one prompt or a list."""
    if "messages" in body:
        raise OpenAIError(400, '"messages" is for chats: send them to /v1/chat/completions')
    given = [k for k in ("input_ids", "text") if body.get(k) is not None]
    if len(given) != 1:
        raise OpenAIError(400, 'give exactly one of "input_ids" (token ids) or "text"')
    value = body[given[0]]
    batched = isinstance(value, list) and bool(value) and isinstance(value[0], (list, str))
    items = value if batched else [value]
    prompts: list[Sequence[int]] = []
    for i, item in enumerate(items):
        where = f"{given[0]}[{i}]" if batched else given[0]
        if isinstance(item, str) and given[0] == "text":
            try:
                prompts.append(await tokenizer.encode(item))
            except TokenizeError as exc:
                raise _tokenize_error(exc) from None
        elif isinstance(item, list) and item and all(type(t) is int and t >= 0 for t in item):
            prompts.append(item)
        else:
            kind = "a string" if given[0] == "text" else "a non-empty list of token ids"
            raise OpenAIError(400, f"{where} must be {kind}, or a list of them")
    params = body.get("sampling_params")
    samples = samples_of(params.get("n", 1) if isinstance(params, dict) else 1, "sampling_params.n")
    lora = body.get("lora_path", body.get("lora"))
    return PDRequest(
        "generate",
        body,
        prompts,
        batched=batched,
        samples=samples,
        stream=body.get("stream") is True,
        lora=lora if isinstance(lora, str) else None,
    )


async def generate_answer(
    payload: bytes, decision: PDDecision, prefilled: asyncio.Future[Whole | None] | None
) -> bytes:
    """A decode's ``/generate`` answer (``payload``) for the client: the prefill's input
    logprobs merged in when ``prefilled`` (its answer, to come) is given, and a JSON
    object told where it went (``router``, :func:`routed_info`)."""
    try:
        answer = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return payload
    if prefilled is not None:
        prefill = await prefilled
        if prefill is not None:
            with contextlib.suppress(msgspec.DecodeError):  # then without them
                answer = merge_input_logprobs(msgspec.json.decode(prefill.body), answer)
    if isinstance(answer, dict):
        answer["router"] = routed_info(decision)
    return _ENCODER.encode(answer)


def routed_info(decision: PDDecision) -> dict[str, Any]:
    """Where a ``/generate`` answer went and why: its ``router`` member."""

    def holder(d: RouteDecision) -> dict[str, Any]:
        chosen = d.chosen
        return {
            "worker": d.worker,
            "dp_rank": d.dp_rank,
            "cost": chosen.cost,
            "cached_blocks": chosen.cached_blocks,
            "prefill_blocks": chosen.prefill_blocks,
            "pending_blocks": chosen.pending_blocks,
        }

    prefill = decision.prefill
    return {
        "decode": holder(decision.decode),
        "prefill": None if prefill is None else holder(prefill),
        "prefill_skipped": prefill is None,
        "prefill_reason": decision.prefill_reason,
        "uncached_tokens": decision.uncached_tokens,
    }


def error_answer(
    endpoint: Endpoint,
    status: int,
    message: str,
    kind: str,
    param: str | None,
    shown: list[tuple[bytes, bytes]] | None = None,
) -> Answer:
    """The client's error in the route's shape (see the module docstring)."""
    if endpoint != "generate":
        return Answer.error(OpenAIError(status, message, kind, param), shown or ())
    return Answer(status, [_JSON, *(shown or ())], _ENCODER.encode({"error": message}))


def error_kind(status: int) -> str:
    """OpenAI's error ``type`` for a status the P/D relay answers."""
    return {502: "bad_gateway", 504: "timeout"}.get(status, "invalid_request_error")


def samples_of(value: Any, where: str) -> int:
    """A request's samples (``n``): 1 when not given; OpenAIError 400 unless an int >= 1."""
    if value is None:
        return 1
    if type(value) is not int or value < 1:
        raise OpenAIError(400, f"{where} must be an integer >= 1, not {value!r}", param=where)
    return value


def _any_true(value: Any) -> bool:
    return any(v is True for v in value) if isinstance(value, list) else value is True
