"""The routing hot path: ``POST /route`` and ``POST /query`` as a bare ASGI app.

Every routing request goes through here, so it avoids what a framework adds per request:
no middleware stack, no request object, no dict built for the answer. A body is read
(bounded: a ``Content-Length`` past the limit is refused before any byte is read, and a
chunked body is counted as it arrives), decoded by a msgspec decoder built once, matched
and scored by the in-process :class:`~kvevents.router.core.Router`, and answered with a
msgspec struct encoded by one reused encoder. Every other path, and the app's lifespan,
go to the FastAPI app behind it (``/workers``, ``/metrics``, ``/docs``, the OpenAI routes),
where a framework costs nothing that matters.

Answers (JSON):

* ``/query``: ``{"prompt_tokens", "block_size", "matches": [{"worker", "dp_rank",
  "matched_blocks", "matched_tokens", "tiers": {"gpu", "cpu", "disk"},
  "predicted_blocks", "predicted_tokens"}]}``, one entry per known holder (tiers in
  tokens). ``matched_*`` and ``tiers`` are confirmed blocks only (the engine reported
  them); ``predicted_*``, present only when not zero, are the blocks predictions add
  after them (:mod:`kvevents.index.predictions`).
* ``/route``: ``{"worker", "dp_rank", "recorded", "n_blocks", "block_size", "holders",
  "predicted_blocks", "by_prediction", "scores": [...]}``: the chosen holder's score
  first, then the next best ``top - 1`` (``top`` in the body, default
  :data:`DEFAULT_TOP`), so the answer does not grow with the fleet; ``"all_scores":
  true`` returns every holder's. ``holders`` counts them all. Each score's ``matched``
  is confirmed blocks per tier and its ``predicted_blocks`` the predicted ones after
  them; the top-level ``predicted_blocks`` is the chosen holder's, and ``by_prediction``
  says whether confirmed blocks alone would have chosen another holder.

Both take ``model`` (:mod:`kvevents.router.models`): only the holders of engines serving
it are matched, scored and answered, and an adapter's name keys the request under it.

Errors answer ``{"error": message}``: 400 for a body the router cannot use (malformed
JSON, nesting too deep, a wrong field type, text that is not valid Unicode), 404 for a
``model`` no engine serves (the message lists those served), 413 past the body limit,
503 before any engine rank is known, and the tokenizer's own status when
tokenizing text fails. The connection stays usable after every one of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from kvevents.errors import KVEventsError, RouterNotReadyError
from kvevents.router.core import RouteDecision
from kvevents.router.models import UnknownModelError
from kvevents.router.scoring import HolderScore
from kvevents.router.service import DEFAULT_TOP, BadRequest, RouterService, TokenizeFailed

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_TOP", "HotPath"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
"""16 MiB: a 128k-token prompt as JSON ids is under 1 MiB; its text under 2 MiB."""


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
    """One holder's score as ``/route`` reports it (see :class:`~kvevents.router.scoring.HolderScore`)."""

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


class BodyTooLarge(KVEventsError):
    """The request body passed the limit; answered with 413."""


class _Disconnected(Exception):
    """The client went away before its body arrived."""


_ENCODER = msgspec.json.Encoder()
_JSON_HEADERS = [(b"content-type", b"application/json")]


def route_answer(decision: RouteDecision, *, recorded: bool, top: int | None) -> RouteAnswer:
    """The ``/route`` answer for a decision: the first ``top`` scores (all when None)."""
    scores = decision.scores if top is None else decision.scores[: max(1, top)]
    return RouteAnswer(
        decision.worker,
        decision.dp_rank,
        recorded,
        decision.n_blocks,
        decision.block_size,
        len(decision.scores),
        decision.chosen.predicted_blocks,
        decision.by_prediction,
        [ScoreAnswer.of(s) for s in scores],
    )


class HotPath:
    """ASGI app: ``POST /route`` and ``POST /query`` here, everything else to ``fallback``."""

    def __init__(
        self,
        service: RouterService,
        fallback: ASGIApp,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        if max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes={max_body_bytes}: must be a positive number")
        self.service = service
        self.fallback = fallback
        self.max_body_bytes = max_body_bytes
        self._handlers: dict[str, Callable[[bytes], Awaitable[bytes]]] = {
            "/route": self._route,
            "/query": self._query,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self._handlers.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await self.fallback(scope, receive, send)
            return
        try:
            raw = await self._body(scope, receive)
            status, answer = 200, await handler(raw)
        except _Disconnected:
            return
        except BadRequest as exc:
            status, answer = 400, _error(str(exc))
        except BodyTooLarge as exc:
            status, answer = 413, _error(str(exc))
        except TokenizeFailed as exc:
            status, answer = exc.status, _error(str(exc))
        except UnknownModelError as exc:
            status, answer = 404, _error(str(exc))
        except RecursionError:
            status, answer = 400, _error("request body: JSON nested too deeply")
        except UnicodeError as exc:
            status, answer = 400, _error(f"request body: text is not valid Unicode: {exc}")
        except RouterNotReadyError as exc:  # no engine rank yet; any other error is a 500
            status, answer = 503, _error(str(exc))
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*_JSON_HEADERS, (b"content-length", b"%d" % len(answer))],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit():
                    raise BadRequest(f"Content-Length {value!r} is not a number of bytes")
                if int(value) > limit:
                    raise BodyTooLarge(_too_large(int(value), limit))
                break
        message = await receive()
        if message["type"] != "http.request":
            raise _Disconnected
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):
            if len(body) > limit:
                raise BodyTooLarge(_too_large(len(body), limit))
            return body
        chunks = [body]
        size = len(body)
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(_too_large(size, limit))
            chunks.append(chunk)
        return b"".join(chunks)

    async def _query(self, raw: bytes) -> bytes:
        tokens, body = await self.service.tokens(raw)
        router = self.service.router
        matches, predicted = router.query_predicted(
            tokens, lora=body.lora, cache_salt=body.cache_salt, model=body.model
        )
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
        router = self.service.router
        decision = router.route(
            tokens, lora=body.lora, cache_salt=body.cache_salt, model=body.model
        )
        if body.record:
            router.record(decision)
        top = None if body.all_scores else body.top
        return _ENCODER.encode(route_answer(decision, recorded=body.record, top=top))


def _error(message: str) -> bytes:
    return _ENCODER.encode(ErrorAnswer(message))


def _too_large(size: int, limit: int) -> str:
    return (
        f"request body of {size} bytes is over the router's limit of {limit} bytes "
        "(kvevents router --max-body-bytes)"
    )
