"""The demo's restart step: one synced replica SIGKILLed mid-trace, restarted with ``--peer``.

During the synced replicas' replay (``kvevents demo --routers N``, N >= 2), a thread
waits until half the trace's requests are answered (:meth:`RestartStep.answered`), then:

1. SIGKILLs the last replica's process group and takes its URL out of the replay's
   targets, as a load balancer's health check would;
2. starts a new ``kvevents router`` with the same options plus ``--peer URL`` for each
   surviving replica, and adds it to the targets once it is ready;
3. polls until the new replica has **caught up** with the engine, rank by rank: the
   engine's ``/load`` is the same just before and after the replica's ``/workers``, the
   replica's last applied seq of the rank's stream is the rank's last published one, and
   it holds as many of the rank's blocks (timed from the new process's launch). These
   answers are small, so polling is cheap while the trace runs; comparing whole block
   sets (``/dump`` against ``/kv_blocks``) is costly at fleet scale, so it is done once,
   after the trace settled (:meth:`RestartStep.exact_check`).

:func:`restart_figures` then reads the outcomes between the kill and that moment: a
request **missed its predicted prefix** when the engine's ``cached_tokens`` is below the
tokens of the blocks the router counted as cached on the rank it chose (the router
expected a prefix the rank did not hold); and the hit rate of the requests the restarted
replica routed meanwhile, against the surviving replicas' in the same window.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvevents.demo.procs import Child
from kvevents.demo.replay import Outcome, PolicyRun, hit_rate
from kvevents.index.prefix_index import PrefixIndex
from kvevents.types import Holder

__all__ = ["RestartStep", "restart_figures"]

_POLL_S = 0.05


@dataclass
class RestartStep:
    """See the module docstring. ``targets``: the replay's live list of ``/generate`` URLs
    (one per child of ``children``, in order); ``after``: answered requests before the
    kill."""

    engine_url: str
    dp_size: int
    children: list[Child]
    targets: list[str]
    after: int
    startup_timeout: float
    equal_timeout: float = 30.0
    killed_at: float | None = None
    launched_at: float | None = None
    ready_at: float | None = None
    equal_at: float | None = None
    rank_equal_at: dict[int, float] = field(default_factory=dict)
    polls: int = 0
    exact: dict[int, bool] | None = None
    """Per rank, after the trace settled: the replica's blocks are the rank's exactly."""
    warm_start: dict[str, Any] | None = None
    error: str | None = None
    new_url: str | None = None
    old_url: str | None = None
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _due: threading.Event = field(default_factory=threading.Event)
    _answered: int = 0

    def answered(self) -> None:
        """One more request of the replay was answered (called on the replay's thread)."""
        self._answered += 1
        if self._answered >= self.after:
            self._due.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="demo-restart", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the step to end, then tell it to stop polling."""
        if self._thread is not None:
            if not self._due.is_set():
                self._stop.set()  # the replay ended before the kill was due
            self._thread.join(timeout)
            self._stop.set()
            self._thread.join(self.startup_timeout + 10.0)

    def _run(self) -> None:
        try:
            self._steps()
        except Exception as exc:  # reported in the figures, never lost in a thread
            self.error = f"{type(exc).__name__}: {exc}"

    def _steps(self) -> None:
        while not self._due.wait(0.1):
            if self._stop.is_set():
                return  # the replay ended first
        victim = self.children[-1]
        gone = self.targets[-1]
        self.old_url = gone.removesuffix("/generate")
        assert victim.pid is not None
        os.killpg(victim.pid, signal.SIGKILL)  # it leads its own session
        self.killed_at = time.monotonic()
        with contextlib.suppress(ValueError):
            self.targets.remove(gone)
        victim.stop()  # reaps it, closes its pipes
        peers = [u.removesuffix("/generate") for u in self.targets]
        argv = victim.argv[4:]  # after: python -m kvevents.cli.main router
        child = Child("router", [*argv, *(a for u in peers for a in ("--peer", u))])
        self.children[-1] = child  # stopped with the others
        self.launched_at = time.monotonic()
        url = self.new_url = child.start(self.startup_timeout)
        self.ready_at = time.monotonic()
        self.targets.append(f"{url}/generate")
        with httpx.Client(timeout=30.0) as http:
            self.warm_start = http.get(f"{url}/workers").json().get("warm_start")
            deadline = self.ready_at + self.equal_timeout
            while time.monotonic() < deadline and not self._stop.is_set():
                self._poll(http, url)
                if len(self.rank_equal_at) == self.dp_size:
                    self.equal_at = max(self.rank_equal_at.values())
                    return
                time.sleep(_POLL_S)

    def _poll(self, http: httpx.Client, url: str) -> None:
        self.polls += 1
        before = self._engine_load(http)
        workers = http.get(f"{url}/workers").json()
        now = time.monotonic()
        after = self._engine_load(http)
        seqs = {
            int(s["dp_rank"]): s["last_seq"]
            for s in workers["streams"]
            if s["worker"] == self.engine_url
        }
        held = {
            int(h["dp_rank"]): int(h["index_entries"])
            for h in workers["holders"]
            if h["worker"] == self.engine_url
        }
        for r, (published, blocks) in before.items():
            if r in self.rank_equal_at or after.get(r) != (published, blocks):
                continue
            if seqs.get(r) == published - 1 and held.get(r) == blocks:
                self.rank_equal_at[r] = now

    def _engine_load(self, http: httpx.Client) -> dict[int, tuple[int, int]]:
        answer = http.get(f"{self.engine_url}/load")
        answer.raise_for_status()
        return {
            int(r["dp_rank"]): (int(r["batches_published"]), int(r["blocks_used"]))
            for r in answer.json()["ranks"]
        }

    def exact_check(self) -> None:
        """After the trace settled: the replica's blocks of each rank against ``/kv_blocks``."""
        if self.new_url is None:
            return
        with httpx.Client(timeout=120.0) as http:
            index = PrefixIndex.from_bytes(http.get(f"{self.new_url}/dump").content)
            self.exact = {}
            for r in range(self.dp_size):
                answer = http.get(f"{self.engine_url}/kv_blocks", params={"dp_rank": r})
                answer.raise_for_status()
                engine = set(answer.json()["block_hashes"])
                self.exact[r] = index.holder_hashes(Holder(self.engine_url, r)) == engine


def restart_figures(step: RestartStep, run: PolicyRun, page_size: int) -> dict[str, Any]:
    """The restart step's figures for the report (see the module docstring)."""
    doc: dict[str, Any] = {
        "killed_url": step.old_url,
        "restarted_url": step.new_url,
        "error": step.error,
        "warm_start": step.warm_start,
        "polls": step.polls,
        "retried_requests": run.retried,
    }
    if step.killed_at is None or step.launched_at is None:
        return doc | {"done": False}
    t0 = run.started
    end = step.equal_at if step.equal_at is not None else t0 + run.wall_s

    def since(t: float | None) -> float | None:
        return None if t is None or step.launched_at is None else t - step.launched_at

    window = [
        o
        for o in run.outcomes
        if isinstance(o, Outcome)
        and o.error is None
        and step.killed_at - t0 <= o.sent_s <= end - t0
    ]
    counted = [o for o in window if o.router_cached_blocks is not None]
    missed = [
        o
        for o in counted
        if o.cached_tokens < math.floor(o.router_cached_blocks or 0.0) * page_size
    ]
    new = f"{step.new_url}/generate" if step.new_url else None
    mine = [o for o in window if o.target == new]
    others = [o for o in window if o.target != new]
    return doc | {
        "done": True,
        "killed_at_s": step.killed_at - t0,
        "down_s": (step.ready_at or end) - step.killed_at,
        "ready_after_launch_s": since(step.ready_at),
        "caught_up_after_ready_s": None
        if step.equal_at is None or step.ready_at is None
        else step.equal_at - step.ready_at,
        "caught_up_after_launch_s": since(step.equal_at),
        "rank_caught_up_after_launch_s": {
            r: since(t) for r, t in sorted(step.rank_equal_at.items())
        },
        "index_caught_up": step.equal_at is not None,
        "index_exactly_equal_after_trace": None if step.exact is None else all(step.exact.values()),
        "meanwhile_requests": len(window),
        "meanwhile_missed_predicted_prefix": len(missed),
        "meanwhile_missed_via_restarted": sum(o.target == new for o in missed),
        "meanwhile_requests_via_restarted": len(mine),
        "meanwhile_hit_rate_via_restarted": hit_rate(
            [(o.prompt_tokens, o.cached_tokens) for o in mine]
        ),
        "meanwhile_hit_rate_via_others": hit_rate(
            [(o.prompt_tokens, o.cached_tokens) for o in others]
        ),
    }
