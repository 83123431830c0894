"""The routing hot path: ``POST /route`` and ``POST /query`` as a bare ASGI app.

Every routing request goes through here, so it avoids what a framework adds per request:
no middleware stack, no request object, no dict built for the answer. A body is read
with a bound (:mod:`kvevents.router.serve.bodies`), decoded once
(:func:`~kvevents.router.prompts.token_body.decode_tokens_body`), matched and scored by
the in-process :class:`~kvevents.router.decide.router.Router`, and answered with a
msgspec struct encoded by one reused encoder; on uvicorn the plain cases are answered
from the parser's callbacks (:mod:`kvevents.http.inline`). The OpenAI routes go to the
relay (:mod:`kvevents.router.serve.openai_relay`); ``/workers``, ``/health`` and
``/ready`` are answered here too (:mod:`kvevents.router.serve.status`). The lifespan
starts and stops the service. Every other path goes to the FastAPI app behind it.

Answers (JSON):

* ``/query``: ``{"prompt_tokens", "block_size", "matches": [{"worker", "dp_rank",
  "matched_blocks", "matched_tokens", "tiers": {"gpu", "cpu", "disk"},
  "predicted_blocks", "predicted_tokens"}]}``, one entry per known holder (tiers in
  tokens). ``matched_*`` and ``tiers`` count confirmed blocks; ``predicted_*``, present
  only when not zero, the blocks predictions add after them.
* ``/route``: ``{"worker", "dp_rank", "recorded", "n_blocks", "block_size", "holders",
  "predicted_blocks", "by_prediction", "scores": [...]}``: the chosen holder's score
  first, then the next best ``top - 1`` (default :data:`DEFAULT_TOP`), so the answer does
  not grow with the fleet (``"all_scores": true`` returns every holder's). ``holders``
  counts them all; ``by_prediction`` says whether confirmed blocks alone would have
  chosen another holder.

Both take ``model`` (:mod:`kvevents.router.decide.models`). Errors answer ``{"error":
message}``: 400 for a body the router cannot use (naming the member), 405 for a method
other than ``POST``, 404 for a ``model`` no engine serves, 413 past the body limit, 503
before any engine rank is known, the tokenizer's status when tokenizing fails, 401
without the ``--api-key``. The connection stays usable after every one of them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import msgspec

from kvevents.errors import RouterNotReadyError
from kvevents.http.auth import ApiKey, ASGIApp, Send, send_unauthorized
from kvevents.http.inline import InlineAnswer
from kvevents.router.decide.models import UnknownModelError
from kvevents.router.decide.router import RouteDecision
from kvevents.router.decide.scoring import HolderScore
from kvevents.router.prompts.token_body import PLAIN_BODY, decode_tokens_body
from kvevents.router.serve.bodies import (
    DEFAULT_MAX_BODY_BYTES,
    BodyTooLarge,
    Disconnected,
    Receive,
    Scope,
    read_body,
)
from kvevents.router.serve.openai_relay import RELAYED, OpenAIRelay
from kvevents.router.serve.relay_answer import OpenAIError
from kvevents.router.serve.service import (
    DEFAULT_TOP,
    BadRequest,
    RouterService,
    TokenizeFailed,
    TokensBody,
)
from kvevents.router.serve.status import HEALTHY, ready_answer, workers_document

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_TOP",
    "ErrorAnswer",
    "HotPath",
    "QueryAnswer",
    "Receive",
    "RouteAnswer",
    "Scope",
    "Send",
    "keyed",
]


class Tiers(msgspec.Struct, gc=False):
    """Per-tier figures: tokens in ``/query``'s ``tiers``, blocks in ``/route``'s ``matched``."""

    gpu: int
    cpu: int
    disk: int


class QueryMatch(msgspec.Struct, gc=False, omit_defaults=True):
    worker: str
    dp_rank: int
    matched_blocks: int
    matched_tokens: int
    tiers: Tiers
    predicted_blocks: int = 0
    predicted_tokens: int = 0


class QueryAnswer(msgspec.Struct, gc=False):
    prompt_tokens: int
    block_size: int
    matches: list[QueryMatch]


class ScoreAnswer(msgspec.Struct, gc=False):
    """One holder's score as ``/route`` reports it (see :class:`~kvevents.router.decide.scoring.HolderScore`)."""

    worker: str
    dp_rank: int
    matched: Tiers
    cached_blocks: float
    prefill_blocks: float
    pending_blocks: float
    cost: float
    routed: int
    available: bool
    recent_blocks: float
    balance_blocks: float
    predicted_blocks: int

    @classmethod
    def of(cls, s: HolderScore) -> ScoreAnswer:
        m = s.matched
        return cls(
            s.worker,
            s.dp_rank,
            Tiers(m.gpu, m.cpu, m.disk),
            s.cached_blocks,
            s.prefill_blocks,
            s.pending_blocks,
            s.cost,
            s.routed,
            s.available,
            s.recent_blocks,
            s.balance_blocks,
            s.predicted_blocks,
        )


class RouteAnswer(msgspec.Struct, gc=False):
    worker: str
    dp_rank: int
    recorded: bool
    n_blocks: int
    block_size: int
    holders: int
    predicted_blocks: int
    by_prediction: bool
    scores: list[ScoreAnswer]


class ErrorAnswer(msgspec.Struct, gc=False):
    error: str


T = TypeVar("T")
InlineRelay = Callable[[bytes, list[tuple[bytes, bytes]], bytes], Awaitable[InlineAnswer] | None]
"""A relay's answer from the parser's callbacks: ``(path, headers, body)`` to the answer to
come, or None to serve the request as ASGI."""

log = logging.getLogger("kvevents.router")

_ENCODER = msgspec.json.Encoder()
_JSON_HEADERS = [(b"content-type", b"application/json")]


def route_answer(decision: RouteDecision, *, recorded: bool, top: int | None) -> RouteAnswer:
    """The ``/route`` answer for a decision: the first ``top`` scores (all when None)."""
    scores = decision.scores if top is None else decision.scores[: max(1, top)]
    return RouteAnswer(*_head(decision, recorded), [ScoreAnswer.of(s) for s in scores])


def encode_route_answer(decision: RouteDecision, *, recorded: bool, top: int | None) -> bytes:
    """:func:`route_answer` as JSON, its scores encoded with it each time: those of a
    one-pass choice (a recorded or relayed request) are new objects per request, so
    there is no earlier encoding of them to reuse."""
    return _ENCODER.encode(route_answer(decision, recorded=recorded, top=top))


def _head(
    decision: RouteDecision, recorded: bool
) -> tuple[str, int, bool, int, int, int, int, bool]:
    """The ``/route`` answer's fields before its scores."""
    return (
        decision.worker,
        decision.dp_rank,
        recorded,
        decision.n_blocks,
        decision.block_size,
        decision.candidates,
        decision.chosen.predicted_blocks,
        decision.by_prediction,
    )


class HotPath:
    """ASGI app: the routes of the module docstring here, everything else to ``fallback``.

    ``prepare``: work to do once the server accepts requests (the router builds its
    deferred FastAPI app there), so that it does not delay start-up
    (:meth:`RouterService.defer`).
    """

    def __init__(
        self,
        service: RouterService,
        fallback: ASGIApp,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        api_key: ApiKey | None = None,
        open_paths: Iterable[str] = (),
        prepare: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        if max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes={max_body_bytes}: must be a positive number")
        self.api_key = api_key
        self.open_paths = frozenset(open_paths)
        self.service = service
        self.fallback = fallback
        self.max_body_bytes = max_body_bytes
        self.relay = OpenAIRelay(service, max_body_bytes=max_body_bytes)
        """``POST`` of :attr:`relay_paths` (the OpenAI routes)."""
        self.relay_paths: frozenset[str] = frozenset(RELAYED)
        self._handlers: dict[str, Callable[[bytes], Awaitable[bytes]]] = {
            "/route": self._route,
            "/query": self._query,
        }
        self._reads: dict[str, Callable[[], tuple[int, bytes]]] = {
            "/workers": lambda: (200, _ENCODER.encode(workers_document(self.service))),
            "/health": lambda: (200, _HEALTHY),
            "/ready": self._ready,
        }
        if prepare is not None:
            service.defer(prepare)
        self.inline_paths = frozenset({b"/route", b"/query"})
        """Answered from uvicorn's parser callbacks when they can be (:meth:`answer_inline`)."""
        self.async_inline_paths = frozenset({b"/v1/completions"})
        """Relayed from uvicorn's parser callbacks when they can be (:meth:`answer_async_inline`);
        chats are rendered by the engine's tokenizer first, so they go the ASGI way."""
        self.inline_limit = max_body_bytes
        self._inline_relay: InlineRelay | None = None
        """The P/D relay's hook for :attr:`async_inline_paths` (:meth:`disaggregate`)."""

    def disaggregate(
        self,
        relay: OpenAIRelay,
        paths: frozenset[str],
        route: Callable[[bytes], Awaitable[bytes]],
        inline: InlineRelay,
    ) -> None:
        """Serve in disaggregated (P/D) mode (:mod:`kvevents.router.serve.pd_route`):
        ``POST`` of ``paths`` goes to ``relay`` and ``/route`` to ``route``; from the
        parser's callbacks, ``/query`` is answered and ``paths`` are given to ``inline``
        (``None`` from it: the request is served as ASGI)."""
        self.relay = relay
        self.relay_paths = paths
        self._handlers["/route"] = route
        self.inline_paths = frozenset({b"/query"})
        self.async_inline_paths = frozenset(path.encode("latin-1") for path in paths)
        self._inline_relay = inline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            await self.fallback(scope, receive, send)
            return
        path = scope["path"]
        key = self.api_key
        if key is not None and path not in self.open_paths and not key.matches(scope["headers"]):
            await send_unauthorized(scope, send)
            return
        if path in self.relay_paths and scope["method"] == "POST":
            await self.relay.asgi(scope, receive, send)
            return
        handler = self._handlers.get(path)
        if handler is None or scope["method"] != "POST":
            read = self._reads.get(path) if scope["method"] == "GET" else None
            if read is not None:
                await _send_json(send, *read())
            elif handler is not None or path in self.relay_paths:
                await _send_not_allowed(send, scope["method"], path)
            else:
                await self.fallback(scope, receive, send)
            return
        answered = await self._answer(handler, read_body(scope, receive, self.max_body_bytes))
        if answered is not None:
            await _send_json(send, *answered)

    def _ready(self) -> tuple[int, bytes]:
        status, state = ready_answer(self.service)
        return status, _ENCODER.encode(state)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """ASGI lifespan: start the service, then the deferred work; stop it at shutdown."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.service.start()
                except Exception as exc:
                    failed = f"{type(exc).__name__}: {exc}"
                    await send({"type": "lifespan.startup.failed", "message": failed})
                    raise
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.service.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _answer(
        self, handler: Callable[[bytes], Awaitable[bytes]], body: Awaitable[bytes]
    ) -> tuple[int, bytes] | None:
        """Status and answer for one hot-path request; None when the client went away."""
        try:
            return 200, await handler(await body)
        except Disconnected:
            return None
        except _REFUSALS as exc:
            return _refusal(exc)
        except Exception:  # a bug: a JSON 500 on every server, as the inline path answers
            log.exception("the router failed answering a request")
            return 500, _error("internal error: see the router's log")

    def answer_inline(
        self, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, bytes] | None:
        """``/route`` or ``/query`` answered synchronously from uvicorn's parser callbacks
        (:mod:`kvevents.http.inline`); None, so that the request is served as ASGI, when
        the key is missing or wrong (the 401 is written there) or the body is text or a
        chat (the tokenizer is asynchronous). Same answers as :meth:`__call__`, except
        that an unexpected error is a JSON 500 (the error is logged) and the connection
        stays open, where uvicorn answers a plain-text 500."""
        key = self.api_key
        if key is not None and not key.matches(headers):
            return None
        try:
            tokens, decoded = decode_tokens_body(body)
            if tokens is None:
                return None
            if path == b"/route":
                return 200, self._route_answer(tokens, decoded)
            return 200, self._query_answer(tokens, decoded)
        except _REFUSALS as exc:
            return _refusal(exc)
        except Exception:  # any other error is a 500, as the ASGI side answers it
            log.exception("the router failed answering %s", path.decode("latin-1"))
            return 500, _error("internal error: see the router's log")

    def answer_async_inline(
        self, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Awaitable[InlineAnswer] | None:
        """A completion relayed from uvicorn's parser callbacks, its answer written whole
        (:mod:`kvevents.http.inline`); None, to serve it as ASGI, when the key is missing
        or wrong or the relay cannot take it that way (:meth:`OpenAIRelay.inline`)."""
        key = self.api_key
        if key is not None and not key.matches(headers):
            return None
        pd = self._inline_relay
        if pd is not None:
            return pd(path, headers, body)
        return self.relay.inline(headers, body)

    async def _query(self, raw: bytes) -> bytes:
        tokens, body = await self.service.tokens(raw)
        return self._query_answer(tokens, body)

    def _query_answer(self, tokens: Sequence[int], body: TokensBody) -> bytes:
        router = self.service.router
        if body is PLAIN_BODY:
            answer = router.native.query(tokens)
            if answer is not None:
                return answer
        matches, predicted = keyed(router.query_predicted, tokens, body)
        get = predicted.get
        bs = router.index.block_size or 0
        return _ENCODER.encode(
            QueryAnswer(
                len(tokens),
                bs,
                [
                    QueryMatch(
                        h.worker,
                        h.dp_rank,
                        m.blocks,
                        m.blocks * bs,
                        Tiers(m.gpu * bs, m.cpu * bs, m.disk * bs),
                        get(h, 0),
                        get(h, 0) * bs,
                    )
                    for h, m in matches.items()
                ],
            )
        )

    async def _route(self, raw: bytes) -> bytes:
        tokens, body = await self.service.tokens(raw)
        return self._route_answer(tokens, body)

    def _route_answer(self, tokens: Sequence[int], body: TokensBody) -> bytes:
        router = self.service.router
        if body is PLAIN_BODY:
            answer = router.native.answer(tokens)
            if answer is not None:
                return answer
        top = None if body.all_scores else body.top
        decision = keyed(router.route, tokens, body, top=top)
        if body.record:
            router.record(decision)
        return encode_route_answer(decision, recorded=body.record, top=top)


def keyed(decide: Callable[..., T], tokens: Sequence[int], body: TokensBody, **more: Any) -> T:
    """``decide`` (``Router.route`` or ``query_predicted``) for the body's request, with
    ``more`` arguments; extra keys that cannot be keyed (ValueError) are the body's
    fault: 400."""
    try:
        return decide(
            tokens,
            lora=body.adapter,
            cache_salt=body.cache_salt,
            model=body.model,
            extra_keys=body.extra_keys,
            **more,
        )
    except ValueError as exc:
        if body.extra_keys is None:
            raise
        raise BadRequest(f"request body: {exc}") from None


def _error(message: str) -> bytes:
    return _ENCODER.encode(ErrorAnswer(message))


_REFUSALS = (
    BadRequest,
    BodyTooLarge,
    TokenizeFailed,
    UnknownModelError,
    RecursionError,
    UnicodeError,
    RouterNotReadyError,
)
"""What a hot-path request can be refused for; any other error is a 500."""


def _refusal(exc: BaseException) -> tuple[int, bytes]:
    """The status and ``{"error"}`` answer for one of :data:`_REFUSALS`."""
    if isinstance(exc, BadRequest):
        return 400, _error(str(exc))
    if isinstance(exc, BodyTooLarge):
        return 413, _error(str(exc))
    if isinstance(exc, TokenizeFailed):
        return exc.status, _error(str(exc))
    if isinstance(exc, UnknownModelError):
        return 404, _error(str(exc))
    if isinstance(exc, RecursionError):
        return 400, _error("request body: JSON nested too deeply")
    if isinstance(exc, UnicodeError):
        return 400, _error(f"request body: text is not valid Unicode: {exc}")
    return 503, _error(str(exc))  # RouterNotReadyError: no engine rank yet


_HEALTHY = _ENCODER.encode(HEALTHY)


async def _send_json(
    send: Send, status: int, answer: bytes, more: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    headers = [*_JSON_HEADERS, (b"content-length", b"%d" % len(answer)), *more]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


async def _send_not_allowed(send: Send, method: str, path: str) -> None:
    """405 for ``method`` on a POST-only path, saying so in the path's error shape."""
    message = f"{method} {path}: method not allowed; send a POST with a JSON body"
    if path in RELAYED:
        answer = OpenAIError(405, message, "method_not_allowed").body()
    else:
        answer = _error(message)
    await _send_json(send, 405, answer, [(b"allow", b"POST")])
