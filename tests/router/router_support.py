"""Helpers for router tests: a `kvevents router` subprocess next to a `kvevents engine` one."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from engine_support import Engine, await_ready_line

__all__ = ["KV_CONFIG", "Engine", "RouterProc", "wait_until"]

READY = "kvevents router ready "
KV_CONFIG = {"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}


class RouterProc:
    """A `kvevents router --port 0` subprocess; stop() it (fixtures do)."""

    def __init__(self, engines: Sequence[str], *extra: str, timeout: float = 30.0) -> None:
        argv = [sys.executable, "-m", "kvevents.cli.main", "router", "--port", "0"]
        for url in engines:
            argv += ["--engine", url]
        argv += list(extra)
        if "--workers" not in extra:  # one process, so every request sees the same state
            argv += ["--workers", "1"]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.url = self._await_ready(timeout)
        self.http = httpx.Client(base_url=self.url, timeout=30.0)

    def _await_ready(self, timeout: float) -> str:
        url = await_ready_line(self.proc, READY, timeout)
        if url is None:
            code = self.stop(expect=None)
            raise AssertionError(f"router did not become ready (exit {code}): {self.stderr}")
        return url

    stderr = ""

    def stop(self, expect: int | None = 0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError("router did not stop within 20 s of SIGTERM") from None
        self.stderr = self.proc.stderr.read() if self.proc.stderr else ""
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        if hasattr(self, "http"):
            self.http.close()
        if expect is not None:
            assert code == expect, f"router exited {code}: {self.stderr}"
        return code

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
