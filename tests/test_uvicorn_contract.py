"""What ``kvevents.http.inline`` relies on inside uvicorn's httptools protocol is there.

The inline protocol subclasses uvicorn's and reads its internals, which uvicorn may change
in any release; pyproject.toml pins the minor it is tested with. When an upgrade changes
them, these tests fail naming what changed: a method (checked on the class), an instance
attribute or one of its members (checked on the protocol uvicorn made for a request it
served), a member uvicorn reads of the request cycle that the inline path's stand-in
lacks, or the one uvicorn method the inline protocol re-implements.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Iterator
from typing import Any, ClassVar

import httpx
import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvevents.http.inline import UVICORN_METHODS, UVICORN_STATE, InlineApp, _Exchange, protocol_for
from kvevents.http.serving import bind_http

ON_RESPONSE_COMPLETE = "549e282ea1b7dfa1ab2edfc01073797b"
"""The digest of uvicorn's ``on_response_complete`` (its syntax tree, comments aside) that
the inline protocol's own copy follows; see :func:`_digest`."""


def _missing(obj: object, wanted: dict[str, tuple[str, ...]]) -> list[str]:
    """``name`` or ``name.member`` of ``wanted`` that ``obj`` lacks."""
    missing = []
    for name, members in wanted.items():
        if not hasattr(obj, name):
            missing.append(name)
            continue
        value = getattr(obj, name)
        missing += [f"{name}.{m}" for m in members if not hasattr(value, m)]
    return missing


def test_the_protocol_has_every_method_the_inline_one_relies_on() -> None:
    """Every method the inline protocol overrides or calls is on uvicorn's protocol, its
    STATUS_LINE table gives a status's line, and so the inline protocol is the one used."""
    missing = [name for name in UVICORN_METHODS if not hasattr(HttpToolsProtocol, name)]
    assert not missing, f"uvicorn {uvicorn.__version__}'s HttpToolsProtocol lacks {missing}"
    assert httptools_impl.STATUS_LINE[200] == b"HTTP/1.1 200 OK\r\n"

    class _Inline:
        inline_paths = frozenset({b"/x"})
        inline_limit = 1024

        def answer_inline(self, *args: Any) -> None:
            return None

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None: ...

    assert isinstance(_Inline(), InlineApp)
    chosen = protocol_for(_Inline(), "httptools")
    assert chosen != "httptools" and issubclass(chosen, HttpToolsProtocol)


class _Recording(HttpToolsProtocol):
    """uvicorn's protocol, noting what it lacks of UVICORN_STATE once a request's headers are in."""

    lacking: ClassVar[list[list[str]]] = []

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        type(self).lacking.append(_missing(self, UVICORN_STATE))


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # leave the test runner's handlers alone
        yield


async def _echo(scope: Any, receive: Any, send: Any) -> None:
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


async def _serve_one_request() -> None:
    sock = bind_http("127.0.0.1", 0, "contract test")
    port = sock.getsockname()[1]
    config = uvicorn.Config(_echo, http=_Recording, lifespan="off", log_level="warning")
    server = _Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:  # the socket listens already: the request waits in its queue until uvicorn accepts
        async with httpx.AsyncClient(timeout=10.0) as client:
            answer = await client.post(f"http://127.0.0.1:{port}/x", content=b"hello")
        assert (answer.status_code, answer.content) == (200, b"hello")
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10.0)
        sock.close()


def test_a_served_request_has_every_attribute_the_inline_protocol_reads() -> None:
    """The protocol uvicorn makes for a connection has, once a request's headers are in,
    every instance attribute of UVICORN_STATE and the members the inline protocol uses."""
    _Recording.lacking.clear()
    asyncio.run(_serve_one_request())
    assert len(_Recording.lacking) == 1, "uvicorn served the request with the recording protocol"
    (missing,) = _Recording.lacking
    assert not missing, f"uvicorn {uvicorn.__version__}'s protocol instance lacks {missing}"


BODY_CALLBACKS = ("on_body", "on_message_complete")
"""uvicorn's callbacks of a request's body: they run only after ``on_headers_complete`` has
made that request a cycle of its own, never while the stand-in is the cycle."""


def test_the_stand_in_cycle_has_what_uvicorn_reads_of_a_cycle() -> None:
    """Every member uvicorn's protocol reads or sets of the current cycle outside a body's
    callbacks is one the inline path's stand-in (``_Exchange``, the cycle while an inline
    answer is pending) has."""
    used: set[str] = set()
    for name, member in vars(HttpToolsProtocol).items():
        if inspect.isfunction(member) and name not in BODY_CALLBACKS:
            source = inspect.getsource(member)
            used |= set(re.findall(r"(?:self\.cycle|existing_cycle)\.(\w+)", source))
    assert {"response_complete", "message_event"} <= used, "uvicorn reads its current cycle"
    missing = sorted(name for name in used if not hasattr(_Exchange(True), name))
    assert not missing, (
        f"uvicorn {uvicorn.__version__} reads cycle.{missing}, which _Exchange lacks"
    )


def _digest(function: Any) -> str:
    """A digest of ``function``'s tokens: its code, not its comments or layout (the same
    on every Python version, as a syntax tree's dump is not)."""
    source = textwrap.dedent(inspect.getsource(function))
    layout = {tokenize.INDENT: "{", tokenize.DEDENT: "}", tokenize.NEWLINE: ";"}
    words = [
        layout.get(token.type, token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type not in (tokenize.COMMENT, tokenize.NL)
    ]
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:32]


def test_the_reimplemented_method_is_still_uvicorns() -> None:
    """uvicorn's ``on_response_complete``, which the inline protocol re-implements with one
    change (its keep-alive timer), is the code that copy follows."""
    assert _digest(HttpToolsProtocol.on_response_complete) == ON_RESPONSE_COMPLETE, (
        f"uvicorn {uvicorn.__version__} changed HttpToolsProtocol.on_response_complete: bring "
        "kvevents.http.inline's on_response_complete in line with it, then update this digest"
    )
