"""``kvevents router``: the KV-aware router as an HTTP service (FastAPI + uvicorn).

    kvevents router --engine http://127.0.0.1:30000 [--engine URL ...] [--port 8100]

It follows every engine's streams through discovery (a :class:`~kvevents.Subscriber`),
polls each engine's ``/load``, and answers (JSON in and out):

* ``POST /query``: ``{"input_ids": [...]}`` or ``{"text": "..."}`` (optional ``lora``,
  ``cache_salt``) -> per holder the matched tokens and blocks, per tier.
* ``POST /route``: the same body -> the chosen ``worker`` and ``dp_rank`` with every
  holder's score (see :mod:`kvevents.router.scoring`).
* ``POST /generate``: an engine ``/generate`` body, forwarded to the chosen engine with
  ``routed_dp_rank`` set (any rank in the body is replaced); the engine's answer comes
  back with a ``router`` field saying where it went and why.
* ``GET /workers``: engines, streams and holders with their health and load.
* ``GET /metrics``: Prometheus text (:mod:`kvevents.router.metrics`).
* ``GET /dump``: the index snapshot (``application/octet-stream``, see
  :meth:`kvevents.PrefixIndex.to_bytes`).

Text is tokenized with the simulated engine's byte tokenizer, so text prompts match
what that engine caches. A malformed body answers 400 naming the field; a request
before any block size is known (no discovery, no event yet) answers 503.

With ``--port 0`` the OS picks the port; the service prints
``kvevents router ready http://HOST:PORT`` on stdout once it accepts requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

import httpx
import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvevents.discovery import normalize_engine_url, streams_from_server_info
from kvevents.engine.tokenizer import ByteTokenizer
from kvevents.errors import ConfigError, DiscoveryError, EndpointError, SubscriberStateError
from kvevents.index import DEFAULT_MAX_ENTRIES
from kvevents.index_types import TierCredits
from kvevents.router.core import Router
from kvevents.router.metrics import make_registry, render
from kvevents.router.scoring import ScoringWeights
from kvevents.signals import Holder
from kvevents.subscriber import Subscriber

__all__ = ["READY_PREFIX", "RouterService", "add_arguments", "create_app", "run"]

READY_PREFIX = "kvevents router ready "

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]


class TokensBody(msgspec.Struct):
    """A request given as token ids or text (unknown keys are ignored)."""

    input_ids: list[TokenId] | None = None
    text: str | None = None
    lora: str | None = None
    cache_salt: str | None = None


_TOKENS_DECODER = msgspec.json.Decoder(TokensBody)


class BadRequest(Exception):
    """A request body the router cannot use; answered with 400."""


class RouterService:
    """The router plus what feeds it: the subscriber, the load pollers, an HTTP client."""

    def __init__(
        self,
        router: Router,
        engines: list[str],
        *,
        subscriber: Subscriber | None = None,
        load_interval: float = 0.5,
        forward_timeout: float = 600.0,
    ) -> None:
        self.router = router
        self.engines = [normalize_engine_url(u) for u in engines]
        self.subscriber = subscriber
        self.load_interval = load_interval
        self.forward_timeout = forward_timeout
        self.tokenizer = ByteTokenizer()
        self.registry = make_registry(router, self._stream_stats)
        self.engine_errors: dict[str, str | None] = {u: None for u in self.engines}
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    def _stream_stats(self) -> dict[Holder, Any]:
        return {} if self.subscriber is None else dict(self.subscriber.stats())

    async def start(self) -> None:
        # Idle connections expire before the engine's (uvicorn: 5 s) keep-alive timeout, so a
        # request never goes out on a connection the server is closing (a ReadError, 502).
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.forward_timeout, connect=5.0),
            limits=httpx.Limits(keepalive_expiry=2.0),
        )
        if self.subscriber is not None:
            self._tasks.append(asyncio.create_task(self._consume(self.subscriber)))
        for url in self.engines:
            self._tasks.append(asyncio.create_task(self._poll(url)))

    async def stop(self) -> None:
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._client is not None:
            await self._client.aclose()
        if self.subscriber is not None:
            await asyncio.to_thread(self.subscriber.close)

    async def _consume(self, subscriber: Subscriber) -> None:
        while not self._stopping.is_set():
            try:
                item = await subscriber.aget(timeout=0.5)
            except SubscriberStateError:
                return
            if item is not None:
                self.router.handle(item)

    async def _poll(self, url: str) -> None:
        """Learn the engine's ranks and block size once, then poll its /load."""
        assert self._client is not None
        registered = False
        while not self._stopping.is_set():
            try:
                if not registered:
                    info = (await self._client.get(f"{url}/server_info", timeout=5.0)).json()
                    for spec in streams_from_server_info(info, engine_url=url):
                        self.router.add_holder(
                            Holder(spec.worker, spec.dp_rank), block_size=spec.block_size
                        )
                    registered = True
                response = await self._client.get(f"{url}/load", timeout=5.0)
                self.router.update_load(url, response.json())
                self.router.set_worker_available(url, True)
                self.engine_errors[url] = None
            except (httpx.HTTPError, ValueError, DiscoveryError) as exc:
                self.router.set_worker_available(url, False)
                self.engine_errors[url] = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.load_interval)

    def tokens(self, raw: bytes) -> tuple[list[int], TokensBody]:
        try:
            body = _TOKENS_DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"request body: {exc}") from None
        if (body.input_ids is None) == (body.text is None):
            raise BadRequest('give exactly one of "input_ids" (token ids) or "text"')
        if body.input_ids is not None:
            return body.input_ids, body
        assert body.text is not None
        return self.tokenizer.encode(body.text), body

    async def forward(self, worker: str, body: dict[str, Any]) -> httpx.Response:
        assert self._client is not None
        return await self._client.post(f"{worker}/generate", json=body)


def _scores_json(decision_scores: list[Any]) -> list[dict[str, Any]]:
    out = []
    for s in decision_scores:
        d = msgspec.structs.asdict(s)
        d["matched"] = s.matched._asdict()
        out.append(d)
    return out


def create_app(service: RouterService) -> FastAPI:
    """The router's HTTP API; starting and stopping ``service`` is the app's lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="kvevents router", lifespan=lifespan)
    router = service.router

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    def _not_ready(exc: ValueError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=503)

    @app.post("/query")
    async def query(request: Request) -> JSONResponse:
        tokens, body = service.tokens(await request.body())
        try:
            matches = router.query(tokens, lora=body.lora, cache_salt=body.cache_salt)
        except ValueError as exc:
            return _not_ready(exc)
        bs = router.index.block_size or 0
        return JSONResponse(
            {
                "prompt_tokens": len(tokens),
                "block_size": bs,
                "matches": [
                    {
                        "worker": h.worker,
                        "dp_rank": h.dp_rank,
                        "matched_blocks": m.blocks,
                        "matched_tokens": m.blocks * bs,
                        "tiers": {"gpu": m.gpu * bs, "cpu": m.cpu * bs, "disk": m.disk * bs},
                    }
                    for h, m in matches.items()
                ],
            }
        )

    @app.post("/route")
    async def route(request: Request) -> JSONResponse:
        tokens, body = service.tokens(await request.body())
        try:
            decision = router.route(tokens, lora=body.lora, cache_salt=body.cache_salt)
        except ValueError as exc:
            return _not_ready(exc)
        return JSONResponse(
            {
                "worker": decision.worker,
                "dp_rank": decision.dp_rank,
                "n_blocks": decision.n_blocks,
                "block_size": decision.block_size,
                "scores": _scores_json(decision.scores),
            }
        )

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        raw = await request.body()
        tokens, body = service.tokens(raw)
        try:
            payload = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:  # pragma: no cover - tokens() decoded it already
            raise BadRequest(f"request body: {exc}") from None
        if not isinstance(payload, dict):
            raise BadRequest("request body must be a JSON object")
        try:
            decision = router.route(tokens, lora=body.lora, cache_salt=body.cache_salt)
        except ValueError as exc:
            return _not_ready(exc)
        payload.pop("data_parallel_rank", None)
        payload["routed_dp_rank"] = decision.dp_rank
        ticket = router.begin(decision)
        try:
            response = await service.forward(decision.worker, payload)
        except httpx.HTTPError as exc:
            return JSONResponse(
                {"error": f"forwarding to {decision.worker} failed: {type(exc).__name__}: {exc}"},
                status_code=502,
            )
        finally:
            router.finish(ticket)
        chosen = decision.chosen
        info = {
            "worker": decision.worker,
            "dp_rank": decision.dp_rank,
            "cost": chosen.cost,
            "cached_blocks": chosen.cached_blocks,
            "prefill_blocks": chosen.prefill_blocks,
            "pending_blocks": chosen.pending_blocks,
        }
        try:
            answer = response.json()
        except ValueError:
            return Response(response.content, status_code=response.status_code)
        if isinstance(answer, dict):
            answer["router"] = info
        return JSONResponse(answer, status_code=response.status_code)

    @app.get("/workers")
    async def workers() -> JSONResponse:
        sub = service.subscriber
        streams = [] if sub is None else [msgspec.to_builtins(s) for s in sub.stats().values()]
        engines = {} if sub is None else msgspec.to_builtins(sub.engines())
        return JSONResponse(
            {
                "engines": [
                    {
                        "url": url,
                        "load_error": service.engine_errors.get(url),
                        "discovery": engines.get(url),
                    }
                    for url in service.engines
                ],
                "streams": streams,
                "holders": router.holder_summary(),
                "index": {
                    "entries": len(router.index),
                    "blocks": router.index.num_blocks,
                    "block_size": router.index.block_size,
                    "batches_applied": router.batches_applied,
                },
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(service.registry), media_type="text/plain; version=0.0.4")

    @app.get("/dump")
    async def dump() -> Response:
        return Response(router.index.to_bytes(), media_type="application/octet-stream")

    return app


# --- command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        action="append",
        required=True,
        metavar="URL",
        help="engine HTTP URL with /server_info (repeatable)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on")
    parser.add_argument("--port", type=int, default=8100, help="port (0: the OS picks one)")
    parser.add_argument(
        "--block-size", type=int, default=None, help="tokens per block (default: discovered)"
    )
    parser.add_argument("--load-interval", type=float, default=0.5, help="seconds between /load")
    parser.add_argument(
        "--load-weight",
        type=float,
        default=1.0,
        help="blocks of prefill one pending block is worth",
    )
    parser.add_argument(
        "--foreign-request-blocks",
        type=float,
        default=8.0,
        help="pending blocks assumed per engine request this router did not send",
    )
    parser.add_argument(
        "--credits",
        default="1.0,0.75,0.25",
        metavar="GPU,CPU,DISK",
        help="worth of a cached block per tier (default 1.0,0.75,0.25)",
    )
    parser.add_argument(
        "--max-entries", type=int, default=DEFAULT_MAX_ENTRIES, help="index memory bound"
    )


def _credits(text: str) -> TierCredits:
    try:
        gpu, cpu, disk = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(
            f"--credits {text!r}: give three numbers GPU,CPU,DISK, e.g. 1.0,0.75,0.25"
        ) from None
    return TierCredits(gpu=gpu, cpu=cpu, disk=disk)


def build_service(args: argparse.Namespace) -> RouterService:
    if args.load_interval <= 0:
        raise ValueError(f"--load-interval {args.load_interval}: must be a positive number")
    router = Router(
        block_size=args.block_size,
        credits=_credits(args.credits),
        weights=ScoringWeights(
            load_weight=args.load_weight, foreign_request_blocks=args.foreign_request_blocks
        ),
        max_entries=args.max_entries,
    )
    subscriber = Subscriber(engines=args.engine)
    return RouterService(
        router, args.engine, subscriber=subscriber, load_interval=args.load_interval
    )


def run(args: argparse.Namespace) -> int:
    try:
        service = build_service(args)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return asyncio.run(serve(service, args.host, args.port))


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise EndpointError(
            f"router address {host}:{port} cannot be bound ({exc.strerror}): choose another --port"
        ) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: :func:`serve` owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(service: RouterService, host: str, port: int) -> int:
    """Serve until SIGINT or SIGTERM; prints the ready line once accepting requests."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sock = _bind(host, port)
    try:
        server = _Server(uvicorn.Config(create_app(service), log_level="warning", access_log=False))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        for _ in range(3000):  # bounded: startup is the lifespan plus one listen()
            if server.started or serving.done():
                break
            await asyncio.sleep(0.01)
        if not server.started:
            await serving
            raise EndpointError(f"router HTTP server on {host}:{port} did not start")
        shown = "127.0.0.1" if host in ("0.0.0.0", "", "*") else host
        print(f"{READY_PREFIX}http://{shown}:{sock.getsockname()[1]}", flush=True)
        stop_wait = asyncio.create_task(stop.wait())
        await asyncio.wait({stop_wait, serving}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        server.should_exit = True
        await serving
        return 0
    finally:
        sock.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
