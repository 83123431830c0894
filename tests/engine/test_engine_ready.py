"""The simulated engine's defaults and readiness: it publishes unless told not to, on
ports the OS picks, and ``GET /ready`` says whether every rank can serve."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from engine_support import Engine, pid_alive

from kvevents.engine.readiness import engine_readiness
from subscriber_support import wait_for


def _ranks(*states: tuple[str, str | None]) -> list[dict[str, Any]]:
    return [
        {"dp_rank": r, "state": state, "endpoint": endpoint, "exit_code": None}
        for r, (state, endpoint) in enumerate(states)
    ]


def test_readiness_names_every_rank_that_cannot_serve() -> None:
    """Ranks running with a bound publisher are ready; a restarting rank, a dead one and,
    when publishing, one with no endpoint are each a reason naming the rank."""
    bound = "tcp://127.0.0.1:5557"
    assert engine_readiness(_ranks(("running", bound)), publishing=True).ok
    assert engine_readiness(_ranks(("running", None)), publishing=False).ok
    state = engine_readiness(
        _ranks(("running", bound), ("restarting", None), ("dead", None), ("running", None)),
        publishing=True,
    )
    assert not state.ok
    assert state.reasons == [
        "dp_rank 1 is being restarted (starting)",
        "dp_rank 2 is dead",
        "dp_rank 3 has no bound KV-event publisher",
    ]
    assert engine_readiness([], publishing=True).reasons == ["the engine has no rank"]


@pytest.mark.slow
def test_two_engines_with_no_config_publish_on_ports_of_their_own() -> None:
    """Without --kv-events-config an engine publishes, live and replay, every rank on a
    loopback port the OS picked, listed in /server_info; a second engine beside it does
    the same on other ports, and both answer /ready 200."""
    engines = [Engine(["--dp-size", "2"], None) for _ in range(2)]
    try:
        ports: list[int] = []
        for eng in engines:
            block = eng.server_info()["kv_events"]
            assert (block["publisher"], block["endpoint_host"], block["dp_size"]) == (
                "zmq",
                "127.0.0.1",
                2,
            )
            for pub in block["publishers"]:
                for endpoint in (pub["endpoint"], pub["replay_endpoint"]):
                    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
                    assert host == "127.0.0.1" and int(port) > 0, endpoint
                    ports.append(int(port))
            ready = eng.http.get("/ready")
            assert ready.status_code == 200, ready.text
            assert ready.json() == {"ok": True, "reasons": [], "publishing": True}
        assert len(set(ports)) == len(ports) == 8
    finally:
        for eng in engines:
            eng.stop()


@pytest.mark.slow
def test_the_null_publisher_turns_publishing_off_and_the_engine_is_ready() -> None:
    """``{"publisher": "null"}`` leaves /server_info without a kv_events block, and /ready
    answers 200 saying it does not publish."""
    eng = Engine(["--dp-size", "2"], {"publisher": "null"})
    try:
        assert "kv_events" not in eng.server_info()
        ready = eng.http.get("/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json() == {"ok": True, "reasons": [], "publishing": False}
    finally:
        eng.stop()


@pytest.mark.slow
def test_a_dead_rank_makes_the_engine_not_ready() -> None:
    """A rank killed from outside makes /ready answer 503 naming it and its exit code (and
    /health 503), for the --dead-rank-grace before the engine exits; /ready and the API's
    description (/docs, /openapi.json) need no key, /server_info does."""
    eng = Engine(["--dp-size", "2", "--dead-rank-grace", "60", "--api-key", "sesame"], None)
    try:
        for path in ("/ready", "/docs", "/openapi.json"):
            assert eng.http.get(path).status_code == 200, path
        assert eng.http.get("/server_info").status_code == 401
        pid = eng.rank_pids()[1]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 10, "the rank gone")
        wait_for(lambda: eng.http.get("/ready").status_code == 503, 10, "/ready 503")
        ready = eng.http.get("/ready")
        assert ready.json() == {
            "ok": False,
            "reasons": ["dp_rank 1 is dead (exit code -9)"],
            "publishing": True,
        }
        assert eng.http.get("/health").status_code == 503
    finally:
        eng.stop(expect=None)
