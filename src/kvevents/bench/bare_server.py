"""The ceiling for the router benchmark: the router's HTTP stack with nothing behind it.

``python -m kvevents.bench.bare_server --port 0`` serves one ASGI app on exactly the
stack ``kvevents router`` uses (:func:`kvevents.http.serving.serve_app`: uvicorn, its
httptools parser with the inline path of :mod:`kvevents.http.inline`, uvloop) that reads
a POST body, decodes it with the router's own request decoder
(:func:`~kvevents.router.prompts.token_body.decode_tokens_body`, with the native core as
the router has it) and answers ``{"prompt_tokens": N}``: no keys, no
index, no scoring. Whatever this answers per second is what any router on this stack
could at best; the benchmark reports the router's figures as a share of it. It prints
``kvevents bare ready URL``.

``--relay-to URL`` also makes it a *bare relay*: ``POST /v1/completions`` is forwarded
as it came to ``URL/v1/completions`` with the router's own client
(:meth:`~kvevents.http.upstream.Upstream.post_whole`, kept-alive connections) and the
engine's status, content type and body answered, inline on uvicorn as the router's
relay is: no decode, no keys, no routing, no decision headers, no usage. What it adds
to the engine's latency is what any relay on this stack adds; the benchmark measures
it beside the router (:mod:`kvevents.bench.completions`), so what routing adds on top
is read in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from kvevents import kernels
from kvevents.http.serving import run_event_loop, serve_app
from kvevents.http.upstream import Upstream
from kvevents.http.upstream_answers import FullResponse
from kvevents.router.prompts.token_body import BadRequest, decode_tokens_body
from kvevents.router.serve.hot_path import Receive, Scope, Send

__all__ = ["READY_PREFIX", "BareApp", "bare_app", "main"]

READY_PREFIX = "kvevents bare ready "

_HEADERS = [(b"content-type", b"application/json")]
RELAYED_PATH = "/v1/completions"
_FORWARDED = {"content-type": "application/json"}

_PairedAnswer = tuple[int, list[tuple[bytes, bytes]], bytes]
"""An inline answer (:data:`kvevents.http.inline.InlineAnswer`) with its headers as pairs,
as the ASGI and RSGI sides here send them."""


def _answer(raw: bytes) -> tuple[int, bytes]:
    try:
        tokens, _ = decode_tokens_body(raw)
    except BadRequest:
        return 400, b'{"error": "bad body"}'
    return 200, b'{"prompt_tokens": %d}' % len(tokens or ())


class BareApp:
    """The bare app on ASGI, answering inline as the router's hot path does
    (:mod:`kvevents.http.inline`).
    ``upstream``: the relay's client (default: the router's kept-alive one)."""

    inline_paths = frozenset({b"/route", b"/query"})
    inline_limit = 1 << 30

    def __init__(self, relay_to: str | None = None, upstream: Upstream | None = None) -> None:
        self.relay_to = relay_to
        self.async_inline_paths = frozenset({RELAYED_PATH.encode()} if relay_to else ())
        self._upstream = upstream or Upstream(timeout=600.0)

    def answer_inline(
        self, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, bytes] | None:
        return _answer(body)

    def answer_async_inline(
        self, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> asyncio.Future[_PairedAnswer]:
        return self._relay(body)

    def _relay(self, body: bytes) -> asyncio.Future[_PairedAnswer]:
        """The engine's answer to ``body``, forwarded as it came (see the module docstring)."""
        assert self.relay_to is not None
        answered: asyncio.Future[_PairedAnswer] = asyncio.get_running_loop().create_future()

        def done(exchange: asyncio.Future[FullResponse]) -> None:
            error = exchange.exception()
            if error is not None:
                text = f"relaying to {self.relay_to} failed: {error!r}".encode()
                answered.set_result((502, [(b"content-type", b"text/plain")], text))
                return
            full = exchange.result()
            media = full.headers.get("content-type", "application/json").encode("latin-1")
            answered.set_result((full.status, [(b"content-type", media)], full.body))

        exchange = self._upstream.post_whole(self.relay_to, RELAYED_PATH, body, _FORWARDED)
        exchange.add_done_callback(done)
        return answered

    async def close(self) -> None:
        """Close the relay's kept-alive engine connections (at the server's shutdown)."""
        await self._upstream.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await bare_app(scope, receive, send)  # returns once shutdown is complete
            await self.close()
            return
        if self.relay_to is None or scope.get("path") != RELAYED_PATH:
            await bare_app(scope, receive, send)
            return
        body = await _asgi_body(receive)
        if body is None:
            return
        status, headers, answer = await self._relay(body)
        headers = [*headers, (b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


async def _asgi_body(receive: Receive) -> bytes | None:
    """The request's body, or None when the client went away first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def bare_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Parse the body as the router does, answer its token count; lifespan is a no-op."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = await _asgi_body(receive)
    if body is None:
        return
    status, answer = _answer(body)
    headers = [*_HEADERS, (b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvevents.bench.bare_server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--relay-to",
        metavar="URL",
        help="also forward POST /v1/completions to this engine, unrouted (a bare relay)",
    )
    args = parser.parse_args(argv)
    kernels.load()  # before serving: the ceiling parses as a router with its kernels does
    app = BareApp(args.relay_to)
    return run_event_loop(serve_app(app, args.host, args.port, READY_PREFIX, "bare server"))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
