"""The router's error answers: not ready is 503 through RouterNotReadyError, nothing else is."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from kvevents import Holder, KVEventsError, Router, RouterNotReadyError
from kvevents.router.serve.app import create_app
from kvevents.router.serve.service import RouterService


class _BuggyRouter(Router):
    """A router whose decision code has a bug that raises a plain ValueError."""

    def route(self, token_ids: Sequence[int], **kwargs: Any) -> Any:
        raise ValueError("an internal bug, not a readiness problem")

    def route_batch(self, prompts: Sequence[Sequence[int]], **kwargs: Any) -> Any:
        raise ValueError("an internal bug, not a readiness problem")

    def query(self, token_ids: Sequence[int], **kwargs: Any) -> Any:
        raise ValueError("an internal bug, not a readiness problem")

    def query_predicted(self, token_ids: Sequence[int], **kwargs: Any) -> Any:
        raise ValueError("an internal bug, not a readiness problem")


def _post(router: Router, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST to the router's app in-process (the lifespan, which starts pollers, is not run)."""

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(
            app=create_app(RouterService(router, [])), raise_app_exceptions=False
        )
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.post(path, json=body, timeout=10.0)

    return asyncio.run(go())


def test_router_not_ready_raises_its_own_error() -> None:
    """A router with no rank refuses to route, and without a block size refuses to query,
    with RouterNotReadyError, which is a KVEventsError (and a ValueError, as before)."""
    router = Router()
    with pytest.raises(RouterNotReadyError, match="no engine rank is known yet"):
        router.route([1, 2, 3, 4])
    router.add_holder(Holder("w", 0))
    with pytest.raises(RouterNotReadyError, match="block size is not known yet"):
        router.query([1, 2, 3, 4])
    assert issubclass(RouterNotReadyError, KVEventsError)
    assert issubclass(RouterNotReadyError, ValueError)


@pytest.mark.parametrize("path", ["/route", "/query", "/generate"])
def test_a_router_that_is_not_ready_answers_503(path: str) -> None:
    """/route, /query and /generate answer 503 with the reason while no engine rank is known."""
    answer = _post(Router(), path, {"input_ids": [1, 2, 3, 4]})
    assert answer.status_code == 503
    assert "known yet" in answer.json()["error"]


def test_openai_routes_answer_503_in_openai_shape_when_not_ready() -> None:
    """/v1/completions with no rank known answers 503 as an OpenAI error."""
    answer = _post(Router(), "/v1/completions", {"prompt": [1, 2, 3, 4]})
    assert answer.status_code == 503
    assert answer.json()["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize("path", ["/route", "/query", "/generate", "/v1/completions"])
def test_an_internal_value_error_is_not_answered_503(path: str) -> None:
    """A ValueError raised by a bug in the router is a server error (500), not 'not ready'."""
    body = {"prompt": [1, 2, 3, 4]} if path.startswith("/v1/") else {"input_ids": [1, 2, 3, 4]}
    answer = _post(_BuggyRouter(), path, body)
    assert answer.status_code == 500
