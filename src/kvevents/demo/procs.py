"""Child processes of ``kvevents demo``: start a subcommand, wait for its ready line, stop it.

Each child is ``python -m kvevents.cli.main NAME ...`` in a session (process group) of its
own, so a Ctrl-C typed in the terminal reaches only the demo, which then stops its
children in order (router first, then engine) instead of all of them racing at once.

Lifecycle of a :class:`Child`: :meth:`~Child.start` returns the URL from the child's
ready line (``kvevents NAME ready http://HOST:PORT``) or raises naming the command and
the tail of its stderr; :meth:`~Child.stop` sends SIGTERM to the child's process group,
waits up to ``timeout`` seconds, then sends SIGKILL; it is idempotent. Processes the
child started in sessions of their own (the engine's ranks) are registered with
:meth:`~Child.adopt` and checked, then killed by pid if they outlive the child.

Stdout is read by a daemon thread (the ready line goes to a queue, so the wait has a
deadline and no busy loop); stderr goes to an unnamed temporary file, read only to
explain a failure.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO

from kvevents.errors import KVEventsError

__all__ = ["Child", "pid_alive"]

_STDERR_TAIL = 2000


def pid_alive(pid: int) -> bool:
    """True while a process with this pid exists (and is not a zombie of ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class Child:
    """One ``kvevents NAME`` subprocess; see the module docstring."""

    def __init__(self, name: str, args: Sequence[str]) -> None:
        self.name = name
        self.argv = [sys.executable, "-m", "kvevents.cli.main", name, *args]
        self.ready_prefix = f"kvevents {name} ready "
        self.process: subprocess.Popen[str] | None = None
        self.adopted: list[int] = []
        self._stderr: IO[bytes] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self, timeout: float) -> str:
        """Start the child and return the URL of its ready line (within ``timeout`` seconds)."""
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        self.process = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read_stdout, name=f"{self.name}-stdout", daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._failure(f"did not print its ready line within {timeout:g} s")
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                code = self.process.wait(timeout=5.0)
                raise self._failure(f"exited with code {code} before it was ready")
            if line.startswith(self.ready_prefix):
                return line[len(self.ready_prefix) :].strip()

    def adopt(self, pids: Sequence[int]) -> None:
        """Processes the child started in their own sessions, to be checked by :meth:`stop`."""
        self.adopted.extend(p for p in pids if p not in self.adopted)

    def stop(self, timeout: float = 20.0) -> int | None:
        """Stop the child (SIGTERM, then SIGKILL after ``timeout``) and its adopted processes.

        Returns the child's exit code (None if it was never started). Idempotent.
        """
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            self._signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10.0)
        deadline = time.monotonic() + 5.0
        for pid in self.adopted:  # they notice their parent is gone within a fraction of a second
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if proc.stdout is not None:
            proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        return proc.returncode

    def stderr_tail(self) -> str:
        """The last characters the child wrote to stderr (for error messages)."""
        if self._stderr is None:
            return ""
        self._stderr.flush()
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - _STDERR_TAIL))
        return self._stderr.read().decode(errors="replace").strip()

    # --- internals ---------------------------------------------------------------------

    def _read_stdout(self) -> None:
        proc = self.process
        assert proc is not None and proc.stdout is not None
        with contextlib.suppress(ValueError, OSError):  # closed by stop()
            for line in proc.stdout:
                self._lines.put(line)
        self._lines.put(None)

    def _failure(self, what: str) -> KVEventsError:
        tail = self.stderr_tail()
        self.stop(timeout=5.0)
        detail = f"; its stderr ends with:\n{tail}" if tail else ""
        return KVEventsError(f"`kvevents {self.name}` {what}{detail}")

    @staticmethod
    def _signal_group(pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)  # the child leads its own session: pgid == pid
