"""What the router learns of its P/D engines from their /server_info, over real HTTP."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from pd_support import FakePD, Handoffs

from kvevents.http.upstream import Upstream
from kvevents.router.serve.pd_mode import DEFAULT_BOOTSTRAP_PORT, PDEngine, PDMode


@pytest.fixture
def prefill() -> Iterator[FakePD]:
    fake = FakePD("prefill", Handoffs())
    yield fake
    fake.close()


def test_the_bootstrap_port_is_the_configured_else_the_advertised_else_sglangs() -> None:
    """A port given on the command line wins; else /server_info's; else 8998."""
    given = PDEngine("http://p:1", "http://p:1", "prefill", 7000)
    given.learn({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 7100})
    assert given.port() == (7000, "configured")
    told = PDEngine("http://p:1", "http://p:1", "prefill")
    assert told.port() == (DEFAULT_BOOTSTRAP_PORT, "default")
    told.learn({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 7100})
    assert told.port() == (7100, "server_info")
    told.learn({"disaggregation_bootstrap_port": True})  # not a port: the last one stays
    assert told.port() == (7100, "server_info")


def test_an_engine_in_the_wrong_role_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A --decode engine saying it is a prefill is logged, once while it says so."""
    engine = PDEngine("http://d:1", "http://d:1", "decode")
    with caplog.at_level(logging.WARNING, logger="kvevents.router"):
        for _ in range(3):
            engine.learn({"disaggregation_mode": "prefill"})
    assert len(caplog.records) == 1
    assert "given as a decode engine but says it runs disaggregation mode 'prefill'" in caplog.text
    assert engine.summary()["advertised_mode"] == "prefill"


@pytest.mark.slow
def test_watch_reads_the_port_and_follows_a_restart_to_another(prefill: FakePD) -> None:
    """The watch reads a prefill's advertised port, and reads it again later, so a
    prefill back on another port is followed; a request reads it itself before that."""
    decode = FakePD("decode", prefill.handoffs)
    try:
        engines = [
            PDEngine(prefill.url, prefill.url, "prefill"),
            PDEngine(decode.url, decode.url, "decode"),
        ]
        pd = PDMode(engines, "sglang", reread_s=0.1)

        async def run() -> None:
            stopping = asyncio.Event()
            upstream = Upstream(timeout=10.0)
            try:
                assert await pd.bootstrap_port(prefill.url, upstream) == prefill.bootstrap_port
                watching = asyncio.create_task(pd.watch(upstream, stopping))
                prefill.bootstrap_port = 7321

                async def followed() -> None:
                    while engines[0].port()[0] != 7321:
                        await asyncio.sleep(0.05)

                await asyncio.wait_for(followed(), 10)
                stopping.set()
                await asyncio.wait_for(watching, 5)
            finally:
                await upstream.close()
            assert engines[1].advertised_mode == "decode"

        asyncio.run(run())
    finally:
        decode.close()


def test_a_refused_or_failing_server_info_is_an_error_and_a_404_an_answer(prefill: FakePD) -> None:
    """A 401 from a prefill's /server_info is an error naming --engine-api-key and a 503 one
    naming the status, both read again (the default port is not taken for learned); a 404
    is an answer: the engine advertises nothing, so the default port holds."""
    engine = PDEngine(prefill.url, prefill.url, "prefill")
    pd = PDMode([engine, PDEngine("http://127.0.0.1:1", "d", "decode")], "sglang")

    async def read(status: int) -> None:
        prefill.server_info_status = status
        upstream = Upstream(timeout=10.0)
        try:
            await pd.bootstrap_port(prefill.url, upstream)
        finally:
            await upstream.close()

    asyncio.run(read(401))
    assert not engine.read and engine.error is not None
    assert "answered HTTP 401" in engine.error and "--engine-api-key" in engine.error
    asyncio.run(read(503))
    assert not engine.read and engine.error == f"GET {prefill.url}/server_info answered HTTP 503"
    asyncio.run(read(404))
    assert engine.read and engine.error is None
    assert engine.port() == (DEFAULT_BOOTSTRAP_PORT, "default")
