"""Finding an engine's streams in the background: ``/server_info`` retried with backoff.

An :class:`EngineWatcher` runs one thread per engine URL. Until discovery succeeds,
each attempt is one HTTP request (``timeout`` seconds), failures wait ``retry_initial``
seconds, doubling up to ``retry_max``. The first failure of the streak is reported
through ``report`` as an :class:`~kvevents.subscribe.items.Unreachable` signal; success hands
every rank's :class:`~kvevents.subscribe.discovery.StreamSpec` to ``add_spec``.

Then, every ``recheck`` seconds (None: never, and the thread ends), ``/server_info`` is
read again: an engine restarted whole may publish on other endpoints (OS-chosen ports
change on every start), which reconnecting to the old ones would never find. A rank
whose endpoints, topic or block size changed goes to ``replace_spec``; a rank that is
new goes to ``add_spec``. A failed recheck changes nothing (the engine may be
restarting; its streams report themselves unreachable). Setting ``closing`` stops the
thread within one request timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import httpx
import msgspec

from kvevents.errors import DiscoveryError
from kvevents.http.auth import ClientCredentials
from kvevents.subscribe.discovery import StreamSpec, discover
from kvevents.subscribe.items import Signal, Unreachable
from kvevents.subscribe.stream_spec import MISSED_WITHOUT_REPLAY
from kvevents.types import Holder, StrEnum

__all__ = ["DiscoveryState", "EngineStatus", "EngineWatcher"]

log = logging.getLogger(__name__)


class DiscoveryState(StrEnum):
    """Where discovering one engine URL stands (members are their strings, as in JSON).

    ``DISCOVERING`` (the first attempt is running) -> ``SUBSCRIBED``, or ->
    ``UNREACHABLE`` (no answer) / ``INVALID`` (an answer that describes no usable
    stream), both retried with backoff until ``SUBSCRIBED``.
    """

    DISCOVERING = "discovering"
    UNREACHABLE = "unreachable"
    INVALID = "invalid"
    SUBSCRIBED = "subscribed"


class EngineStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Discovery state of one engine URL.

    ``state``: a :class:`DiscoveryState`: "discovering" (first attempt running), "unreachable" (no answer),
    "invalid" (it answers, but neither its /server_info nor a vLLM's /kv_event_sources
    describes a usable stream: publishing is off, or the document is malformed;
    ``last_error`` says which) or "subscribed".
    Unreachable and invalid engines are retried with backoff.
    """

    url: str
    worker: str
    state: DiscoveryState
    attempts: int
    last_error: str | None
    streams: int
    rediscoveries: int = 0
    """Ranks a later ``/server_info`` showed on new endpoints (the engine restarted whole)."""


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
        replace_spec: Callable[[StreamSpec], None] | None = None,
        remove_holder: Callable[[Holder, str], None] | None = None,
        resumed_ranks: Callable[[str], list[int]] | None = None,
        recheck: float | None = None,
        credentials: ClientCredentials | None = None,
    ) -> None:
        self.url = url
        self._credentials = credentials or ClientCredentials()
        self.worker = worker
        self.state = DiscoveryState.DISCOVERING
        self.attempts = 0
        self.last_error: str | None = None
        self.streams = 0
        self._timeout = timeout
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._closing = closing
        self._add_spec = add_spec
        self._report = report
        self._replace_spec = replace_spec
        self._remove_holder = remove_holder
        self._resumed_ranks = resumed_ranks
        self._recheck = recheck
        self._followed: dict[int, StreamSpec] = {}  # by dp_rank
        self.rediscoveries = 0  # ranks found on new endpoints by a recheck
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
            rediscoveries=self.rediscoveries,
        )

    def _run(self) -> None:
        # One client for the watcher's life: a fresh one per attempt built a new connection
        # pool and SSL context every recheck, holding the GIL for milliseconds each time.
        creds = self._credentials
        with httpx.Client(
            timeout=self._timeout, headers=creds.headers(), verify=creds.verify()
        ) as client:
            self._watch(client)

    def _watch(self, client: httpx.Client) -> None:
        delay = self._retry_initial
        reported = False
        while not self._closing.is_set():
            self.attempts += 1
            try:
                specs = self._discover(client)
            except DiscoveryError as exc:
                self.last_error = str(exc)
                self.state = DiscoveryState.INVALID if exc.reached else DiscoveryState.UNREACHABLE
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
            self._follow(specs)
            self.state = DiscoveryState.SUBSCRIBED
            break
        if self._recheck is None or self._replace_spec is None:
            return
        while not self._closing.wait(self._recheck):
            try:
                specs = self._discover(client)
            except DiscoveryError:
                continue  # restarting, or gone for now: the streams say so themselves
            self._follow(specs)

    def _discover(self, client: httpx.Client) -> list[StreamSpec]:
        """The engine's streams; DiscoveryError for any document that cannot be used."""
        try:
            return discover(self.url, worker=self.worker, timeout=self._timeout, client=client)
        except DiscoveryError:
            raise
        except Exception as exc:  # a document no check foresaw: retried, not fatal
            raise DiscoveryError(
                f"engine {self.url}: its discovery document could not be read "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    def _follow(self, specs: list[StreamSpec]) -> None:
        """Add ranks not followed yet; replace those whose stream moved; stop following
        those the engine no longer lists (it restarted with fewer)."""
        unrecoverable = [
            s.dp_rank
            for s in specs
            if s.replay_endpoint is None and s.dp_rank not in self._followed
        ]
        if unrecoverable:
            log.warning(
                "engine %s publishes rank(s) %s without a replay endpoint: %s. Give the "
                "engine's kv-events config a replay_endpoint to recover them",
                self.url,
                ", ".join(map(str, sorted(unrecoverable))),
                MISSED_WITHOUT_REPLAY,
            )
        for spec in specs:
            known = self._followed.get(spec.dp_rank)
            if known == spec:
                continue
            try:
                if known is None:
                    self._add_spec(spec)
                    self.streams += 1
                else:
                    assert self._replace_spec is not None  # only rechecks find a known rank
                    self._replace_spec(spec)
                    self.rediscoveries += 1
            except ValueError as exc:  # the same holder is followed already
                self.last_error = str(exc)
                continue
            self._followed[spec.dp_rank] = spec
        if self._remove_holder is None:
            return
        listed = {spec.dp_rank for spec in specs}
        gone = sorted(rank for rank in self._followed if rank not in listed)
        if gone:
            reason = (
                f"engine {self.url} no longer lists rank(s) {', '.join(map(str, gone))} "
                f"(it now has {len(listed)}): it restarted with fewer"
            )
            for rank in gone:
                spec = self._followed.pop(rank)
                self._remove_holder(Holder(spec.worker, spec.dp_rank), reason)
                self.streams -= 1
        # ranks the consumer holds state for (a peer's snapshot) that the engine lacks
        stale = [] if self._resumed_ranks is None else self._resumed_ranks(self.worker)
        for rank in sorted(r for r in stale if r not in listed):
            self._remove_holder(
                Holder(self.worker, rank),
                f"engine {self.url} does not list rank {rank}, which the state this "
                f"consumer resumed from (a peer's snapshot) has",
            )
