"""The router's readiness (``GET /ready``, ``/workers``' ``ready``, the line after the
ready line) against real engines: what keeps it from routing, and routing with no flags."""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from router_support import Engine, RouterProc, wait_until

from kvevents import Holder, Router
from kvevents.router.serve.pd_mode import PDEngine, PDMode
from kvevents.router.serve.readiness import MAX_REASONS, Readiness, readiness, report_readiness
from kvevents.router.serve.service import RouterService
from process_support import KVEventsProcess

READINESS = "kvevents router: "


def test_a_holder_known_available_and_at_the_block_size_is_routable() -> None:
    """Without a subscriber (streams not followed here) a holder counts once known and
    available; a rank reported down and one declared at another block size are each a
    reason naming the engine and its ranks, and the router stays ready while one holder
    is routable."""
    router = Router(block_size=16)
    service = RouterService(router, [])
    assert readiness(service).reasons == [
        "no engine rank is known yet: the router follows no engine (--engine URL)"
    ]
    router.add_holder(Holder("a", 0), block_size=16)
    assert readiness(service) == Readiness(ok=True, reasons=[], routable=1, holders=1)
    for rank in (1, 2, 4):
        router.add_holder(Holder("a", rank), block_size=32)
    router.add_holder(Holder("b", 0), block_size=16)
    router.set_worker_available("b", False)
    state = readiness(service)
    assert (state.ok, state.routable, state.holders) == (True, 1, 5)
    assert state.reasons[0].startswith("engine a ranks 1-2, 4: block size mismatch: it is "), state
    assert "declared at 32 tokens but the router keys at 16" in state.reasons[0]
    assert state.reasons[1] == "engine b rank 0: unavailable: the engine reports the rank down"
    router.set_worker_available("a", False)
    assert not readiness(service).ok


def test_a_disaggregated_router_is_ready_only_with_a_routable_rank_in_each_pool() -> None:
    """In P/D mode a routable decode rank alone is not ready (a request that needs a
    prefill would answer 503): the reason names the empty pool and its engines, and the
    router turns ready once a prefill rank is routable too."""
    router = Router(block_size=16)
    pd = PDMode(
        [PDEngine("http://p:1", "p", "prefill"), PDEngine("http://d:1", "d", "decode")], "sglang"
    )
    service = RouterService(router, [], pd=pd)
    router.add_holder(Holder("d", 0), block_size=16)
    state = readiness(service)
    assert (state.ok, state.routable) == (False, 1), state
    assert state.reasons == [
        "no prefill engine rank is routable: requests that need one answer 503 until one "
        "of the prefill engines (p) is up and followed"
    ]
    router.add_holder(Holder("p", 0), block_size=16)
    assert readiness(service) == Readiness(ok=True, reasons=[], routable=2, holders=2)
    router.set_worker_available("d", False)
    state = readiness(service)
    assert not state.ok and state.reasons[0].startswith("no decode engine rank is routable")
    for i in range(MAX_REASONS + 5):  # more problems than are listed: the pool's reason stays
        router.add_holder(Holder(f"x{i}", 0), block_size=8)
    state = readiness(service)
    assert len(state.reasons) == MAX_REASONS + 1, state.reasons
    assert state.reasons[0].startswith("no decode engine rank is routable"), state.reasons


def test_reasons_are_capped_and_the_rest_counted() -> None:
    """Past MAX_REASONS lines the answer says how many more there are, not each."""
    router = Router(block_size=16)
    for i in range(MAX_REASONS + 10):
        router.add_holder(Holder(f"e{i}", 0), block_size=8)
    state = readiness(RouterService(router, []))
    assert len(state.reasons) == MAX_REASONS + 1 and not state.ok
    assert state.reasons[-1] == "... and 10 more: see GET /workers"


def test_the_readiness_line_waits_a_little_for_holders_still_held_back() -> None:
    """Ready with a rank still held back, the line waits (at most ``settle`` s) for it: a
    rank that turns routable meanwhile is counted, one that does not is named."""
    router = Router(block_size=16)
    service = RouterService(router, [])
    router.add_holder(Holder("a", 0), block_size=16)
    router.add_holder(Holder("b", 0), block_size=16)
    router.set_worker_available("b", False)
    said: list[str] = []

    async def comes_up() -> Readiness:
        asyncio.get_running_loop().call_later(0.2, router.set_worker_available, "b", True)
        return await report_readiness(service, said.append, interval=0.02, settle=5.0)

    assert asyncio.run(comes_up()).reasons == []
    router.set_worker_available("b", False)
    started = time.monotonic()
    state = asyncio.run(report_readiness(service, said.append, interval=0.02, settle=0.3))
    assert state.ok and 0.3 <= time.monotonic() - started < 5.0
    assert said == [
        "ready to route: 2 of 2 holders",
        "ready to route: 1 of 2 holders (engine b rank 0: unavailable: the engine reports "
        "the rank down)",
    ], said


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Engine:
    """An engine with no --kv-events-config: it publishes by default."""
    return make_engine(["--dp-size", "2"], None)


def readiness_line(router: KVEventsProcess, timeout: float = 30.0) -> str | None:
    """The rest of the router's stdout line after :data:`READINESS`, or None after
    ``timeout`` s. Read by a thread: the ready line's read may have buffered it already,
    where waiting on the pipe's descriptor would not see it."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        try:
            for line in router.proc.stdout or ():
                lines.put(line)
        except (ValueError, OSError):  # the pipe closed by stop()
            pass

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line.startswith(READINESS):
            return line[len(READINESS) :].strip()
    return None


def _ready(router: KVEventsProcess) -> tuple[int, dict[str, Any]]:
    answer = router.http.get("/ready")
    return answer.status_code, answer.json()


def _reasons(router: KVEventsProcess) -> str:
    return " | ".join(_ready(router)[1]["reasons"])


@pytest.mark.slow
def test_engine_and_router_with_no_flags_route(engine: Engine) -> None:
    """`kvevents engine` and `kvevents router --engine URL` (the default worker count) say
    they can route, are ready before any request (an idle engine publishes nothing), and
    /route then answers 200 with the cached prefix once the engine has served it."""
    router = KVEventsProcess("router", ["--port", "0", "--engine", engine.url])
    try:
        line = readiness_line(router)
        assert line == "ready to route: 2 of 2 holders", line
        status, ready = _ready(router)
        assert (status, ready["ok"], ready["routable"], ready["reasons"]) == (200, True, 2, [])
        assert router.http.get("/workers").json()["ready"]["ok"] is True
        prompt = list(range(1, 65))  # 4 blocks of 16
        engine.generate(prompt, rank=1)

        def cached() -> bool:
            answer = router.http.post("/route", json={"input_ids": prompt})
            assert answer.status_code == 200, answer.text
            chosen: dict[str, Any] = answer.json()
            return bool(chosen["dp_rank"] == 1 and chosen["scores"][0]["matched"]["gpu"] == 3)

        wait_until(cached, 20, "the prompt's 3 reusable blocks routed to rank 1")
    finally:
        router.stop()


@pytest.mark.slow
def test_every_process_of_a_group_answers_ready_for_the_group(engine: Engine) -> None:
    """With --workers 2 the readiness line comes once the whole group can route: from then
    on /ready answers 200 on every new connection, whichever process the kernel hands it
    (both are seen answering)."""
    router = KVEventsProcess("router", ["--port", "0", "--workers", "2", "--engine", engine.url])
    try:
        line = readiness_line(router)
        assert line == "ready to route: 2 of 2 holders", line
        seen: set[int] = set()
        for _ in range(24):
            with httpx.Client(base_url=router.url, timeout=10.0) as fresh:
                answer = fresh.get("/ready")
                assert answer.status_code == 200, answer.text
                assert answer.json()["reasons"] == [], answer.text
                seen.add(fresh.get("/workers").json()["process"]["index"])
        assert seen == {0, 1}, seen
    finally:
        router.stop()


@pytest.mark.slow
def test_a_router_whose_engine_publishes_nothing_is_not_ready_until_it_does() -> None:
    """An engine started with the null publisher leaves the router alive (/health 200) but
    not ready (/ready 503 naming the engine and its missing stream, in /workers and the
    line after the ready line too); the engine restarted on its port with publishing on
    makes it ready, and the events it then publishes reach the index."""
    silent: Engine | None = Engine(["--dp-size", "2"], {"publisher": "null"})
    assert silent is not None
    url, port = silent.url, silent.url.rsplit(":", 1)[1]
    router = RouterProc([url])
    engine = None
    try:
        line = readiness_line(router)
        assert line is not None and line.startswith("not ready to route"), line
        assert url in line and "kv_events" in line, line
        assert router.http.get("/health").status_code == 200
        status, ready = _ready(router)
        assert (status, ready["ok"], ready["routable"]) == (503, False, 0)
        assert any(url in r and "no usable KV-event stream" in r for r in ready["reasons"])
        assert router.http.get("/workers").json()["ready"] == ready
        silent.stop()
        silent = None
        engine = Engine(["--dp-size", "2", "--port", port], None)
        wait_until(lambda: _ready(router)[0] == 200, 30, "the router ready")
        assert _ready(router)[1]["routable"] == 2
        engine.generate(list(range(1, 33)), rank=0)
        wait_until(
            lambda: router.http.get("/workers").json()["index"]["blocks"] >= 2,
            20,
            "the engine's events in the index",
        )
    finally:
        router.stop()
        if silent is not None:
            silent.stop(expect=None)
        if engine is not None:
            engine.stop()


@pytest.mark.slow
def test_a_router_pointed_at_a_wrong_port_is_not_ready_and_says_unreachable() -> None:
    """A port where nothing listens makes /ready 503 with an "unreachable" reason naming
    the URL, while /health answers 200; /ready is open without the --api-key, as /health."""
    with socket.socket() as held:  # bound, never listening: connections are refused
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        router = RouterProc([url], "--api-key", "sesame")
        try:
            wait_until(lambda: "unreachable" in _reasons(router), 20, "the reason")
            status, ready = _ready(router)
            assert (status, ready["ok"], ready["holders"]) == (503, False, 0)
            assert any(r.startswith(f"engine {url} is unreachable") for r in ready["reasons"])
            assert router.http.get("/health").status_code == 200
            assert router.http.post("/route", json={"input_ids": [1]}).status_code == 401
        finally:
            router.stop()


@pytest.mark.slow
def test_a_block_size_mismatch_is_the_reason_the_router_is_not_ready(engine: Engine) -> None:
    """A router told --block-size 32 for an engine of 16-token blocks would match nothing
    it caches: /ready answers 503 naming both sizes for the engine's ranks."""
    router = RouterProc([engine.url], "--block-size", "32")
    try:
        wait_until(lambda: "block size mismatch" in _reasons(router), 20, "the mismatch")
        status, ready = _ready(router)
        assert (status, ready["routable"], ready["holders"]) == (503, 0, 2)
        (reason,) = ready["reasons"]
        assert reason.startswith(f"engine {engine.url} ranks 0-1: block size mismatch"), reason
        assert "at 16 tokens" in reason and "keys at 32" in reason, reason
    finally:
        router.stop()
