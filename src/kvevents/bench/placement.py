"""CPU placement for a benchmark: the router on cores of its own, everything else on the rest.

In a deployment the router runs on a host or cores of its own. On a small benchmark
machine the load generator, the simulated engines and the router share every core, so
what a request spends through the router includes waiting for a core that the engines or
the client hold, and that wait swings from run to run. :meth:`Placement.split` divides
the CPUs this process may use into the router's (the highest-numbered ``router_cpus``)
and the rest, for the client and the engines; both paths of a comparison then run with
the same sets, and in the direct path the router's cores are simply idle.

A process inherits the CPU set of the thread that starts it, and its threads and
children inherit its own (an engine's rank processes, a router's workers), so a child is
placed by starting it from a thread pinned to its set (:func:`pinned`), with no tool
and no change to how children are started. :func:`cpus_of` reads a process tree's sets
back from ``/proc``, so a report states the placement that held, not the one asked for.
Linux only (``os.sched_setaffinity``); elsewhere :meth:`Placement.split` refuses.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from kvevents.errors import ConfigError

__all__ = ["Placement", "cpus_of", "pinned", "spans"]

_PROC = Path("/proc")


class Placement:
    """The router's CPUs and the client's and engines' CPUs, disjoint and non-empty."""

    __slots__ = ("others", "router")

    def __init__(self, router: frozenset[int], others: frozenset[int]) -> None:
        if not router or not others or router & others:
            raise ValueError(f"router CPUs {sorted(router)} and others {sorted(others)}")
        self.router = router
        self.others = others

    @classmethod
    def split(cls, router_cpus: int = 1, allowed: Iterable[int] | None = None) -> Placement:
        """The highest-numbered ``router_cpus`` of ``allowed`` (default: this process's
        CPUs) for the router, the rest for the others; ConfigError when they cannot be
        split (what to do said)."""
        if not hasattr(os, "sched_setaffinity"):
            raise ConfigError(
                "--pin-router needs os.sched_setaffinity (Linux): run without it here"
            )
        allowed = sorted(os.sched_getaffinity(0) if allowed is None else set(allowed))
        if len(allowed) <= router_cpus:
            raise ConfigError(
                f"--pin-router needs more than {router_cpus} CPU(s) to give the router "
                f"its own, and this process may use {spans(allowed)}: run without it"
            )
        return cls(frozenset(allowed[-router_cpus:]), frozenset(allowed[:-router_cpus]))

    def as_json(self) -> dict[str, list[int]]:
        return {"router_cpus": sorted(self.router), "client_and_engine_cpus": sorted(self.others)}


@contextlib.contextmanager
def pinned(cpus: frozenset[int]) -> Iterator[None]:
    """The calling thread runs on ``cpus`` (and what it starts inherits them) inside the
    block; its own set is restored after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def cpus_of(pid: int) -> list[int]:
    """Every CPU any thread of ``pid`` or of its descendants may run on, as now set
    (a process gone meanwhile is skipped)."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the name, in parentheses, may hold spaces: the parent's pid follows the last ")"
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        process = todo.pop()
        todo.extend(children.get(process, ()))
        with contextlib.suppress(OSError):
            for task in (_PROC / str(process) / "task").iterdir():
                with contextlib.suppress(OSError):
                    found |= os.sched_getaffinity(int(task.name))
    return sorted(found)


def spans(cpus: list[int] | frozenset[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"CPUs 0-2,5"`` (one CPU: ``"CPU 3"``)."""
    ordered = sorted(cpus)
    if not ordered:
        return "no CPU"
    runs: list[str] = []
    start = prev = ordered[0]
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return f"CPU{'s' if len(ordered) > 1 else ''} {','.join(runs)}"
