"""Helpers for router tests: a `kvevents router` subprocess next to a `kvevents engine` one."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
from engine_support import Engine

from process_support import KVEventsProcess

__all__ = ["KV_CONFIG", "Engine", "RouterProc", "wait_until"]

KV_CONFIG = {"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}


class RouterProc(KVEventsProcess):
    """A `kvevents router --port 0` subprocess; stop() it (fixtures do)."""

    def __init__(
        self,
        engines: Sequence[str],
        *extra: str,
        timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        argv = ["--port", "0"]
        for url in engines:
            argv += ["--engine", url]
        argv += list(extra)
        if "--workers" not in extra:  # one process, so every request sees the same state
            argv += ["--workers", "1"]
        super().__init__("router", argv, timeout=timeout, env=env)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(path, json=body)

    def connected(self) -> int:
        """Streams the router reports connected in ``/workers``."""
        streams = self.http.get("/workers").json()["streams"]
        return sum(s["status"] == "connected" for s in streams)


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    """Call ``check`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
