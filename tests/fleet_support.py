"""Engines and routers a test module starts, stopped together at its end.

:class:`Fleet` backs the ``make_engine`` and ``make_router`` fixtures of
``tests/conftest.py``: each call starts one ``kvevents engine`` or ``kvevents router``
subprocess on OS-chosen ports (``--port 0``, ``tcp://*:0``) and remembers it, and
:meth:`Fleet.stop_all` stops every one still running, newest first, so a router goes
before the engines it follows. A process a test stopped itself is skipped. Each stop
checks the clean exit (code 0); every process is stopped before the first failure is
raised, so one bad exit never leaves the others running.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine_support import Engine
from router_support import KV_CONFIG, RouterProc, wait_until

from process_support import KVEventsProcess

__all__ = ["Fleet"]


class Fleet:
    """The processes one fixture scope started; see the module docstring."""

    def __init__(self) -> None:
        self.started: list[KVEventsProcess] = []

    def engine(
        self,
        args: Sequence[str],
        kv_config: Mapping[str, Any] | None = KV_CONFIG,
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> Engine:
        """A ready ``kvevents engine --port 0 ARGS`` publishing with ``kv_config``
        (None: the engine's default), stopped by :meth:`stop_all`."""
        config = None if kv_config is None else dict(kv_config)
        eng = Engine(list(args), config, timeout=timeout, env=env)
        self.started.append(eng)
        return eng

    def router(
        self,
        engines: Sequence[str],
        *extra: str,
        streams: int | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 30.0,
    ) -> RouterProc:
        """A ready ``kvevents router --port 0`` following ``engines`` (URLs) with ``extra``
        options (one process unless ``--workers`` is among them); with ``streams``, also
        waited for (at most 30 s) until that many event streams are connected."""
        proc = RouterProc(engines, *extra, timeout=timeout, env=env)
        self.started.append(proc)
        if streams is not None:
            wait_until(
                lambda: proc.connected() >= streams,
                30,
                f"{streams} event streams connected to the router",
            )
        return proc

    def stop_all(self) -> None:
        """Stop every process still running, newest first; raise the first failure after."""
        failures: list[AssertionError] = []
        while self.started:
            proc = self.started.pop()
            if proc.exit_code is not None:
                continue
            try:
                proc.stop()
            except AssertionError as exc:
                failures.append(exc)
        if failures:
            raise failures[0]
