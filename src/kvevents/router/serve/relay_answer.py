"""What the OpenAI relay answers: :class:`Answer` (a status, headers, a body or a stream),
and :class:`OpenAIError`, an error in OpenAI's shape, with what a failure (a body that
cannot be read, a tokenizer that refused, an engine that did not answer) becomes as one.

An :class:`Answer`'s headers are latin-1 bytes, as a server writes them; one written whole
goes to the inline protocol as its :data:`~kvevents.http.inline.InlineAnswer`, or as a
future already settled with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

import msgspec

from kvevents.errors import KVEventsError
from kvevents.http.inline import InlineAnswer
from kvevents.router.prompts.tokenize import TokenizeError
from kvevents.router.serve.bodies import BodyTooLarge, Disconnected
from kvevents.router.serve.service import BadRequest

__all__ = ["Answer", "OpenAIError"]


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


_BODY_ERRORS = (BodyTooLarge, BadRequest, Disconnected)


def _body_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, BodyTooLarge):
        return OpenAIError(413, str(exc))
    if isinstance(exc, BadRequest):
        return OpenAIError(400, str(exc))
    return OpenAIError(400, "the client went away before its body arrived")


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
