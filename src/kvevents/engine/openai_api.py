"""The simulated engine's OpenAI-style endpoints: ``/v1/completions`` and ``/tokenize``.

Enough of vLLM's surface for a router to treat the simulated engine like a real one:

* ``POST /v1/completions``: ``prompt`` (text, token ids, or a list of one of them),
  ``max_tokens`` (default 16), ``stream``, ``stream_options.include_usage``. The rank is
  the header ``X-data-parallel-rank`` (vLLM's) or ``routed_dp_rank`` /
  ``data_parallel_rank`` in the body (SGLang's); without one, round-robin. Answers
  ``text_completion`` objects whose ``usage`` has ``prompt_tokens_details.cached_tokens``
  (the prefix the rank reused), and a non-standard ``dp_rank``. Streaming sends one
  ``data:`` chunk per generated token, then ``data: [DONE]``.
* ``POST /tokenize``: ``{"prompt": text}`` -> ``{"tokens", "count", "max_model_len"}``.

The byte tokenizer has no special tokens, so ``add_special_tokens`` changes nothing.
Errors answer OpenAI's ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvevents.engine.tokenizer import ByteTokenizer

__all__ = ["MODEL_NAME", "add_openai_routes"]

MODEL_NAME = "kvevents-sim"
MAX_MODEL_LEN = 1 << 20
DEFAULT_MAX_TOKENS = 16

Generate = Callable[[list[int], int | None, int], Awaitable[tuple[int, dict[str, Any]]]]
"""(token ids, rank or None, max new tokens) -> (rank used, the rank's generate result)."""


class _Invalid(Exception):
    pass


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}},
        status_code=status,
    )


def _int(value: Any, name: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _Invalid(f"{name}={value!r} must be an integer in {low}..{high}")
    return value


def _prompt(body: dict[str, Any], tokenizer: ByteTokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        tokens = [_int(t, "prompt token id", 0, 2**32 - 1) for t in prompt]
    else:
        raise _Invalid(
            "prompt must be text, a list of token ids, or a list of one of them "
            "(the simulated engine takes one prompt per request)"
        )
    if not tokens:
        raise _Invalid("the prompt is empty")
    return tokens


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


def add_openai_routes(app: FastAPI, dp_size: int, generate: Generate) -> None:
    """Serve the endpoints of the module docstring on ``app``."""
    tokenizer = ByteTokenizer()
    ids = itertools.count()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            return _error(400, 'give {"prompt": "text"}')
        tokens = tokenizer.encode(text)
        return JSONResponse(
            {"tokens": tokens, "count": len(tokens), "max_model_len": MAX_MODEL_LEN}
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise _Invalid("the body must be a JSON object")
            tokens = _prompt(body, tokenizer)
            rank = _rank(request, body, dp_size)
            max_tokens = body.get("max_tokens")
            max_new = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
            max_new = _int(max_new, "max_tokens", 0, 1_000_000)
        except ValueError as exc:
            return _error(400, f"the body is not JSON: {exc}")
        except _Invalid as exc:
            return _error(400, str(exc))
        rank, result = await generate(tokens, rank, max_new)
        output: list[int] = result["output_ids"]
        usage = {
            "prompt_tokens": result["prompt_tokens"],
            "completion_tokens": len(output),
            "total_tokens": result["prompt_tokens"] + len(output),
            "prompt_tokens_details": {"cached_tokens": result["cached_tokens"]},
        }
        head = {
            "id": f"cmpl-{uuid.uuid4().hex[:16]}-{next(ids)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or MODEL_NAME,
            "dp_rank": rank,
        }
        if body.get("stream") is not True:
            choice = {
                "index": 0,
                "text": tokenizer.decode(output),
                "logprobs": None,
                "finish_reason": "length",
            }
            return JSONResponse({**head, "choices": [choice], "usage": usage})
        options = body.get("stream_options")
        with_usage = isinstance(options, dict) and options.get("include_usage") is True

        async def events() -> AsyncIterator[bytes]:
            for i, token in enumerate(output):
                last = i == len(output) - 1
                choice = {
                    "index": 0,
                    "text": tokenizer.decode([token]),
                    "logprobs": None,
                    "finish_reason": "length" if last else None,
                }
                chunk = {**head, "choices": [choice], "usage": None}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            if with_usage:
                chunk = {**head, "choices": [], "usage": usage}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
