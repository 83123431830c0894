"""The router's HTTP app: the hot path in front, FastAPI behind it, built once serving.

:class:`~kvevents.router.serve.hot_path.HotPath` answers ``/route``, ``/query``, the OpenAI
relay's routes, ``/workers``, ``/health`` and ``/ready`` itself, and runs the lifespan
(starting and stopping the :class:`~kvevents.router.serve.service.RouterService`). Every
other path (``/generate``, ``/metrics``, ``/dump``, ``/v1/models``, ``/docs``) goes to the
FastAPI app of :mod:`kvevents.router.serve.fastapi_app`, which is a :class:`DeferredApp`:
importing FastAPI is a large part of the router's start-up, so it is built in a thread
once the server accepts requests (a restarted replica routes that much sooner), and a
request that comes before it is built waits for it.

The endpoints are listed in :mod:`kvevents.cli.router` (the ``kvevents router``
command) and described, bodies and answers, in :mod:`kvevents.router.serve.api_schema`
(``/openapi.json``, ``/docs``); the OpenAI endpoints live in
:mod:`kvevents.router.serve.openai_relay`, engine polling in :mod:`kvevents.router.fleet.engines`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvevents.http.auth import OPEN_PATHS, ApiKey, ASGIApp, Receive, Scope, Send
from kvevents.router.serve.hot_path import DEFAULT_MAX_BODY_BYTES, HotPath
from kvevents.router.serve.pd_route import serve_pd
from kvevents.router.serve.service import RouterService

__all__ = ["DeferredApp", "create_app"]


class DeferredApp:
    """An ASGI app that ``build`` makes, in a thread, on first use or ahead of it."""

    def __init__(self, build: Callable[[], ASGIApp]) -> None:
        self._build = build
        self._app: ASGIApp | None = None
        self._building: asyncio.Future[ASGIApp] | None = None

    @property
    def built(self) -> bool:
        return self._app is not None

    async def app(self) -> ASGIApp:
        """The app, built now unless it is built or being built (then waited for)."""
        if self._app is not None:
            return self._app
        if self._building is None:
            self._building = asyncio.ensure_future(asyncio.to_thread(self._build))
        try:
            self._app = await asyncio.shield(self._building)
        except BaseException:
            if self._building.done():  # a failed build is tried again on the next use
                self._building = None
            raise
        return self._app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self._app if self._app is not None else await self.app()
        await app(scope, receive, send)


def create_app(
    service: RouterService,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_key: ApiKey | None = None,
    metrics_auth: bool = False,
) -> HotPath:
    """The router's HTTP API as one ASGI app; starting and stopping ``service`` is its lifespan.

    ``api_key``: every path but :data:`~kvevents.http.auth.OPEN_PATHS` (and ``/metrics``, unless
    ``metrics_auth``) needs ``Authorization: Bearer KEY``; the hot path checks it for all.
    """

    def build() -> ASGIApp:
        from kvevents.router.serve.fastapi_app import create_fastapi_app

        return create_fastapi_app(service, max_body_bytes=max_body_bytes)

    open_paths = OPEN_PATHS if metrics_auth else OPEN_PATHS | {"/metrics"}
    deferred = DeferredApp(build)
    hot = HotPath(
        service,
        deferred,
        max_body_bytes=max_body_bytes,
        api_key=api_key,
        open_paths=open_paths,
        prepare=deferred.app,
    )
    if service.pd is not None:  # disaggregated prefill/decode: its relay and /route
        serve_pd(hot, service.pd)
    return hot
