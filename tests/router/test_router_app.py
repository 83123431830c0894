"""The router's app starts in two steps: the hot path at once, the FastAPI app once serving.

In process, through the app's ASGI interface (the lifespan driven as a server drives
it); the real servers run it in the HTTP and process tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from kvevents import Router
from kvevents.router.serve import service as service_module
from kvevents.router.serve.app import DeferredApp, create_app
from kvevents.router.serve.service import RouterService

Message = dict[str, Any]


class _Lifespan:
    """Drives an ASGI app's lifespan as uvicorn does."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.outbox: asyncio.Queue[Message] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    async def send(self, kind: str) -> Message:
        if self.task is None:
            scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
            self.task = asyncio.create_task(self.app(scope, self.inbox.get, self.outbox.put))
        await self.inbox.put({"type": kind})
        return await asyncio.wait_for(self.outbox.get(), 10.0)


async def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def test_the_hot_path_answers_before_the_framework_app_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the lifespan's startup, /route, /workers and /health answer while the FastAPI
    app is still unbuilt; once the server says it serves, the app is built in the
    background, and /metrics and /openapi.json answer from it."""
    # only serving() starts the deferred work here, however slow the machine
    monkeypatch.setattr(service_module, "DEFERRED_AFTER_S", 600.0)

    async def go() -> None:
        service = RouterService(Router(), [])
        app = create_app(service)
        deferred = app.fallback
        assert isinstance(deferred, DeferredApp)
        lifespan = _Lifespan(app)
        assert (await lifespan.send("lifespan.startup"))["type"] == "lifespan.startup.complete"
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            workers = await client.get("/workers", timeout=10.0)
            assert workers.status_code == 200
            assert workers.json()["index"]["entries"] == 0
            assert workers.json()["process"]["workers"] == 1
            health = await client.get("/health", timeout=10.0)
            assert (health.status_code, health.json()) == (200, {"status": "ok"})
            route = await client.post("/route", json={"input_ids": [1, 2]}, timeout=10.0)
            assert route.status_code == 503  # no engine rank yet: answered by the hot path
            assert not deferred.built
            service.serving()
            await _until(lambda: deferred.built, 60.0, "the FastAPI app to be built")
            metrics = await client.get("/metrics", timeout=10.0)
            assert metrics.status_code == 200
            assert "kvevents_router_process_info" in metrics.text
            paths = (await client.get("/openapi.json", timeout=10.0)).json()["paths"]
            assert {"/route", "/workers", "/health", "/metrics"} <= set(paths)
            wrong = await client.post("/workers", json={}, timeout=10.0)
            assert wrong.status_code == 405  # a GET route: FastAPI says so, as before
        assert (await lifespan.send("lifespan.shutdown"))["type"] == "lifespan.shutdown.complete"
        assert lifespan.task is not None
        await asyncio.wait_for(lifespan.task, 10.0)

    asyncio.run(go())


def test_a_request_before_the_app_is_built_waits_for_it() -> None:
    """Without a lifespan (an app embedded without the CLI), the first request to a
    FastAPI path builds the app and is answered from it."""

    async def go() -> None:
        app = create_app(RouterService(Router(), []))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            answers = await asyncio.gather(
                *(client.get("/metrics", timeout=60.0) for _ in range(3))
            )
        assert [a.status_code for a in answers] == [200, 200, 200]

    asyncio.run(go())


def test_a_failed_build_is_tried_again() -> None:
    """A build that raises fails the request that waited for it, and the next use builds again."""
    calls: list[int] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def build() -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("no FastAPI here")
        return inner

    async def go() -> None:
        deferred = DeferredApp(build)
        with pytest.raises(RuntimeError, match="no FastAPI here"):
            await deferred.app()
        assert not deferred.built
        assert await deferred.app() is inner
        assert deferred.built and len(calls) == 2

    asyncio.run(go())


def test_a_service_that_fails_to_start_fails_the_lifespan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The startup's failure is reported to the server with its reason (it then stops)."""

    async def broken(self: RouterService) -> None:
        raise RuntimeError("the engine client could not be made")

    monkeypatch.setattr(RouterService, "start", broken)

    async def go() -> None:
        lifespan = _Lifespan(create_app(RouterService(Router(), [])))
        answer = await lifespan.send("lifespan.startup")
        assert answer["type"] == "lifespan.startup.failed"
        assert "RuntimeError: the engine client could not be made" in answer["message"]
        assert lifespan.task is not None
        with pytest.raises(RuntimeError, match="could not be made"):
            await asyncio.wait_for(lifespan.task, 10.0)

    asyncio.run(go())
