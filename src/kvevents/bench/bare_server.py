"""The ceiling for the router benchmark: the router's HTTP stack with nothing behind it.

``python -m kvevents.bench.bare_server --port 0`` serves one ASGI app on exactly the
stack ``kvevents router`` uses (:func:`kvevents.http_serving.serve_app`: uvicorn, its
httptools parser with the inline path of :mod:`kvevents.http_inline`, uvloop) that reads
a POST body, decodes it with the router's own request decoder
(:func:`~kvevents.router.token_body.decode_tokens_body`, with the compiled kernels
loaded as the router loads them) and answers ``{"prompt_tokens": N}``: no keys, no
index, no scoring. Whatever this answers per second is what any router on this stack
could at best; the benchmark reports the router's figures as a share of it. It prints
``kvevents bare ready URL``.
``--http-server granian`` serves the same parse through granian's RSGI interface
(:mod:`kvevents.granian_serving`), the ceiling of ``kvevents router --http-server granian``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from kvevents import kernels
from kvevents.http_serving import HTTP_SERVERS, run_event_loop, serve_app
from kvevents.router.hot_path import Receive, Scope, Send
from kvevents.router.token_body import BadRequest, decode_tokens_body

__all__ = ["READY_PREFIX", "bare_app", "main"]

READY_PREFIX = "kvevents bare ready "

_HEADERS = [(b"content-type", b"application/json")]
_RSGI_HEADERS = [("content-type", "application/json")]


def _answer(raw: bytes) -> tuple[int, bytes]:
    try:
        tokens, _ = decode_tokens_body(raw)
    except BadRequest:
        return 400, b'{"error": "bad body"}'
    return 200, b'{"prompt_tokens": %d}' % len(tokens or ())


class _BareApp:
    """The bare app on both interfaces: ASGI (uvicorn) and RSGI (granian); on uvicorn
    it answers inline as the router's hot path does (:mod:`kvevents.http_inline`)."""

    inline_paths = frozenset({b"/route", b"/query"})
    inline_limit = 1 << 30

    def answer_inline(
        self, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, bytes] | None:
        return _answer(body)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await bare_app(scope, receive, send)

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        status, answer = _answer(bytes(await proto()))
        proto.response_bytes(status, _RSGI_HEADERS, answer)


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
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    status, answer = _answer(b"".join(chunks))
    headers = [*_HEADERS, (b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvevents.bench.bare_server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--http-server", choices=HTTP_SERVERS, default="uvicorn")
    args = parser.parse_args(argv)
    kernels.load()  # before serving: the ceiling parses as a router with its kernels does
    return run_event_loop(
        serve_app(
            _BareApp(), args.host, args.port, READY_PREFIX, "bare server", server=args.http_server
        )
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
