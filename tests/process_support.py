"""One way to run a `kvevents` command as a subprocess in tests: start it, wait (bounded)
for its ``kvevents COMMAND ready URL`` line, and stop it (SIGTERM, then kill).

The engine, router and subscriber tests' process helpers all derive from
:class:`KVEventsProcess`; every wait has a deadline and every pipe is closed.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

import httpx

__all__ = ["KVEventsProcess", "await_ready_line"]


def run_kvevents(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m kvevents.cli.main ARGS`` to its end (a command that must refuse to start)."""
    return subprocess.run(
        [sys.executable, "-m", "kvevents.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def await_ready_line(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str | None:
    """The rest of the first stdout line starting with ``prefix``, or None (exit or timeout)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
    return None


def stopped(pid: int) -> bool:
    """True once ``pid`` is gone or a zombie (exited, waiting for a parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def still_running(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still running after ``timeout`` seconds (an empty list when all stopped)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if not stopped(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


class KVEventsProcess:
    """``python -m kvevents.cli.main COMMAND ARGS`` until :meth:`stop` (fixtures call it).

    Ready when it prints ``kvevents COMMAND ready URL`` within ``timeout`` seconds;
    otherwise it is stopped and an AssertionError carries its stderr. ``url`` is that
    URL and ``http`` a client for it; ``env`` adds environment variables. With ``capture_stderr=False`` stderr goes to
    /dev/null (for chatty long runs, so a full pipe cannot block the child).
    """

    stderr = ""
    exit_code: int | None = None
    """The exit code once :meth:`stop` has run (None while it has not)."""

    def __init__(
        self,
        command: str,
        args: Sequence[str],
        *,
        timeout: float = 60.0,
        capture_stderr: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.command = command
        argv = [sys.executable, "-m", "kvevents.cli.main", command, *args]
        self.proc = subprocess.Popen(
            argv,
            env=None if env is None else {**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if capture_stderr else subprocess.DEVNULL,
            text=True,
        )
        url = await_ready_line(self.proc, f"kvevents {command} ready ", timeout)
        if url is None:
            code = self.stop(expect=None)
            raise AssertionError(
                f"kvevents {command} {list(args)} did not become ready within {timeout} s "
                f"(exit {code}): {self.stderr}"
            )
        self.url = url
        self.http = httpx.Client(base_url=self.url, timeout=30.0)

    def wait_exit(self, timeout: float = 20.0) -> int:
        """Wait for the process to exit; kill it and fail if it takes over ``timeout`` s."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(
                f"kvevents {self.command} did not exit within {timeout} s"
            ) from None

    def stop(self, sig: int = signal.SIGTERM, expect: int | None = 0) -> int:
        """Signal the process (if running), wait for it, close its pipes and client.

        Checks the exit code when ``expect`` is not None; returns it. Stopping a stopped
        process signals nothing and returns its exit code again (fixtures stop whatever a
        test left running).
        """
        if self.exit_code is None:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
            code = self.wait_exit()
            self.stderr = self.proc.stderr.read() if self.proc.stderr else ""
            for pipe in (self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    pipe.close()
            if hasattr(self, "http"):
                self.http.close()
            self.exit_code = code
        code = self.exit_code
        if expect is not None:
            assert code == expect, f"kvevents {self.command} exited {code}: {self.stderr}"
        return code
