"""The prefill engine's bootstrap server, and the client a decode engine takes KV with.

A prefill engine (``kvevents engine --disaggregation-mode prefill``) serves this on its
``--host``, port ``--disaggregation-bootstrap-port`` (SGLang's flag; 0: the OS picks and
``/server_info`` tells which). HTTP/1.1 and JSON, two paths:

* ``GET /health`` -> ``{"engine_id", "disaggregation_mode": "prefill"}``.
* ``POST /take`` with ``{"room": INT, "wait": S}`` (an SGLang ``bootstrap_room``) or
  ``{"request_id": STR, "wait": S}`` (a vLLM ``remote_request_id``): waits up to ``wait``
  seconds (at most the engine's ``--disaggregation-timeout``) for that key's prefill,
  then hands it over, once: 200 with a :class:`~kvevents.engine.transfer_registry.Transfer`,
  ``{"engine_id", "dp_rank", "page_size", "prompts": [{"token_ids", "block_count"}]}``;
  else ``{"error": message}`` with 404 (not prefilled in time), 409 (taken already), 410
  (expired unfetched), 502 (the prefill failed) or 400 (a malformed body).

With ``--api-key`` the engine's key is required on ``/take`` (``Authorization: Bearer``)
and a decode sends its own, so the engines of one fleet share a key. The server speaks
plain HTTP even when the engine serves HTTPS (a decode cannot tell which), as SGLang's
bootstrap server does; it carries token ids, never KV.

Why this shape: one long poll per hand-off is a single round trip once the prefill is
done, and its wait is bounded at both ends (the decode's ask, the prefill's timeout), so
a decode never hangs and no connection or key outlives the timeout. ``POST``, because a
take consumes the key.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Annotated, Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvevents.engine.bodies import BodyError, read_body
from kvevents.engine.transfer_registry import (
    DisaggregationError,
    Transfer,
    TransferKey,
    TransferRegistry,
    describe,
)
from kvevents.errors import EndpointError
from kvevents.http.auth import ApiKey, ApiKeyGate
from kvevents.http.serving import bind_http, start_http
from kvevents.http.upstream import Upstream
from kvevents.http.upstream_errors import MidwayError, UpstreamError

__all__ = ["BootstrapClient", "BootstrapServer", "TakeRequest"]

_MAX_BODY = 4096
_CONNECT_S = 5.0
# a bootstrap server's error status -> the status a decode answers its client with
_DECODE_STATUS = {404: 504, 409: 409, 410: 504}


class TakeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /take``: exactly one of ``room`` and ``request_id``."""

    room: Annotated[int, msgspec.Meta(ge=0)] | None = None
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=512)] | None = None
    wait: Annotated[float, msgspec.Meta(ge=0)] = 0.0


_TAKE_DECODER = msgspec.json.Decoder(TakeRequest)
_TRANSFER_DECODER = msgspec.json.Decoder(Transfer)
_ENCODE = msgspec.json.Encoder().encode
_JSON = {"content-type": "application/json"}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def bootstrap_app(registry: TransferRegistry, engine_id: str) -> Starlette:
    """The ASGI app of the module docstring over ``registry``."""

    async def health(request: Request) -> Response:
        return JSONResponse({"engine_id": engine_id, "disaggregation_mode": "prefill"})

    async def take(request: Request) -> Response:
        try:
            ask = _TAKE_DECODER.decode(await read_body(request, _MAX_BODY))
        except BodyError as exc:
            return _error(exc.status, str(exc))
        except (msgspec.DecodeError, RecursionError) as exc:
            return _error(400, f"invalid /take body: {exc}")
        if (ask.room is None) == (ask.request_id is None):
            return _error(400, "give exactly one of room (an int) or request_id (a string)")
        key: TransferKey = ask.room if ask.room is not None else str(ask.request_id)
        try:
            transfer = await registry.take(key, min(ask.wait, registry.timeout))
        except DisaggregationError as exc:
            return _error(exc.status, str(exc))
        return Response(_ENCODE(transfer), media_type="application/json")

    routes = [Route("/health", health, methods=["GET"]), Route("/take", take, methods=["POST"])]
    return Starlette(routes=routes)


class BootstrapServer:
    """The bootstrap server of one prefill engine, on a socket bound beforehand."""

    def __init__(
        self,
        registry: TransferRegistry,
        engine_id: str,
        sock: socket.socket,
        api_key: str | None = None,
    ) -> None:
        app: Any = bootstrap_app(registry, engine_id)
        if api_key is not None:
            app = ApiKeyGate(app, ApiKey(api_key), {"/health"})
        self._app = app
        self._sock = sock
        self.registry = registry
        self.port: int = sock.getsockname()[1]
        """The port bound (a requested 0 resolved)."""
        self._server: Any = None
        self._serving: asyncio.Task[None] | None = None

    @classmethod
    def bind(
        cls,
        host: str,
        port: int,
        registry: TransferRegistry,
        engine_id: str,
        api_key: str | None = None,
    ) -> BootstrapServer:
        """A server on ``host:port`` (0: the OS picks), bound now: a taken port fails at
        once, naming ``--disaggregation-bootstrap-port``."""
        try:
            sock = bind_http(host, port, "bootstrap")
        except EndpointError as exc:
            flag = "--disaggregation-bootstrap-port"
            raise EndpointError(str(exc).replace("--port", flag)) from None
        return cls(registry, engine_id, sock, api_key)

    async def start(self) -> None:
        self._server, self._serving = await start_http(
            self._app, self._sock, lifespan="off", graceful_timeout=1.0
        )

    async def stop(self) -> None:
        """Stop serving (a pending take is cancelled within a second); idempotent."""
        if self._serving is not None:
            self._server.should_exit = True
            await self._serving
            self._serving = None
        self.registry.close()
        self._sock.close()


class BootstrapClient:
    """A decode engine's client of prefill engines' bootstrap servers: the client the
    router sends engines requests with (:class:`~kvevents.http.upstream.Upstream`), one
    pool of kept-alive connections for all, never through a proxy from the environment
    (none may sit between two engines)."""

    def __init__(self, api_key: str | None = None) -> None:
        headers = {} if api_key is None else {"authorization": f"Bearer {api_key}"}
        self._http = Upstream(timeout=_CONNECT_S, connect_timeout=_CONNECT_S, headers=headers)

    async def take(self, host: str, port: int, key: TransferKey, wait: float) -> Transfer:
        """The transfer of ``key`` from the bootstrap server at ``host:port``, waiting up
        to ``wait`` s; raises :class:`DisaggregationError` with the status a decode answers."""
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        ask: dict[str, Any] = {"room": key} if isinstance(key, int) else {"request_id": key}
        try:
            status, body = await self._post(address, _ENCODE(ask | {"wait": wait}), wait)
        except (TimeoutError, UpstreamError) as exc:
            cause = exc.cause if isinstance(exc, MidwayError) else exc
            if isinstance(cause, TimeoutError):
                raise DisaggregationError(
                    f"the bootstrap server at {address} did not answer for {describe(key)} "
                    f"within {wait + _CONNECT_S:g} s",
                    504,
                ) from None
            raise DisaggregationError(
                f"cannot reach the bootstrap server at {address} for {describe(key)} "
                f"({exc or type(exc).__name__}): is the prefill engine running there, and is "
                "that its disaggregation_bootstrap_port (/server_info)?",
                502,
            ) from None
        if status == 200:
            try:
                return _TRANSFER_DECODER.decode(body)
            except msgspec.DecodeError as exc:
                raise DisaggregationError(
                    f"the bootstrap server at {address} answered no transfer: {exc}", 502
                ) from None
        try:
            message = str(json.loads(body)["error"])
        except (ValueError, KeyError, TypeError):
            message = body[:200].decode("utf-8", "replace")
        raise DisaggregationError(
            f"bootstrap server {address}: {message}",
            _DECODE_STATUS.get(status, 502),
        )

    async def _post(self, address: str, ask: bytes, wait: float) -> tuple[int, bytes]:
        """POST ``ask`` to ``/take`` once (a take consumes its key: never sent again),
        within ``wait`` s and the time to connect; the status and the whole body."""
        response = await self._http.post(
            f"http://{address}", "/take", ask, _JSON, timeout=wait + _CONNECT_S
        )
        try:
            return response.status, await response.read()
        finally:
            response.release()

    async def take_all(
        self, host: str, port: int, keys: list[TransferKey], wait: float
    ) -> dict[TransferKey, Transfer]:
        """:meth:`take` of every key at once; the first error once all have ended."""
        taken = await asyncio.gather(
            *(self.take(host, port, k, wait) for k in keys), return_exceptions=True
        )
        for outcome in taken:
            if isinstance(outcome, BaseException):
                raise outcome
        return dict(zip(keys, taken, strict=True))  # type: ignore[arg-type]

    async def aclose(self) -> None:
        await self._http.close()
