"""Finding an engine's streams in the background: ``/server_info`` retried with backoff.

An :class:`EngineWatcher` runs one thread per engine URL until discovery succeeds:
each attempt is one HTTP request (``timeout`` seconds), failures wait ``retry_initial``
seconds, doubling up to ``retry_max``. The first failure of the streak is reported
through ``report`` as an :class:`~kvevents.signals.Unreachable` signal; success hands
every rank's :class:`~kvevents.discovery.StreamSpec` to ``add_spec`` and ends the thread.
Setting ``closing`` stops it within one request timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec

from kvevents.discovery import StreamSpec, fetch_server_info, streams_from_server_info
from kvevents.errors import DiscoveryError
from kvevents.signals import Signal, Unreachable

__all__ = ["EngineStatus", "EngineWatcher"]


class EngineStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Discovery state of one engine URL.

    ``state``: "discovering" (first attempt running), "unreachable" (no answer),
    "invalid" (it answers, but its /server_info has no usable kv_events block: publishing
    is off, or the block is malformed; ``last_error`` says which) or "subscribed".
    Unreachable and invalid engines are retried with backoff.
    """

    url: str
    worker: str
    state: str
    attempts: int
    last_error: str | None
    streams: int


class EngineWatcher:
    """See the module docstring. Counters and state are read from any thread."""

    def __init__(
        self,
        url: str,
        worker: str,
        *,
        timeout: float,
        retry_initial: float,
        retry_max: float,
        closing: threading.Event,
        add_spec: Callable[[StreamSpec], None],
        report: Callable[[Signal], None],
    ) -> None:
        self.url = url
        self.worker = worker
        self.state = "discovering"
        self.attempts = 0
        self.last_error: str | None = None
        self.streams = 0
        self._timeout = timeout
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._closing = closing
        self._add_spec = add_spec
        self._report = report
        self.thread = threading.Thread(
            target=self._run, name=f"kvevents-discover {url}", daemon=True
        )

    def status(self) -> EngineStatus:
        return EngineStatus(
            url=self.url,
            worker=self.worker,
            state=self.state,
            attempts=self.attempts,
            last_error=self.last_error,
            streams=self.streams,
        )

    def _run(self) -> None:
        delay = self._retry_initial
        reported = False
        while not self._closing.is_set():
            self.attempts += 1
            state = "unreachable"
            try:
                info = fetch_server_info(self.url, timeout=self._timeout)
                state = "invalid"
                specs = streams_from_server_info(info, engine_url=self.url, worker=self.worker)
            except DiscoveryError as exc:
                self.last_error = str(exc)
                self.state = state
                if not reported:
                    reported = True
                    self._report(
                        Unreachable(
                            worker=self.worker,
                            dp_rank=None,
                            address=self.url,
                            reason=f"{exc}; retrying with backoff up to every "
                            f"{self._retry_max:g} s",
                        )
                    )
                if self._closing.wait(delay):
                    return
                delay = min(self._retry_max, delay * 2)
                continue
            self.last_error = None
            for spec in specs:
                try:
                    self._add_spec(spec)
                    self.streams += 1
                except ValueError as exc:  # the same holder is followed already
                    self.last_error = str(exc)
            self.state = "subscribed"
            return
