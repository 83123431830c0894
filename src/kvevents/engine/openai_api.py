"""The simulated engine's OpenAI-style endpoints: completions, chat completions, ``/tokenize``.

Enough of vLLM's surface for a router to treat the simulated engine like a real one:

* ``GET /v1/models``: the served names and LoRA adapters in vLLM's shape
  (:mod:`kvevents.engine.models`).
* ``POST /v1/completions``: ``prompt`` (text, token ids, or a list of several of
  them: a batch, each prompt answered as choice ``index`` i, all on one rank, usage
  summed), ``max_tokens`` (default 16), ``stream``, ``stream_options.include_usage``.
  ``model`` names a served name (the base model) or an adapter (the request runs
  under it: its own prefix-cache namespace); any other answers 404. The rank is
  the header ``X-data-parallel-rank`` (vLLM's) or ``routed_dp_rank`` /
  ``data_parallel_rank`` in the body (SGLang's); without one, round-robin. Answers
  ``text_completion`` objects whose ``usage`` has ``prompt_tokens_details.cached_tokens``
  (the prefix the rank reused), and a non-standard ``dp_rank``. Streaming sends one
  ``data:`` chunk per generated token, then ``data: [DONE]``.
* ``POST /v1/chat/completions``: the same for ``messages`` rendered with the engine's
  chat template (:mod:`kvevents.text.chat`; ``add_generation_prompt``,
  ``continue_final_message``), ``max_completion_tokens`` or ``max_tokens``. Answers
  ``chat.completion`` objects; streaming sends the role first, then one ``delta`` per
  token.
* ``POST /tokenize``: ``{"prompt": text}`` or, as vLLM takes it, ``{"messages": [...],
  "add_generation_prompt": true}`` -> ``{"tokens", "count", "max_model_len"}``.

On a disaggregated engine both routes also take SGLang's ``bootstrap_*`` fields and vLLM's
``kv_transfer_params`` (:mod:`kvevents.engine.disaggregation`); a vLLM prefill leg's
answer carries ``kv_transfer_params`` for the decode leg, and ``n`` sizes a list of
rooms (one sample per prompt is generated all the same).

The byte tokenizer has no special tokens, so ``add_special_tokens`` changes nothing.
Each body is checked against its struct in :mod:`kvevents.api.openai` (the one the
OpenAPI document shows) before the checks above. Errors answer OpenAI's
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvevents.api.openai import ChatRequest, CompletionRequest, TokenizeRequest
from kvevents.engine.bodies import BodyError, parse_json, read_body
from kvevents.engine.disaggregation import Disaggregation, DisaggregationError
from kvevents.engine.models import DEFAULT_MODEL_NAME, ServedModels, UnknownModel, lora_keys
from kvevents.text.chat import ChatError, render_chat
from kvevents.text.tokenizer import ByteTokenizer

__all__ = ["MODEL_NAME", "add_openai_routes"]

MODEL_NAME = DEFAULT_MODEL_NAME
MAX_MODEL_LEN = 1 << 20
DEFAULT_MAX_TOKENS = 16

Generate = Callable[
    [list[int], int | None, int, dict[str, Any] | None], Awaitable[tuple[int, dict[str, Any]]]
]
"""(token ids, rank or None, max new tokens, what names its blocks or None: ``cache_salt``,
``lora_name``, ``lora_id``) -> (rank used, the rank's generate result)."""


class _Invalid(Exception):
    pass


class _Refused(Exception):
    """A body refused with ``status`` (e.g. 413), not 400."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}},
        status_code=status,
    )


def _int(value: Any, name: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _Invalid(f"{name}={value!r} must be an integer in {low}..{high}")
    return value


def _token_ids(values: list[Any]) -> bool:
    """True when every value is an int (not a bool) in 0..2**32-1, checked at C speed:
    one pass over the kinds, one conversion to ``array("I")``. False sends the caller to
    the per-token checks, whose message names the first bad value (that loop costs a
    large share of the engine's CPU per long prompt, so it runs only to word an error)."""
    if not values or set(map(type, values)) != {int}:
        return False
    try:
        array("I", values)
    except OverflowError:
        return False
    return True


def _prompts(body: dict[str, Any], tokenizer: ByteTokenizer) -> list[list[int]]:
    """The prompts of a completions body: one, or the batch a list of prompts holds."""
    prompt = body.get("prompt")
    batch = (
        prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
        else [prompt]
    )
    out = []
    for i, one in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        if isinstance(one, str):
            tokens = tokenizer.encode(one)
        elif isinstance(one, list) and _token_ids(one):
            tokens = one
        elif isinstance(one, list) and all(isinstance(t, int) for t in one):
            tokens = [_int(t, f"{where} token id", 0, 2**32 - 1) for t in one]
        else:
            raise _Invalid(
                f"{where} must be text or a list of token ids (a list of several of them "
                "is a batch)"
            )
        if not tokens:
            raise _Invalid(f"{where} is empty")
        out.append(tokens)
    return out


def _rank(request: Request, body: dict[str, Any], dp_size: int) -> int | None:
    found: dict[str, int] = {}
    header = request.headers.get("x-data-parallel-rank")
    if header is not None:
        try:
            found["X-data-parallel-rank header"] = int(header)
        except ValueError:
            raise _Invalid(f"X-data-parallel-rank: {header!r} is not an integer") from None
    for key in ("routed_dp_rank", "data_parallel_rank"):
        if body.get(key) is not None:
            found[key] = _int(body[key], key, 0, dp_size - 1)
    if len(set(found.values())) > 1:
        raise _Invalid(f"the request names different ranks: {found}; give one")
    rank = next(iter(found.values()), None)
    if rank is not None and not 0 <= rank < dp_size:
        raise _Invalid(f"rank {rank} is out of range: this engine has ranks 0..{dp_size - 1}")
    return rank


def _chat_prompt(body: dict[str, Any], tokenizer: ByteTokenizer) -> list[int]:
    """The token ids of a chat body's ``messages`` rendered with the engine's template."""
    flags = {}
    for key, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        value = body.get(key, default)
        if not isinstance(value, bool):
            raise _Invalid(f"{key}={value!r} must be true or false")
        flags[key] = value
    try:
        text = render_chat(body.get("messages"), **flags)
    except ChatError as exc:
        raise _Invalid(str(exc)) from None
    return tokenizer.encode(text)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = parse_json(raw)
    except BodyError as exc:
        raise _Invalid(str(exc)) from None
    if not isinstance(body, dict):
        raise _Invalid("the body must be a JSON object")
    return body


def _conform(body: dict[str, Any], shape: type[msgspec.Struct]) -> None:
    """Refuse a body whose fields do not have the types ``shape`` declares (the struct
    the OpenAPI document shows for this endpoint; unknown keys are allowed). Run after
    the hand checks, whose messages say more about the fields they know."""
    try:
        msgspec.convert(body, shape)
    except msgspec.ValidationError as exc:
        raise _Invalid(
            f"the body does not match the {shape.__name__} schema (/docs): {exc}"
        ) from None


def add_openai_routes(
    app: FastAPI,
    dp_size: int,
    generate: Generate,
    *,
    max_new_tokens: int = 1_000_000,
    max_body_bytes: int = 8 << 20,
    models: ServedModels | None = None,
    disaggregation: Disaggregation | None = None,
) -> None:
    """Serve the endpoints of the module docstring on ``app``; ``max_new_tokens`` caps
    ``max_tokens`` / ``max_completion_tokens`` (more is a 400), ``max_body_bytes`` the
    body (more is a 413); ``disaggregation`` is the engine's P/D role, if any."""

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            raw = await read_body(request, max_body_bytes)
        except BodyError as exc:
            raise _Refused(exc.status, str(exc)) from None
        return _json_object(raw)

    tokenizer = ByteTokenizer()
    ids = itertools.count()
    served = models or ServedModels()

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(served.v1_models(MAX_MODEL_LEN))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        try:
            body = await body_of(request)
            if "messages" in body:
                tokens = _chat_prompt(body, tokenizer)
            elif isinstance(body.get("prompt"), str):
                tokens = tokenizer.encode(body["prompt"])
            else:
                raise _Invalid('give {"prompt": "text"} or {"messages": [...]}')
            _conform(body, TokenizeRequest)
        except _Invalid as exc:
            return _error(400, str(exc))
        except _Refused as exc:
            return _error(exc.status, str(exc))
        return JSONResponse(
            {"tokens": tokens, "count": len(tokens), "max_model_len": MAX_MODEL_LEN}
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, chat=True)

    async def _serve(request: Request, *, chat: bool) -> Response:
        try:
            body = await body_of(request)
            prompts = [_chat_prompt(body, tokenizer)] if chat else _prompts(body, tokenizer)
            rank = _rank(request, body, dp_size)
            key = "max_tokens"
            if chat and body.get("max_completion_tokens") is not None:
                key = "max_completion_tokens"
            max_tokens = body.get(key)
            # the default never passes the limit (a client that gave none asked nothing)
            max_new = min(DEFAULT_MAX_TOKENS, max_new_tokens) if max_tokens is None else max_tokens
            max_new = _int(max_new, key, 0, max_new_tokens)
            _conform(body, ChatRequest if chat else CompletionRequest)
            salt = body.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise _Invalid(f"cache_salt must be a string, not {type(salt).__name__}")
            lora = served.resolve(body.get("model"))
            handoff = None
            if disaggregation is not None:
                n = 1 if body.get("n") is None else body["n"]
                handoff = disaggregation.handoff(
                    body, len(prompts), n, stream=body.get("stream") is True
                )
        except _Invalid as exc:
            return _error(400, str(exc))
        except _Refused as exc:
            return _error(exc.status, str(exc))
        except UnknownModel as exc:
            return _error(404, str(exc), "NotFoundError", "model")
        except DisaggregationError as exc:
            return _error(exc.status, str(exc))
        keys: dict[str, Any] = {} if salt is None else {"cache_salt": salt}
        if lora is not None:
            keys |= lora_keys(lora)
        kv_transfer_params = None
        if handoff is None:
            # A batch runs on one rank, as one vLLM request does: the first prompt picks
            # it when the request names none.
            rank, first = await generate(prompts[0], rank, max_new, keys or None)
            rest = await asyncio.gather(
                *(generate(p, rank, max_new, keys or None) for p in prompts[1:])
            )
            results = [first, *(r for _, r in rest)]
        else:
            assert disaggregation is not None
            try:
                leg = await disaggregation.run(
                    handoff, generate, prompts, rank, max_new, keys or None, request.url.hostname
                )
            except DisaggregationError as exc:
                kind = "invalid_request_error" if exc.status < 500 else "disaggregation_error"
                return _error(exc.status, str(exc), kind)
            rank, results, kv_transfer_params = leg.rank, leg.results, leg.kv_transfer_params
        outputs: list[list[int]] = [r["output_ids"] for r in results]
        prompt_tokens = sum(r["prompt_tokens"] for r in results)
        completion_tokens = sum(map(len, outputs))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(r["cached_tokens"] for r in results)},
        }
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}-{next(ids)}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or served.base,
            "dp_rank": rank,
        }
        if body.get("stream") is not True:
            choices = []
            for index, output in enumerate(outputs):
                text = tokenizer.decode(output)
                choice: dict[str, Any] = {"index": index}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                choice.update(logprobs=None, finish_reason="length")
                choices.append(choice)
            answer = {**head, "choices": choices, "usage": usage}
            if kv_transfer_params is not None:  # a vLLM prefill leg's, for the decode leg
                answer["kv_transfer_params"] = kv_transfer_params
            return JSONResponse(answer)
        options = body.get("stream_options")
        with_usage = isinstance(options, dict) and options.get("include_usage") is True
        if chat:
            head["object"] = "chat.completion.chunk"

        def chunk(choices: list[dict[str, Any]], chunk_usage: Any = None) -> bytes:
            data = {**head, "choices": choices, "usage": chunk_usage}
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        async def events() -> AsyncIterator[bytes]:
            if chat:  # the role comes first, in a chunk of its own, as OpenAI sends it
                delta = {"role": "assistant", "content": ""}
                yield chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])
            for index, output in enumerate(outputs):
                for i, token in enumerate(output):
                    piece = tokenizer.decode([token])
                    choice: dict[str, Any] = {"index": index}
                    if chat:
                        choice["delta"] = {"content": piece}
                    else:
                        choice["text"] = piece
                    last = i == len(output) - 1
                    choice.update(logprobs=None, finish_reason="length" if last else None)
                    yield chunk([choice])
            if with_usage:
                yield chunk([], usage)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
