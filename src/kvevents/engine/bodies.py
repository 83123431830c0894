"""Reading request bodies safely: a size bound before buffering, and JSON that cannot crash.

Every engine endpoint that takes a body reads it with :func:`read_body` and parses it
with :func:`parse_json` (or, for ``/generate``, its msgspec decoder, with
:func:`diagnose` when that fails). What they refuse, as :class:`BodyError`:

* a body above the limit (413): refused from ``Content-Length`` before a byte is read,
  and for a chunked body as soon as the running count passes the limit, so no more than
  the limit plus one chunk is ever held;
* JSON nested deeper than the parser's recursion limit (about 1,000 levels; 400), which
  would otherwise escape as ``RecursionError``;
* a string holding an unpaired UTF-16 surrogate such as ``"\\ud800"`` (400): JSON allows
  the escape, but the text is no valid Unicode and cannot be encoded, tokenized or
  echoed back; the error names where it is (``$.messages[0].content``).

The answer to each is a 4xx with a message, never a 500, so the client's keep-alive
connection stays usable.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from starlette.requests import Request

__all__ = ["BodyError", "diagnose", "parse_json", "read_body"]


class BodyError(Exception):
    """A request body refused with HTTP ``status`` (400 or 413) and this message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_NESTED = "the body is nested too deeply (about 1,000 levels or more): flatten it"


def _too_large(size: str, limit: int) -> BodyError:
    return BodyError(
        413,
        f"the request body ({size}) is larger than this engine's limit of {limit} bytes "
        "(kvevents engine --max-body-bytes): send a shorter prompt",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body of ``request``, refused (413) as soon as it is known to pass ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise BodyError(400, f"Content-Length {declared[:40]!r} is not a number") from None
        if length > limit:
            raise _too_large(f"Content-Length {length}", limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit} bytes, chunked", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """``raw`` parsed as JSON; :class:`BodyError` (400) when it is not usable JSON.

    msgspec parses first: what it accepts is valid UTF-8 throughout (it refuses unpaired
    surrogates) and decodes to the values ``json`` gives, so the Unicode walk is not
    needed. What it refuses (and ``json`` may still take: ``NaN``, ``1e400``, integers
    past 64 bits) goes the slower way below, with its messages: ``json.loads`` plus the
    walk's ``json.dumps`` cost a large share of the engine's CPU per request, msgspec a
    small fraction of that."""
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        pass
    try:
        value = json.loads(raw)
    except RecursionError:
        raise BodyError(400, _NESTED) from None
    except ValueError as exc:
        raise BodyError(400, f"the body is not JSON: {exc}") from None
    _check_unicode(value)
    return value


def diagnose(raw: bytes, fallback: str) -> BodyError:
    """Why a strict decoder refused ``raw``: nesting or an unpaired surrogate when that is
    the cause, else ``fallback`` (the decoder's own message)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        return BodyError(400, _NESTED)
    except ValueError:
        return BodyError(400, fallback)
    try:
        _check_unicode(value)
    except BodyError as exc:
        return exc
    return BodyError(400, fallback)


def _check_unicode(value: Any) -> None:
    """Raise BodyError naming the first string (key or value) that is not valid Unicode."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return
    except RecursionError:
        raise BodyError(400, _NESTED) from None
    except UnicodeEncodeError:
        pass
    stack: list[tuple[str, Any]] = [("$", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, f"a key in {path}")
                shown = key.encode("utf-8", "backslashreplace").decode()  # safe to echo
                stack.append((f"{path}.{shown}", child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
        elif isinstance(item, str):
            _check_text(item, path)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise BodyError(
            400,
            f"{where} holds an unpaired surrogate ({bad.encode('unicode_escape').decode()}) "
            f"at character {exc.start}: JSON strings must be valid Unicode; pair it or remove it",
        ) from None
