"""The fast lane (``pytest -m 'not slow'``): which tests are slow, and a guard that
a fast test starts no process.

A test is ``slow`` when it starts a process (an engine, a router, nats-server, vLLM,
anything through :mod:`subprocess` or :mod:`multiprocessing`) or waits seconds; its
module says so (``pytestmark``) or the test does. :func:`slow_by_fixture` adds the mark
to every test that uses a fixture starting processes (``make_engine``, ``make_router``
and the fixtures built on them) and to the real-engine folder, so a module needs no mark
for those.

:class:`ProcessGuard` fails a test that is not marked slow the moment it starts a
process, naming the command, before the process exists: the lane stays fast because a
mistake cannot pass unnoticed, and the default run (every test) checks the marks too.
It patches :class:`subprocess.Popen` (which :mod:`asyncio` subprocesses use as well) and
:meth:`multiprocessing.process.BaseProcess.start` once for the session, and checks only
while a fast test runs.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["PROCESS_FIXTURES", "ProcessGuard", "slow_by_fixture"]

PROCESS_FIXTURES = frozenset({"make_engine", "make_router"})
"""Fixtures that start processes: a test using one (directly or through another fixture)
is slow."""

REAL_ENGINES = Path(__file__).resolve().parent / "real_engines"


def slow_by_fixture(items: list[pytest.Item]) -> None:
    """Mark slow every item that uses a process fixture or lies under tests/real_engines."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        path = Path(str(item.path)).resolve()
        if fixtures & PROCESS_FIXTURES or REAL_ENGINES in path.parents:
            item.add_marker(pytest.mark.slow)


class ProcessGuard:
    """Fails the running fast test that starts a process; see the module docstring."""

    def __init__(self) -> None:
        self.fast_test: str | None = None
        """The node id of the test running now when it is not slow, else None."""
        self._popen_init: Callable[..., None] | None = None
        self._process_start: Callable[..., None] | None = None

    def _refuse(self, what: str) -> None:
        if self.fast_test is not None:
            pytest.fail(
                f"{self.fast_test} starts a process ({what}) but is not marked slow: add "
                "@pytest.mark.slow (or the module's pytestmark) so the fast lane stays fast",
                pytrace=False,
            )

    def install(self) -> None:
        """Patch process creation for the session (idempotent)."""
        if self._popen_init is not None:
            return
        guard = self
        popen_init = subprocess.Popen.__init__
        process_start = multiprocessing.process.BaseProcess.start

        def checked_popen_init(self: subprocess.Popen[Any], args: Any, *a: Any, **k: Any) -> None:
            guard._refuse(f"subprocess {str(args)[:120]}")
            popen_init(self, args, *a, **k)

        def checked_start(self: multiprocessing.process.BaseProcess) -> None:
            guard._refuse(f"multiprocessing {self!r}")
            process_start(self)

        self._popen_init, self._process_start = popen_init, process_start
        subprocess.Popen.__init__ = checked_popen_init  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = checked_start  # type: ignore[method-assign]

    def uninstall(self) -> None:
        """Put process creation back as it was."""
        if self._popen_init is None or self._process_start is None:
            return
        subprocess.Popen.__init__ = self._popen_init  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = self._process_start  # type: ignore[method-assign]
        self._popen_init = self._process_start = None
