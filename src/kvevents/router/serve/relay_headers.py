"""The OpenAI relay's headers: the client's that go on to the engine, the engine's the
client gets, and the decision's (where a request went and why) on every answer.

Headers stay the latin-1 bytes a server reads and writes; a client's header with a line
break is refused, never forwarded, since it would write headers of its own into the
engine's request. The worker's percent-quoted URL is kept per worker, not made per request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from urllib.parse import quote

from kvevents.router.decide.router import RouteDecision
from kvevents.router.serve.relay_answer import _JSON_BYTES, OpenAIError

__all__ = ["RANK_HEADER", "decision_headers", "decision_lines"]


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
        "proxy-connection",
        "authorization",  # the client's key is for the router; engines get the router's own
        "accept-encoding",
        "expect",  # the body is whole already: no 100 Continue to wait for
        RANK_HEADER.lower(),
    }
)
_DROP_RAW_HEADERS = frozenset(name.encode("latin-1") for name in _DROP_HEADERS)
"""The same names as the server gives them (lower-case bytes), read before decoding."""


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
