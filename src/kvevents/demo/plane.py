"""What the demo asks the running engine and router over HTTP: readiness, settling, counts.

The engine's ``/load`` says how many batches each rank has published (its next
sequence number) and how many blocks it holds; the router's ``/workers`` says, per
stream, the last sequence number it received, and per holder how many blocks its
index holds and the last sequence number applied to it. The plane has *settled* when,
for every rank, the router's last received and last applied seqs are the engine's last
published seq: every event has been delivered and applied.
:meth:`Plane.wait_settled` waits for that, with a deadline, and then checks that the
router's index holds exactly as many blocks per rank as the engine's cache does.

Every wait here polls with a fixed small interval and raises
:class:`~kvevents.errors.KVEventsError` naming what did not happen at its deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvevents.errors import KVEventsError

__all__ = ["EventCounts", "Plane", "Settled"]

_POLL_S = 0.05


@dataclass(frozen=True)
class Settled:
    """Per rank, after settling: blocks the engine holds and blocks the router's index holds."""

    engine_blocks: dict[int, int]
    index_blocks: dict[int, int]

    @property
    def consistent(self) -> bool:
        return self.engine_blocks == self.index_blocks


@dataclass(frozen=True)
class EventCounts:
    """The event plane's figures for the whole demo (every rank, both policies, the flush)."""

    batches_published: int
    events_published: int
    blocks_stored: int
    blocks_removed: int
    batches_delivered: int
    events_applied: int
    replayed: int
    gaps: int
    lost: int
    resets: int
    malformed: int


class Plane:
    """HTTP access to one engine and the router that follows it."""

    def __init__(self, engine_url: str, router_url: str, timeout: float = 30.0) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.router_url = router_url.rstrip("/")
        self.http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def _get(self, url: str) -> Any:
        response = self.http.get(url)
        response.raise_for_status()
        return response.json()

    def engine_load(self) -> list[dict[str, Any]]:
        ranks: list[dict[str, Any]] = self._get(f"{self.engine_url}/load")["ranks"]
        return ranks

    def rank_pids(self) -> list[int]:
        ranks = self._get(f"{self.engine_url}/health")["ranks"]
        return [int(r["pid"]) for r in ranks if r.get("pid") is not None]

    def workers(self) -> dict[str, Any]:
        body: dict[str, Any] = self._get(f"{self.router_url}/workers")
        return body

    def _streams(self, workers: dict[str, Any]) -> dict[int, dict[str, Any]]:
        return {int(s["dp_rank"]): s for s in workers["streams"] if s["worker"] == self.engine_url}

    def wait_subscribed(self, dp_size: int, timeout: float) -> None:
        """Until the router follows all ``dp_size`` streams and knows the block size."""

        def ready() -> bool:
            w = self.workers()
            streams = self._streams(w)
            connected = [s for s in streams.values() if s["status"] == "connected"]
            holders = [h for h in w["holders"] if h["worker"] == self.engine_url]
            return (
                len(connected) == dp_size
                and len(holders) == dp_size
                and w["index"]["block_size"] is not None
            )

        _wait(ready, timeout, f"the router to follow all {dp_size} streams of {self.engine_url}")

    def wait_settled(self, timeout: float) -> Settled:
        """Until every published batch has reached the router (see the module docstring)."""
        state: dict[str, Any] = {}

        def settled() -> bool:
            load = {int(r["dp_rank"]): r for r in self.engine_load()}
            w = self.workers()
            streams = self._streams(w)
            applied = {
                int(h["dp_rank"]): h.get("applied_seq")
                for h in w["holders"]
                if h["worker"] == self.engine_url
            }
            state.update(load=load, workers=w)
            for rank, figures in load.items():
                want = figures["batches_published"] - 1
                last = streams.get(rank, {}).get("last_seq")
                if (-1 if last is None else last) != want:
                    return False
                # received is not yet applied: the batch may still wait for the router's loop
                if want >= 0 and applied.get(rank) != want:
                    return False
            return True

        _wait(settled, timeout, "the router to receive every batch the engine published")
        holders = {
            int(h["dp_rank"]): int(h["index_entries"])
            for h in state["workers"]["holders"]
            if h["worker"] == self.engine_url
        }
        engine = {rank: int(r["blocks_used"]) for rank, r in state["load"].items()}
        return Settled(engine, {rank: holders.get(rank, 0) for rank in engine})

    def flush(self, timeout: float) -> Settled:
        """Flush every rank's cache, then wait until the router's index is empty too."""
        response = self.http.post(f"{self.engine_url}/flush_cache")
        response.raise_for_status()
        settled = self.wait_settled(timeout)
        if any(settled.index_blocks.values()) or any(settled.engine_blocks.values()):
            raise KVEventsError(
                f"after /flush_cache the engine holds {settled.engine_blocks} blocks per rank "
                f"and the router's index {settled.index_blocks}; both should be empty"
            )
        return settled

    def event_counts(self) -> EventCounts:
        load = self.engine_load()
        w = self.workers()
        streams = self._streams(w).values()
        metrics = self.http.get(f"{self.router_url}/metrics").text
        return EventCounts(
            batches_published=sum(int(r["batches_published"]) for r in load),
            events_published=sum(int(r["events_published"]) for r in load),
            blocks_stored=sum(int(r["blocks_stored"]) for r in load),
            blocks_removed=sum(int(r["blocks_removed"]) for r in load),
            batches_delivered=sum(int(s["batches"]) for s in streams),
            events_applied=int(_metric_sum(metrics, "kvevents_router_events_total")),
            replayed=sum(int(s["replayed"]) for s in streams),
            gaps=sum(int(s["gaps"]) for s in streams),
            lost=sum(int(s["lost"]) for s in streams),
            resets=sum(int(s["resets"]) for s in streams),
            malformed=sum(int(s["malformed"]) + int(s["decode_errors"]) for s in streams),
        )


def _metric_sum(text: str, name: str) -> float:
    """Sum of every sample of metric ``name`` in Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise KVEventsError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(_POLL_S)
