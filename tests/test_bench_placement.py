"""The benchmark's CPU placement: the split, pinning a thread and what it starts, reading it back.

The read-back is checked on a real process tree (a child that starts a grandchild),
started from a thread pinned to one CPU, as the P/D benchmark starts its engines.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from kvevents.bench.placement import Placement, cpus_of, pinned, spans
from kvevents.errors import ConfigError

needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's"
)


@needs_affinity
def test_the_router_gets_the_highest_cpus_and_the_others_the_rest() -> None:
    """The split is disjoint: the router the highest-numbered CPUs, everything else the rest."""
    placement = Placement.split(allowed=[0, 1, 2, 5])
    assert placement.router == {5} and placement.others == {0, 1, 2}
    two = Placement.split(2, allowed=range(4))
    assert two.as_json() == {"router_cpus": [2, 3], "client_and_engine_cpus": [0, 1]}


@needs_affinity
def test_one_cpu_cannot_be_split() -> None:
    """With no CPU left for the others, the split is refused with what to do instead."""
    with pytest.raises(ConfigError, match=r"--pin-router needs more than 1 CPU.*CPU 3.*without"):
        Placement.split(allowed=[3])


def test_spans_name_cpu_ranges() -> None:
    """CPU sets are written as ranges, one CPU in the singular."""
    assert spans([0, 1, 2, 5, 7, 8]) == "CPUs 0-2,5,7-8"
    assert spans(frozenset({3})) == "CPU 3"
    assert spans([]) == "no CPU"


@needs_affinity
def test_pinned_sets_this_thread_and_restores_it() -> None:
    """Inside the block this thread runs on the given CPUs; after it, on its own set again."""
    before = os.sched_getaffinity(0)
    one = frozenset({min(before)})
    with pinned(one):
        assert os.sched_getaffinity(0) == one
    assert os.sched_getaffinity(0) == before


@needs_affinity
@pytest.mark.slow
def test_a_process_tree_started_while_pinned_reads_back_pinned() -> None:
    """A child started from a pinned thread, and the grandchild it starts, run on that
    thread's CPUs; cpus_of reads every thread of the tree, the grandchild's included."""
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    grandchild = "import time; time.sleep(30)"
    child = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    with pinned(frozenset({cpu})):
        proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    grandchild_pid = None
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20.0)
        assert ready, "the child did not start its grandchild within 20 s"
        grandchild_pid = int(proc.stdout.readline())
        assert cpus_of(proc.pid) == cpus_of(grandchild_pid) == [cpu]
        os.sched_setaffinity(grandchild_pid, allowed)
        assert cpus_of(proc.pid) == sorted(allowed)  # found through the grandchild
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        if grandchild_pid is not None:
            os.kill(grandchild_pid, signal.SIGKILL)
