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
"""

from __future__ import annotations

import asyncio
import functools
from array import array
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any

from kvevents.errors import RouterNotReadyError
from kvevents.http.auth import Send
from kvevents.http.inline import InlineAnswer
from kvevents.http.upstream_answers import FullResponse
from kvevents.http.upstream_errors import MidwayError
from kvevents.router.decide.models import UnknownModelError
from kvevents.router.prompts.completion_body import RelayFields, token_prompt
from kvevents.router.prompts.tokenize import ChatError, TokenizeError
from kvevents.router.serve.bodies import Receive, Scope, read_body
from kvevents.router.serve.relay_answer import (
    _BODY_ERRORS,
    _JSON_BYTES,
    Answer,
    OpenAIError,
    _body_error,
    _describe,
    _inline,
    _settled,
    _tokenize_error,
)
from kvevents.router.serve.relay_body import _json_object, _with_rank, prompts_of
from kvevents.router.serve.relay_forward import Forward
from kvevents.router.serve.relay_headers import (
    RANK_HEADER,
    _engine_headers,
    _engine_lines,
    _forwarded,
    _request_lines,
)
from kvevents.router.serve.relay_stream import UsageTracker, until_gone
from kvevents.router.serve.request_stats import engine_usage_of_json
from kvevents.router.serve.service import FORWARD_ERRORS, RouterService, gateway_status

__all__ = ["RELAYED", "OpenAIRelay"]


RELAYED: Mapping[str, bool] = {"/v1/completions": False, "/v1/chat/completions": True}
"""The paths the relay answers (``POST``), each with whether it is a chat."""
_RANK_HEADER_BYTES = RANK_HEADER.encode("latin-1")


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

        await until_gone(relay(), gone(), stream, answer.release)

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
    ) -> Forward:
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
        return Forward(
            chat,
            decision,
            spec.url,
            content,
            _request_lines(headers),
            prompt_tokens,
            router.begin(decision),
        )

    async def _forward(self, fwd: Forward, fields: RelayFields) -> Answer:
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
            tracker = UsageTracker()
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
        fwd: Forward,
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

    def _unreachable(self, fwd: Forward, exc: BaseException) -> Answer:
        """No answer came from the engine (``exc`` says why): a 502, or a 504 when its
        deadline passed; the request ended."""
        service = self.service
        service.router.finish(fwd.ticket, failed=True)
        status, kind = gateway_status(exc)
        service.requests.record(fwd.endpoint, fwd.decision, fwd.prompt_tokens, status)
        failed = f"forwarding to {fwd.url} failed: {_describe(exc)}"
        return Answer.error(OpenAIError(status, failed, kind), fwd.shown)

    def _midway(self, fwd: Forward, status: int, exc: BaseException) -> Answer:
        """The engine's answer (``status``) began and broke off: a 502, or a 504 when its
        deadline passed; the request ended."""
        self.service.router.finish(fwd.ticket, failed=status != 200)
        midway = f"the engine {fwd.url} failed midway: {_describe(exc)}"
        code, kind = gateway_status(exc)
        return Answer.error(OpenAIError(code, midway, kind), fwd.shown)

    def _answered(
        self, fwd: Forward, status: int, passed: list[tuple[bytes, bytes]], payload: bytes
    ) -> Answer:
        """The engine's whole answer, as the client gets it; the request ended, and the
        engine's usage counted when it says."""
        service = self.service
        service.router.finish(fwd.ticket, failed=status != 200)
        if status == 200:
            service.requests.record_usage(fwd.ticket.holder, engine_usage_of_json(payload))
        return Answer(status, [*passed, *fwd.shown], payload)

    def _answered_whole(self, fwd: Forward, full: FullResponse) -> InlineAnswer:
        """:meth:`_answered` of the engine's whole answer, recorded, for the server to
        write: its headers as lines (the engine's, then the decision's), formatted in
        two steps, not one per header and again when written."""
        service, status, payload = self.service, full.status, full.body
        service.requests.record(fwd.endpoint, fwd.decision, fwd.prompt_tokens, status)
        service.router.finish(fwd.ticket, failed=status != 200)
        if status == 200:
            service.requests.record_usage(fwd.ticket.holder, engine_usage_of_json(payload))
        return status, _engine_lines(full.headers) + fwd.lines, payload
