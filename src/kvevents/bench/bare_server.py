"""The ceiling for the router benchmark: the router's HTTP stack with nothing behind it.

``python -m kvevents.bench.bare_server --port 0`` serves one ASGI app on exactly the
stack ``kvevents router`` uses (:func:`kvevents.http_serving.serve_app`: uvicorn, its
httptools parser, uvloop) that reads a POST body, decodes it with the router's own
request decoder and answers ``{"prompt_tokens": N}``: no index, no scoring. Whatever
this answers per second is what any router on this stack could at best; the benchmark
reports the router's figures as a share of it. It prints ``kvevents bare ready URL``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import msgspec

from kvevents.http_serving import run_event_loop, serve_app
from kvevents.router.hot_path import Receive, Scope, Send
from kvevents.router.service import TokensBody

__all__ = ["READY_PREFIX", "bare_app", "main"]

READY_PREFIX = "kvevents bare ready "

_DECODER = msgspec.json.Decoder(TokensBody)
_HEADERS = [(b"content-type", b"application/json")]


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
    try:
        body = _DECODER.decode(b"".join(chunks))
        status, answer = 200, b'{"prompt_tokens": %d}' % len(body.input_ids or ())
    except msgspec.DecodeError:
        status, answer = 400, b'{"error": "bad body"}'
    headers = [*_HEADERS, (b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvevents.bench.bare_server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    return run_event_loop(serve_app(bare_app, args.host, args.port, READY_PREFIX, "bare server"))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
