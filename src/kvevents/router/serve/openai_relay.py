"""The OpenAI relay: ``/v1/completions`` and ``/v1/chat/completions`` without a framework.

What the endpoints do, for clients, is :mod:`kvevents.router.serve.openai`'s docstring.
This module is how: :class:`OpenAIRelay` reads the body (bounded:
:mod:`kvevents.router.serve.bodies`), decodes it once (a prompt of token ids only into the
fields it reads: :mod:`kvevents.router.prompts.completion_body`), tokenizes what is text,
routes, and forwards the body bytes with the service's kept-alive client
(:mod:`kvevents.http.upstream`). The engine's answer comes back as the engine sent it,
never decoded and encoded again (of a complete answer only ``usage`` is read, for the
metrics). :class:`~kvevents.router.serve.hot_path.HotPath` hands it these paths
(:meth:`OpenAIRelay.asgi`, or from the inline protocol's callbacks:
:meth:`OpenAIRelay.inline`) before FastAPI sees them, because the framework's middleware,
request object and response classes cost a large share of the router's CPU per relayed
request (docs/router-performance.md); FastAPI's own routes hand the request over unread,
so the app alone answers the same.

A stream (``"stream": true`` answered 200) is relayed chunk by chunk as the engine sends
it; when the client goes away the relay stops, releases the engine's connection and
ends the request's in-flight count, as it does when the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

import msgspec

from kvevents.errors import KVEventsError, RouterNotReadyError
from kvevents.http.auth import Send
from kvevents.http.inline import InlineAnswer
from kvevents.http.upstream import FullResponse, MidwayError
from kvevents.router.decide.models import UnknownModelError
from kvevents.router.decide.router import RouteDecision, Ticket
from kvevents.router.prompts.completion_body import RelayFields, token_prompt
from kvevents.router.prompts.tokenize import ChatError, TokenizeError
from kvevents.router.serve.bodies import (
    BodyTooLarge,
    Disconnected,
    Receive,
    Scope,
    pinned_bytes,
    read_body,
)
from kvevents.router.serve.request_stats import engine_usage, engine_usage_of_json
from kvevents.router.serve.service import (
    FORWARD_ERRORS,
    BadRequest,
    RouterService,
    gateway_status,
)

__all__ = [
    "RANK_HEADER",
    "RELAYED",
    "OpenAIError",
    "OpenAIRelay",
    "decision_headers",
    "prompts_of",
]


RANK_HEADER = "X-data-parallel-rank"
RELAYED: Mapping[str, bool] = {"/v1/completions": False, "/v1/chat/completions": True}
"""The paths the relay answers (``POST``), each with whether it is a chat."""

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
        "proxy-connection",
        "authorization",  # the client's key is for the router; engines get the router's own
        "accept-encoding",
        "expect",  # the body is whole already: no 100 Continue to wait for
        RANK_HEADER.lower(),
    }
)
_DROP_RAW_HEADERS = frozenset(name.encode("latin-1") for name in _DROP_HEADERS)
"""The same names as the server gives them (lower-case bytes), read before decoding."""
_RANK_HEADER_BYTES = RANK_HEADER.encode("latin-1")
_MAX_TOKEN_ID = 2**32 - 1
_ENCODER = msgspec.json.Encoder()
_JSON_BYTES = b"application/json"


class OpenAIError(KVEventsError):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param

    def body(self) -> bytes:
        """``{"error": {"message", "type", "param", "code"}}`` as JSON."""
        error = {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}
        return _ENCODER.encode({"error": error})


class Answer:
    """What the relay answers: a status, headers (latin-1 bytes, as a server writes them),
    and a body or a stream of chunks."""

    __slots__ = ("body", "headers", "release", "status", "stream")

    def __init__(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes = b"",
        stream: AsyncIterator[bytes] | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.stream = stream
        self.release = release
        """With a stream: frees what it holds (idempotent) even if it never starts (a
        generator closed before its first step skips its own cleanup)."""

    @classmethod
    def error(cls, exc: OpenAIError, shown: Iterable[tuple[bytes, bytes]] = ()) -> Answer:
        return cls(exc.status, [(b"content-type", _JSON_BYTES), *shown], exc.body())


def _one_prompt(prompt: Any, where: str) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int}:
        # one C-level pass over the kinds, not a Python loop per token
        try:
            array("I", prompt)
        except OverflowError:
            raise OpenAIError(400, f"{where} token ids must be in 0..{_MAX_TOKEN_ID}") from None
        return prompt
    raise OpenAIError(
        400, f"{where} must be a string, a non-empty list of token ids, or a list of them"
    )


def prompts_of(body: Mapping[str, Any]) -> list[str | list[int]]:
    """The prompts of a completions body: one, or every prompt of a batch (OpenAIError 400 else)."""
    if "prompt" not in body:
        raise OpenAIError(400, "the body has no 'prompt' (text or a list of token ids)")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, "prompt")]


def decision_headers(decision: RouteDecision, prompt_tokens: int) -> list[tuple[bytes, bytes]]:
    """The response headers that show where a request went and why (latin-1 bytes)."""
    return [
        (b"x-kvevents-worker", _quoted_worker(decision.worker)),
        (b"x-kvevents-dp-rank", b"%d" % decision.dp_rank),
        (b"x-kvevents-matched-tokens", b"%d" % decision.matched_tokens),
        (b"x-kvevents-prompt-tokens", b"%d" % prompt_tokens),
        (b"x-kvevents-policy", decision.policy.encode("latin-1")),
        (b"x-kvevents-predicted-tokens", b"%d" % decision.predicted_tokens),
    ]


def decision_lines(decision: RouteDecision, prompt_tokens: int) -> bytes:
    """:func:`decision_headers` as the header lines a server writes (``name: value\\r\\n``
    each), formatted in one step: the relay's answers written whole carry them so."""
    return _DECISION_LINES % (
        _quoted_worker(decision.worker),
        decision.dp_rank,
        decision.matched_tokens,
        prompt_tokens,
        decision.policy.encode("latin-1"),
        decision.predicted_tokens,
    )


_DECISION_LINES = (
    b"x-kvevents-worker: %s\r\nx-kvevents-dp-rank: %d\r\nx-kvevents-matched-tokens: %d\r\n"
    b"x-kvevents-prompt-tokens: %d\r\nx-kvevents-policy: %s\r\nx-kvevents-predicted-tokens: %d\r\n"
)


def _quoted_worker(worker: str) -> bytes:
    """A worker URL as its header value (percent-quoted once, not per request)."""
    quoted = _QUOTED_WORKERS.get(worker)
    if quoted is None:
        if len(_QUOTED_WORKERS) >= _QUOTED_WORKERS_MAX:
            _QUOTED_WORKERS.clear()  # a fleet has a few engines: this is only a bound
        text = quote(worker, safe=":/?&=@[]+,;~!$'()*")
        quoted = _QUOTED_WORKERS[worker] = text.encode("latin-1")
    return quoted


_QUOTED_WORKERS: dict[str, bytes] = {}
"""Each worker URL as its header value (:func:`_quoted_worker`)."""
_QUOTED_WORKERS_MAX = 1024


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
            return engine_usage(msgspec.json.decode(self.last))
        except msgspec.DecodeError:
            return None


class OpenAIRelay:
    """Answers :data:`RELAYED` for ``service``; a body over ``max_body_bytes`` is a 413."""

    def __init__(self, service: RouterService, *, max_body_bytes: int) -> None:
        self.service = service
        self.max_body_bytes = max_body_bytes
        self._streamed: tuple[bytes, tuple[array[int], RelayFields]] | None = None
        """The last body :meth:`inline` read and left to the ASGI path because it asks
        for a stream, with what :func:`token_prompt` made of it (see :meth:`_token_prompt`)."""

    def inline(
        self, raw_headers: list[tuple[bytes, bytes]], raw: bytes
    ) -> Awaitable[InlineAnswer] | None:
        """The answer to come for a ``/v1/completions`` request whose answer is written
        whole, or None when it may be a stream or needs more than the plain decode
        (text, a batch, anything to refuse): the ASGI path (:meth:`asgi`) answers those."""
        fast = token_prompt(raw)
        if fast is None:
            return None
        if fast[1].wants_stream:
            self._streamed = (raw, fast)  # the ASGI path takes it up (_token_prompt)
            return None
        return self._relay_whole(_forwarded(raw_headers), raw, *fast)

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one ASGI request for a path of :data:`RELAYED`."""
        headers = _forwarded(scope["headers"])
        try:
            raw = await read_body(scope, receive, self.max_body_bytes)
            answer = await self.answer_path(scope["path"], headers, raw)
        except _BODY_ERRORS as exc:
            answer = Answer.error(_body_error(exc))
        raw_headers = answer.headers
        start = {"type": "http.response.start", "status": answer.status, "headers": raw_headers}
        if answer.stream is None:
            raw_headers.append((b"content-length", b"%d" % len(answer.body)))
            await send(start)
            await send({"type": "http.response.body", "body": answer.body})
            return
        stream = answer.stream

        async def relay() -> None:
            await send(start)
            async for chunk in stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        await _until_gone(relay(), gone(), stream, answer.release)

    def answer_path(self, path: str, headers: dict[bytes, bytes], raw: bytes) -> Awaitable[Answer]:
        """The answer to one request for ``path`` (the P/D relay answers its own paths)."""
        return self.answer(RELAYED[path], headers, raw)

    async def answer(self, chat: bool, headers: dict[bytes, bytes], raw: bytes) -> Answer:
        """The answer to one request: ``headers`` are the client's to forward (hop-by-hop,
        ``Authorization`` and any rank header already dropped), ``raw`` its body."""
        try:
            fast = None if chat else self._token_prompt(raw)
            if fast is not None:  # one prompt of token ids: its ints never become objects
                tokens, fields = fast
                routed = self._route(chat, headers, raw, fields, None, [tokens])
                return await self._forward(routed, fields)
            body = _json_object(raw, "chat completions" if chat else "completions")
            prompts: list[Sequence[int]]
            if chat:
                prompts = [await self._chat_tokens(body)]
            else:
                prompts = [await self._prompt_tokens(body, p) for p in prompts_of(body)]
            fields = RelayFields.of(body)
            return await self._forward(
                self._route(chat, headers, raw, fields, body, prompts), fields
            )
        except OpenAIError as exc:
            return Answer.error(exc)

    def _token_prompt(self, raw: bytes) -> tuple[array[int], RelayFields] | None:
        """:func:`token_prompt` of ``raw``, decoded once: a stream :meth:`inline` left to
        the ASGI path arrives here with the same bytes (uvicorn copies them into its
        cycle), so its decode is taken instead of done again: comparing the bytes costs
        far less than decoding them again. Equal bytes
        decode alike, whichever request sent them. Any other body, or that one after a
        later stream took its place, is decoded here."""
        streamed = self._streamed
        if streamed is not None and streamed[0] == raw:
            self._streamed = None
            return streamed[1]
        return token_prompt(raw)

    async def _chat_tokens(self, body: dict[str, Any]) -> list[int]:
        try:
            return await self.service.text_tokenizer.encode_chat(body)
        except ChatError as exc:
            raise OpenAIError(400, str(exc)) from None
        except TokenizeError as exc:
            raise _tokenize_error(exc) from None

    async def _prompt_tokens(self, body: dict[str, Any], prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return prompt
        model = body.get("model")
        try:
            return await self.service.text_tokenizer.encode(
                prompt,
                add_special_tokens=body.get("add_special_tokens", True) is not False,
                model=model if isinstance(model, str) else None,
            )
        except TokenizeError as exc:
            raise _tokenize_error(exc) from None

    def _route(
        self,
        chat: bool,
        headers: dict[bytes, bytes],
        raw: bytes,
        fields: RelayFields,
        body: dict[str, Any] | None,
        prompts: list[Sequence[int]],
    ) -> _Forward:
        """Route ``prompts`` and make ``raw`` the request for the chosen engine, counted
        in flight from here (:meth:`Router.begin`); ``body`` is the body decoded whole,
        or None when only ``fields`` were (:func:`token_prompt`)."""
        service = self.service
        router = service.router
        salt, policy, model = fields.salt, service.policy, fields.model_name
        try:
            # only the chosen holder's score is used: one prompt is routed with top=1
            decision = (
                router.route(prompts[0], cache_salt=salt, policy=policy, model=model, top=1)
                if len(prompts) == 1
                else router.route_batch(prompts, cache_salt=salt, policy=policy, model=model)
            )
        except UnknownModelError as exc:
            raise OpenAIError(404, str(exc), "NotFoundError", "model") from None
        except RouterNotReadyError as exc:
            raise OpenAIError(503, str(exc), "service_unavailable") from None
        prompt_tokens = len(prompts[0]) if len(prompts) == 1 else sum(map(len, prompts))
        spec = service.spec(decision.worker)
        headers[b"accept-encoding"] = b"identity"  # bytes are relayed as they come, unencoded
        headers[b"content-type"] = _JSON_BYTES  # the body was parsed as JSON
        if spec.engine_kind == "vllm":
            headers[_RANK_HEADER_BYTES] = b"%d" % decision.dp_rank
            content = raw
        else:
            content = _with_rank(raw, body, decision.dp_rank, fields.names_rank)
        return _Forward(
            chat,
            decision,
            spec.url,
            content,
            _request_lines(headers),
            prompt_tokens,
            router.begin(decision),
        )

    async def _forward(self, fwd: _Forward, fields: RelayFields) -> Answer:
        """Forward a request :meth:`_route` made; the engine's answer, a stream when
        ``fields`` ask for one and the engine answers 200."""
        service = self.service
        try:
            upstream = await service.upstream.post(fwd.url, fwd.path, fwd.content, fwd.headers)
        except FORWARD_ERRORS as exc:
            return self._unreachable(fwd, exc)
        except BaseException:  # cancelled (a forced shutdown, a caller's timeout): it ends here
            service.router.finish(fwd.ticket, failed=True)
            raise
        status = upstream.status
        service.requests.record(fwd.endpoint, fwd.decision, fwd.prompt_tokens, status)
        passed = _engine_headers(upstream.headers)
        if not fields.wants_stream or status != 200:
            try:
                payload = await upstream.read()
            except FORWARD_ERRORS as exc:
                upstream.release()
                return self._midway(fwd, status, exc)
            except BaseException:
                upstream.release()
                service.router.finish(fwd.ticket, failed=status != 200)
                raise
            upstream.release()
            return self._answered(fwd, status, passed, payload)
        # The request leaves the engine's count when the engine's answer ends (received,
        # failed, or its connection closed, as the relay's release does when a client
        # leaves), not when the client has read it: one that stops reading holds its
        # stream, not the rank.
        upstream.on_end(functools.partial(service.router.finish, fwd.ticket))

        async def relay() -> AsyncIterator[bytes]:
            tracker = _UsageTracker()
            try:
                async for chunk in upstream.chunks():
                    tracker.feed(chunk)
                    yield chunk
            except FORWARD_ERRORS as exc:
                midway = f"the engine {fwd.url} failed midway: {_describe(exc)}"
                code, kind = gateway_status(exc)
                yield b"event: error\ndata: " + OpenAIError(code, midway, kind).body()
                yield b"\n\n"
            finally:
                upstream.release()
                service.requests.record_usage(fwd.ticket.holder, tracker.usage())

        return Answer(status, [*passed, *fwd.shown], stream=relay(), release=upstream.release)

    def _relay_whole(
        self, headers: dict[bytes, bytes], raw: bytes, tokens: array[int], fields: RelayFields
    ) -> asyncio.Future[InlineAnswer]:
        """What :meth:`_forward` does, for an answer written whole, without a task or a coroutine:
        routed here, forwarded with :meth:`Upstream.post_whole`, answered from its
        future's callback. The future returned fails only on a bug (the server's 500).
        It is made on the exchange's loop (the running one: asking for that is a
        ``getpid`` system call each time)."""
        try:
            fwd = self._route(False, headers, raw, fields, None, [tokens])
        except OpenAIError as exc:
            return _settled(_inline(Answer.error(exc)))
        except Exception as exc:  # a bug: the server answers its 500
            return _settled(exc)
        try:
            exchange = self.service.upstream.post_whole(fwd.url, fwd.path, fwd.content, fwd.headers)
        except Exception as exc:
            self.service.router.finish(fwd.ticket, failed=True)
            return _settled(exc)
        answered: asyncio.Future[InlineAnswer] = exchange.get_loop().create_future()
        exchange.add_done_callback(lambda done: self._whole_done(fwd, done, answered))
        return answered

    def _whole_done(
        self,
        fwd: _Forward,
        done: asyncio.Future[FullResponse],
        answered: asyncio.Future[InlineAnswer],
    ) -> None:
        """The engine's whole answer (or why there is none) is in: conclude the request
        as :meth:`_forward` does and resolve ``answered``, unless the server gave it up."""
        if done.cancelled():
            answered.cancel()  # nothing cancels it but a forced shutdown
            self.service.router.finish(fwd.ticket, failed=True)
            return
        error = done.exception()
        try:
            if error is None:
                inline = self._answered_whole(fwd, done.result())
            elif isinstance(error, MidwayError):
                self.service.requests.record(
                    fwd.endpoint, fwd.decision, fwd.prompt_tokens, error.status
                )
                inline = _inline(self._midway(fwd, error.status, error.cause))
            elif isinstance(error, FORWARD_ERRORS):
                inline = _inline(self._unreachable(fwd, error))
            else:  # a bug: the request ends all the same
                self.service.router.finish(fwd.ticket, failed=True)
                raise error
        except Exception as exc:
            if not answered.done():
                answered.set_exception(exc)
            return
        if not answered.done():  # a forced shutdown cancels what it waits for
            answered.set_result(inline)

    def _unreachable(self, fwd: _Forward, exc: BaseException) -> Answer:
        """No answer came from the engine (``exc`` says why): a 502, or a 504 when its
        deadline passed; the request ended."""
        service = self.service
        service.router.finish(fwd.ticket, failed=True)
        status, kind = gateway_status(exc)
        service.requests.record(fwd.endpoint, fwd.decision, fwd.prompt_tokens, status)
        failed = f"forwarding to {fwd.url} failed: {_describe(exc)}"
        return Answer.error(OpenAIError(status, failed, kind), fwd.shown)

    def _midway(self, fwd: _Forward, status: int, exc: BaseException) -> Answer:
        """The engine's answer (``status``) began and broke off: a 502, or a 504 when its
        deadline passed; the request ended."""
        self.service.router.finish(fwd.ticket, failed=status != 200)
        midway = f"the engine {fwd.url} failed midway: {_describe(exc)}"
        code, kind = gateway_status(exc)
        return Answer.error(OpenAIError(code, midway, kind), fwd.shown)

    def _answered(
        self, fwd: _Forward, status: int, passed: list[tuple[bytes, bytes]], payload: bytes
    ) -> Answer:
        """The engine's whole answer, as the client gets it; the request ended, and the
        engine's usage counted when it says."""
        service = self.service
        service.router.finish(fwd.ticket, failed=status != 200)
        if status == 200:
            service.requests.record_usage(fwd.ticket.holder, engine_usage_of_json(payload))
        return Answer(status, [*passed, *fwd.shown], payload)

    def _answered_whole(self, fwd: _Forward, full: FullResponse) -> InlineAnswer:
        """:meth:`_answered` of the engine's whole answer, recorded, for the server to
        write: its headers as lines (the engine's, then the decision's), formatted in
        two steps, not one per header and again when written."""
        service, status, payload = self.service, full.status, full.body
        service.requests.record(fwd.endpoint, fwd.decision, fwd.prompt_tokens, status)
        service.router.finish(fwd.ticket, failed=status != 200)
        if status == 200:
            service.requests.record_usage(fwd.ticket.holder, engine_usage_of_json(payload))
        return status, _engine_lines(full.headers) + fwd.lines, payload


class _Forward:
    """One request routed and on its way to an engine (:meth:`OpenAIRelay._route`)."""

    __slots__ = (
        "content",
        "decision",
        "endpoint",
        "headers",
        "path",
        "prompt_tokens",
        "ticket",
        "url",
    )

    def __init__(
        self,
        chat: bool,
        decision: RouteDecision,
        url: str,
        content: bytes,
        headers: bytes,
        prompt_tokens: int,
        ticket: Ticket,
    ) -> None:
        self.path, self.endpoint = (
            ("/v1/chat/completions", "chat") if chat else ("/v1/completions", "completions")
        )
        self.decision = decision
        self.url = url
        self.content = content
        self.headers = headers
        """The request's header lines for the engine (:func:`_request_lines`)."""
        self.prompt_tokens = prompt_tokens
        self.ticket = ticket

    @property
    def shown(self) -> list[tuple[bytes, bytes]]:
        """The decision's response headers (:func:`decision_headers`)."""
        return decision_headers(self.decision, self.prompt_tokens)

    @property
    def lines(self) -> bytes:
        """The same as the lines a server writes (:func:`decision_lines`)."""
        return decision_lines(self.decision, self.prompt_tokens)


def _settled(outcome: InlineAnswer | Exception) -> asyncio.Future[InlineAnswer]:
    """A future of the running loop with ``outcome``, an answer or the exception it raises."""
    settled: asyncio.Future[InlineAnswer] = asyncio.get_running_loop().create_future()
    if isinstance(outcome, Exception):
        settled.set_exception(outcome)
    else:
        settled.set_result(outcome)
    return settled


def _inline(answer: Answer) -> InlineAnswer:
    assert answer.stream is None, "a body that does not ask for a stream gets none"
    return answer.status, answer.headers, answer.body


async def _until_gone(
    relay: Awaitable[None],
    gone: Awaitable[Any],
    stream: AsyncIterator[bytes],
    release: Callable[[], None] | None = None,
) -> None:
    """Run ``relay`` until it ends or ``gone`` (the client left) does, whichever is first;
    then close ``stream`` and call ``release``, so the engine's connection and the
    in-flight count are freed even when the relay stopped before the stream started."""
    relaying, watching = asyncio.ensure_future(relay), asyncio.ensure_future(gone)
    try:
        await asyncio.wait((relaying, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (relaying, watching):
            task.cancel()
        # Only the relay is awaited: the watch of the client ends with its connection,
        # which a kept-alive client keeps open.
        results = await asyncio.gather(relaying, return_exceptions=True)
        close = getattr(stream, "aclose", None)
        if close is not None:
            with contextlib.suppress(RuntimeError):  # already closed by its own end
                await close()
        if release is not None:
            release()
    error = results[0]
    if isinstance(error, BaseException) and not isinstance(
        error, (asyncio.CancelledError, OSError, RuntimeError)
    ):
        raise error  # a bug, not the client leaving: let the server log it


def _engine_headers(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """The engine's headers the client gets: its content type (JSON when it gave none),
    and ``retry-after`` when it said when to try again (a 429 or 503 of a busy engine)."""
    media = headers.get("content-type")
    passed = [(b"content-type", _JSON_BYTES if media is None else media.encode("latin-1"))]
    retry = headers.get("retry-after")
    if retry is not None:
        passed.append((b"retry-after", retry.encode("latin-1")))
    return passed


def _engine_lines(headers: Mapping[str, str]) -> bytes:
    """:func:`_engine_headers` as the header lines a server writes."""
    media = headers.get("content-type")
    lines = _JSON_LINE if media is None else b"content-type: %s\r\n" % media.encode("latin-1")
    retry = headers.get("retry-after")
    if retry is not None:
        lines += b"retry-after: %s\r\n" % retry.encode("latin-1")
    return lines


_JSON_LINE = b"content-type: application/json\r\n"


def _forwarded(raw_headers: Sequence[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """The client's headers that go on to the engine: not those of :data:`_DROP_HEADERS`,
    nor those its ``Connection`` header names (hop-by-hop, for this connection only). A
    header the client sent more than once goes on once, its values joined by ``", "``
    (what HTTP defines the repeated lines to mean; ``"; "`` for ``Cookie``); before,
    only the last one went. Names and values stay the bytes the server gave (names
    lower-case)."""
    drop = _DROP_RAW_HEADERS
    for name, value in raw_headers:
        if name == b"connection" and value.lower() not in _CONNECTION_ONLY:
            drop = drop | {token.strip().lower() for token in value.split(b",")}
    kept: dict[bytes, bytes] = {}
    for name, value in raw_headers:
        if name not in drop:
            earlier = kept.get(name)
            if earlier is None:
                kept[name] = value
            else:  # cookies are joined as one Cookie header joins them (RFC 6265)
                kept[name] = b"%s%s%s" % (earlier, b"; " if name == b"cookie" else b", ", value)
    return kept


def _request_lines(headers: dict[bytes, bytes]) -> bytes:
    """``headers`` as the lines of the request to the engine (``name: value\\r\\n`` each).

    The names come from the server's HTTP parser (tokens, never a colon). A line break
    in a name or value would write headers of the client's own into the engine's
    request: that is refused, an OpenAIError 400 naming the header."""
    lines = b"".join([b"%s: %s\r\n" % item for item in headers.items()])
    if lines.count(b"\n") != len(headers) or lines.count(b"\r") != len(headers):
        for name, value in headers.items():
            if any(end in name + value for end in (b"\r", b"\n")):
                shown = name.decode("latin-1")
                raise OpenAIError(
                    400,
                    f"the header {shown!r} has a line break in its name or value: send it "
                    "on one line (it would be forwarded to the engine)",
                )
    return lines


_CONNECTION_ONLY = frozenset({b"keep-alive", b"close"})
"""``Connection`` values that name no other header (the usual ones): nothing to split."""


def _with_rank(raw: bytes, body: dict[str, Any] | None, rank: int, names_rank: bool) -> bytes:
    """The body for an SGLang or kvevents engine: ``routed_dp_rank: rank`` set, a client's
    ``data_parallel_rank`` removed. When the body names neither (``names_rank``, read by
    the decoder, which resolves escaped keys), the key is appended to its bytes
    (:func:`~kvevents.router.serve.bodies.pinned_bytes`); else the decoded body
    (``body``, or ``raw`` decoded now when None) is changed and encoded again (2,048 token
    ids: tens of µs). ``raw`` is a non-empty JSON object."""
    if not names_rank and body != {}:
        return pinned_bytes(raw, rank)
    if body is None:
        body = _json_object(raw, "completions")
    body.pop("data_parallel_rank", None)
    body["routed_dp_rank"] = rank
    return _ENCODER.encode(body)


_BODY_ERRORS = (BodyTooLarge, BadRequest, Disconnected)


def _body_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, BodyTooLarge):
        return OpenAIError(413, str(exc))
    if isinstance(exc, BadRequest):
        return OpenAIError(400, str(exc))
    return OpenAIError(400, "the client went away before its body arrived")


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise OpenAIError(400, "the body is nested too deeply: flatten it") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the body must be a JSON object (an OpenAI {what} request)")
    return body


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
