"""OpenAI-compatible routing to the engine rank holding the prefix.

``POST /v1/completions``: ``prompt`` is text, a list of token ids, or a list holding one
of either; a batch of several prompts answers 400 (send one request per prompt: each
may belong on another rank). Text is tokenized as the engine would
(:mod:`kvevents.router.tokenize`, honouring vLLM's ``add_special_tokens``).

``POST /v1/chat/completions``: ``messages`` are rendered with the engine's chat template
and tokenized (with ``--tokenize-endpoint``, by the engine's own ``/tokenize``; with the
default byte tokenizer, the simulated engine's template; ``--tokenizer FILE`` answers
501, as a ``tokenizer.json`` holds no template).

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

and it is counted (:mod:`kvevents.router.request_stats`, endpoint ``completions`` or
``chat``), with the engine's own ``cached_tokens`` when it reports them. Errors use
OpenAI's shape, ``{"error": {"message", "type", "code"}}``: 413 for a body over
``--max-body-bytes`` (refused before it is buffered whole), 400 for a bad body (the
engine's own 400, 413 or 422 when its ``/tokenize`` refused the input), 501 for a chat
the tokenizer cannot render, 502 when tokenizing failed otherwise, 503 with no rank
available, and 502 when the engine cannot be reached.

Over 300 lines on purpose: the two OpenAI endpoints share one forwarding path (routing,
headers, streaming relay, usage, errors in OpenAI's shape), which reads best in one
place.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvevents.errors import KVEventsError, RouterNotReadyError
from kvevents.router.bodies import DEFAULT_MAX_BODY_BYTES, BodyTooLarge, Disconnected, read_body
from kvevents.router.core import RouteDecision
from kvevents.router.request_stats import engine_usage
from kvevents.router.service import FORWARD_ERRORS, BadRequest
from kvevents.router.tokenize import ChatError, TokenizeError

if TYPE_CHECKING:
    from kvevents.router.service import RouterService

__all__ = ["RANK_HEADER", "add_openai_routes", "decision_headers", "prompt_of"]

RANK_HEADER = "X-data-parallel-rank"
_DROP_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        "authorization",  # the client's key is for the router; engines get the router's own
        "accept-encoding",
        RANK_HEADER.lower(),
    }
)
_MAX_TOKEN_ID = 2**32 - 1


class OpenAIError(KVEventsError):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": str(self), "type": self.kind, "code": self.status}},
            status_code=self.status,
        )


def prompt_of(body: Mapping[str, Any]) -> str | list[int]:
    """The single prompt of a completions body: text or token ids (OpenAIError 400 else)."""
    if "prompt" not in body:
        raise OpenAIError(400, "the body has no 'prompt' (text or a list of token ids)")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        kinds = set(map(type, prompt))  # one C-level pass, not a Python loop per token
        if kinds == {int}:
            try:
                array("I", prompt)
            except OverflowError:
                raise OpenAIError(400, f"prompt token ids must be in 0..{_MAX_TOKEN_ID}") from None
            return prompt
        if kinds <= {str, list}:
            raise OpenAIError(
                400,
                f"prompt holds a batch of {len(prompt)} prompts; the router places one prompt "
                "per request (each may belong on another rank): send one request per prompt",
            )
    raise OpenAIError(
        400, "prompt must be a string, a non-empty list of token ids, or a list of one of them"
    )


def decision_headers(decision: RouteDecision, prompt_tokens: int) -> dict[str, str]:
    """The response headers that show where a request went and why."""
    return {
        "x-kvevents-worker": quote(decision.worker, safe=":/?&=@[]+,;~!$'()*"),
        "x-kvevents-dp-rank": str(decision.dp_rank),
        "x-kvevents-matched-tokens": str(decision.matched_tokens),
        "x-kvevents-prompt-tokens": str(prompt_tokens),
        "x-kvevents-policy": decision.policy,
        "x-kvevents-predicted-tokens": str(decision.predicted_tokens),
    }


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS}


class _UsageTracker:
    """Remembers the last SSE ``data:`` line that carries usage (``include_usage``)."""

    def __init__(self) -> None:
        self._partial = b""
        self.last: bytes | None = None

    def feed(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()[-65536:]
        for line in lines:
            if line.startswith(b"data:") and b'"usage"' in line:
                self.last = line[5:].strip()

    def usage(self) -> tuple[int, int] | None:
        if self.last is None:
            return None
        try:
            return engine_usage(json.loads(self.last))
        except ValueError:
            return None


def add_openai_routes(
    app: FastAPI, service: RouterService, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> None:
    """Serve the OpenAI endpoints of the module docstring on ``app`` for ``service``; a
    body over ``max_body_bytes`` answers 413."""
    router = service.router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            raw, body = await _json_body(request, "completions", max_body_bytes)
            return await _forward(request, raw, body, await _prompt_tokens(body), chat=False)
        except OpenAIError as exc:
            return exc.response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            raw, body = await _json_body(request, "chat completions", max_body_bytes)
            try:
                tokens = await service.text_tokenizer.encode_chat(body)
            except ChatError as exc:
                raise OpenAIError(400, str(exc)) from None
            except TokenizeError as exc:
                raise _tokenize_error(exc) from None
            return await _forward(request, raw, body, tokens, chat=True)
        except OpenAIError as exc:
            return exc.response()

    async def _prompt_tokens(body: dict[str, Any]) -> list[int]:
        prompt = prompt_of(body)
        if not isinstance(prompt, str):
            return prompt
        model = body.get("model")
        try:
            return await service.text_tokenizer.encode(
                prompt,
                add_special_tokens=body.get("add_special_tokens", True) is not False,
                model=model if isinstance(model, str) else None,
            )
        except TokenizeError as exc:
            raise _tokenize_error(exc) from None

    async def _forward(
        request: Request, raw: bytes, body: dict[str, Any], tokens: list[int], *, chat: bool
    ) -> Response:
        path, endpoint = (
            ("/v1/chat/completions", "chat") if chat else ("/v1/completions", "completions")
        )
        salt = body.get("cache_salt")
        try:
            decision = router.route(
                tokens, cache_salt=salt if isinstance(salt, str) else None, policy=service.policy
            )
        except RouterNotReadyError as exc:
            raise OpenAIError(503, str(exc), "service_unavailable") from None
        spec = service.spec(decision.worker)
        headers = _forward_headers(request)
        headers["accept-encoding"] = "identity"  # bytes are relayed as they come, unencoded
        headers["content-type"] = "application/json"  # the body was parsed as JSON
        if spec.engine_kind == "vllm":
            headers[RANK_HEADER] = str(decision.dp_rank)
            content = raw
        else:
            body.pop("data_parallel_rank", None)
            body["routed_dp_rank"] = decision.dp_rank
            content = msgspec.json.encode(body)
        shown = decision_headers(decision, len(tokens))
        url = f"{spec.url}{path}"
        ticket = router.begin(decision)
        try:
            upstream = await service.session.post(url, data=content, headers=headers)
        except FORWARD_ERRORS as exc:
            router.finish(ticket, failed=True)
            service.requests.record(endpoint, decision, len(tokens), 502)
            error = OpenAIError(
                502,
                f"forwarding to {spec.url} failed: {_describe(exc)}",
                "bad_gateway",
            )
            response = error.response()
            response.headers.update(shown)
            return response
        status = upstream.status
        service.requests.record(endpoint, decision, len(tokens), status)
        media = upstream.headers.get("content-type", "application/json")
        if body.get("stream") is not True or status != 200:
            try:
                payload = await upstream.read()
            except FORWARD_ERRORS as exc:
                error = OpenAIError(
                    502, f"the engine {spec.url} failed midway: {_describe(exc)}", "bad_gateway"
                )
                response = error.response()
                response.headers.update(shown)
                return response
            finally:
                upstream.release()
                router.finish(ticket, failed=status != 200)
            if status == 200:
                try:
                    usage = engine_usage(msgspec.json.decode(payload))
                except msgspec.DecodeError:
                    usage = None
                service.requests.record_usage(decision.holder, usage)
            return Response(payload, status_code=status, media_type=media, headers=shown)

        async def relay() -> AsyncIterator[bytes]:
            tracker = _UsageTracker()
            try:
                async for chunk in upstream.content.iter_any():
                    tracker.feed(chunk)
                    yield chunk
            except FORWARD_ERRORS as exc:
                message = f"the engine {spec.url} failed midway: {_describe(exc)}"
                error = {"error": {"message": message, "type": "bad_gateway", "code": 502}}
                yield b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n"
            finally:
                upstream.release()
                router.finish(ticket)
                service.requests.record_usage(decision.holder, tracker.usage())

        return StreamingResponse(relay(), status_code=status, media_type=media, headers=shown)


async def _json_body(request: Request, what: str, limit: int) -> tuple[bytes, dict[str, Any]]:
    try:
        raw = await read_body(request.scope, request.receive, limit)
    except BodyTooLarge as exc:
        raise OpenAIError(413, str(exc)) from None
    except BadRequest as exc:
        raise OpenAIError(400, str(exc)) from None
    except Disconnected:
        raise OpenAIError(400, "the client went away before its body arrived") from None
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise OpenAIError(400, "the body is nested too deeply: flatten it") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the body must be a JSON object (an OpenAI {what} request)")
    return raw, body


def _describe(exc: BaseException) -> str:
    """``Type: message`` of a forwarding failure (a timeout has no message of its own)."""
    text = str(exc) or "no answer within the forward timeout"
    return f"{type(exc).__name__}: {text}"


def _tokenize_error(exc: TokenizeError) -> OpenAIError:
    if exc.status == 501:
        kind = "not_implemented"
    elif 400 <= exc.status < 500:
        kind = "invalid_request_error"  # the engine's /tokenize refused the client's input
    else:
        kind = "tokenizer_error"
    return OpenAIError(exc.status, str(exc), kind)
