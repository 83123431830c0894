"""Request bodies: read with a size bound before they are buffered whole, and members
spliced into one as the relays forward it.

Every route of the router that takes a body (the hot path's ``/route`` and ``/query``,
and FastAPI's ``/generate``, ``/v1/completions`` and ``/v1/chat/completions``) reads it
with :func:`read_body` and the one ``--max-body-bytes`` limit. A body past the limit is
:class:`BodyTooLarge` (answered 413 in the route's error shape): refused from
``Content-Length`` before a byte is read, and for a chunked body as soon as the running
count passes the limit, so no more than the limit plus one chunk is ever held. The
connection stays usable after the answer.

A relay adds members to a client's body (a rank pin, the P/D legs' fields) by splicing
them before its closing brace (:func:`spliced`), not by decoding and encoding it again:
the body was already validated as a JSON object, and a member given twice means its
last value to the engines' parsers.
"""

from __future__ import annotations

from kvevents.errors import KVEventsError
from kvevents.http.auth import Message, Receive, Scope
from kvevents.router.serve.service import BadRequest

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "BodyTooLarge",
    "Disconnected",
    "Message",
    "Receive",
    "Scope",
    "pinned_bytes",
    "read_body",
    "spliced",
]

_WHITESPACE = b" \t\r\n"


DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
"""16 MiB: a 128k-token prompt as JSON ids is under 1 MiB; its text under 2 MiB."""


class BodyTooLarge(KVEventsError):
    """The request body passed the limit; answered with 413."""


class Disconnected(Exception):
    """The client went away before its body arrived (nothing is answered)."""


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, refused (:class:`BodyTooLarge`) as soon as it is known to
    pass ``limit`` bytes: from ``Content-Length`` before a byte is read, else by counting
    a chunked body as it arrives, so no more than the limit plus one chunk is held.

    Every route of the router that takes a body reads it with this (the FastAPI ones
    pass ``request.scope`` and ``request.receive``). :class:`BadRequest` for a
    ``Content-Length`` that is no number, :class:`Disconnected` when the client left.
    """
    for name, value in scope["headers"]:
        if name == b"content-length":
            if not value.isdigit():
                raise BadRequest(f"Content-Length {value[:40]!r} is not a number of bytes")
            if int(value) > limit:
                raise BodyTooLarge(_too_large(f"Content-Length {int(value)}", limit))
            break
    message = await receive()
    if message["type"] != "http.request":
        raise Disconnected
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise BodyTooLarge(_too_large(f"{len(body)} bytes", limit))
        return body
    chunks = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] != "http.request":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(_too_large(f"more than {limit} bytes, chunked", limit))
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> str:
    return (
        f"the request body ({size}) is over the router's limit of {limit} bytes "
        "(kvevents router --max-body-bytes): send a shorter prompt or raise the limit"
    )


def spliced(raw: bytes, members: bytes) -> bytes:
    """``raw`` (a non-empty JSON object, as a decode found it) with ``members``
    (``,"name":value`` each, already JSON) appended before its closing brace: the one
    splice of the P/D legs and of the one-pool relay's rank pin."""
    end = raw.rstrip(_WHITESPACE)
    return b"".join((memoryview(end)[:-1], members, b"}"))


def pinned_bytes(raw: bytes, rank: int) -> bytes:
    """``raw`` with the rank pin ``routed_dp_rank`` spliced in, for a body that names no
    rank (the P/D relay's ``PlainFields.names_rank``, the one-pool relay's
    ``RelayFields.names_rank``): the rank pin of both relays, as
    :func:`~kvevents.router.serve.pd_legs.pinned_body` sets it."""
    return spliced(raw, b',"routed_dp_rank":%d' % rank)
