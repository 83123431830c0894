"""Two P/D bench clients run at once, each in a process of its own (``--pd-together``).

:func:`run_together` starts one process per client (:class:`~kvevents.bench.pd_load.Send`,
run by :func:`~kvevents.bench.pd_load.run_load`), waits until each is ready, starts them
at one instant and returns each one's figures, with its own CPU per request, its
process (``client_pid``) and the prefill legs it saw fail in this run
(``prefill_failures``, for a client that counts them).

Why processes: run on one event loop, the two clients are not equal. Answers that arrive
together are taken in the loop's order, and the requests that follow them leave in that
order, so one client's legs reach the engines' queues before the other's, round after
round, and the other's wait behind them: two identical clients sharing one loop differ
at the median by more than the relay adds. Each in its own process, the operating
system's scheduler serves both alike.

The processes are spawned (never forked from a process that runs threads), so a client
must be picklable; they inherit this thread's CPUs (``--pin-router`` places them).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from collections.abc import Callable, Mapping
from multiprocessing.synchronize import Event
from typing import Any

from kvevents.bench.pd_load import Send, run_load
from kvevents.errors import KVEventsError
from kvevents.http.serving import run_event_loop

__all__ = ["run_together"]

_START_S = 60.0
"""How long a client process may take to start (imports, its loop)."""


def run_together(
    sends: Mapping[str, Send],
    *,
    connections: int,
    duration: float,
    warmup: float,
    starting: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Each of ``sends`` run by a process of its own with ``connections`` requests in
    flight for ``warmup + duration`` seconds, all started at once (``starting`` is called
    just before, once every process is ready); each one's figures by name. KVEventsError
    naming the client when one fails or does not finish in time."""
    context = multiprocessing.get_context("spawn")
    go = context.Event()
    ready: multiprocessing.Queue[str] = context.Queue()
    done: multiprocessing.Queue[tuple[str, dict[str, Any] | None, str]] = context.Queue()
    processes = [
        context.Process(
            target=_client,
            args=(name, send, connections, duration, warmup, ready, go, done),
            name=f"pd-client-{name}",
            daemon=True,
        )
        for name, send in sends.items()
    ]
    for process in processes:
        process.start()
    try:
        for _ in processes:
            _get(ready, time.monotonic() + _START_S, "to start")
        if starting is not None:
            starting()
        go.set()
        deadline = time.monotonic() + warmup + duration + _START_S
        runs: dict[str, dict[str, Any]] = {}
        for _ in processes:
            name, run, error = _get(done, deadline, "to finish its run")
            if run is None:
                raise KVEventsError(f"the {name} client failed: {error}")
            runs[name] = run
        return runs
    finally:
        for process in processes:
            process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        for channel in (ready, done):
            channel.close()
            channel.join_thread()


def _get(channel: multiprocessing.Queue[Any], deadline: float, what: str) -> Any:
    try:
        return channel.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        raise KVEventsError(f"a P/D bench client process did not manage {what} in time") from None


def _client(
    name: str,
    send: Send,
    connections: int,
    duration: float,
    warmup: float,
    ready: multiprocessing.Queue[str],
    go: Event,
    done: multiprocessing.Queue[tuple[str, dict[str, Any] | None, str]],
) -> None:
    """A client process: say it is ready, wait for the start, run, hand the figures back."""
    failed_before = getattr(send, "prefill_failures", None)
    ready.put(name)
    if not go.wait(_START_S):
        done.put((name, None, "no start was given"))
        return
    try:
        run = run_event_loop(
            run_load(send, connections=connections, duration=duration, warmup=warmup)
        )
    except Exception as exc:  # handed to the parent, which names it in its error
        done.put((name, None, f"{type(exc).__name__}: {exc}"))
        return
    run["client_pid"] = os.getpid()
    if failed_before is not None:  # those of this run alone
        run["prefill_failures"] = send.prefill_failures - failed_before  # type: ignore[attr-defined]
    done.put((name, run, ""))
