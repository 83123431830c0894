"""One ``/metrics`` per router group: any process's scrape shows the whole group's counters,
which never go down, across scrapes and across a worker's restart.

The merge itself is checked in process on hand-made snapshots; the group on real
processes: a `kvevents engine` and `kvevents router --workers 2`, each scrape on a new
connection so that the kernel spreads them over the workers.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from router_support import Engine, RouterProc, wait_until

from kvevents.router.serve.group_metrics import GroupMetrics


class _Fixed(Collector):
    def __init__(self, routed: float, entries: float) -> None:
        self.routed, self.entries = routed, entries

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        routes = CounterMetricFamily("kvevents_router_routes", "routed", labels=["worker"])
        routes.add_metric(["http://e:1"], self.routed)
        yield routes
        yield GaugeMetricFamily("kvevents_router_index_entries", "entries", value=self.entries)


def _registry(routed: float, entries: float) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(routed, entries))
    return registry


def _value(text: str, sample: str) -> list[tuple[str, float]]:
    return [
        (m.group(1), float(m.group(2)))
        for m in re.finditer(rf"^{sample}(\{{[^}}]*\}})? (\S+)$", text, flags=re.M)
    ]


def test_counters_of_own_work_are_summed_and_the_rest_shown_per_process(tmp_path: Path) -> None:
    """Two processes' snapshots: their routes are summed, their index gauges are one series
    each, labelled with the process and its pid."""
    other = GroupMetrics(_registry(routed=5, entries=10), tmp_path, index=1)
    other.write()
    text = GroupMetrics(_registry(routed=7, entries=11), tmp_path, index=0).render().decode()
    assert _value(text, "kvevents_router_routes_total") == [('{worker="http://e:1"}', 12.0)]
    gauges = dict(_value(text, "kvevents_router_index_entries"))
    assert len(gauges) == 2 and sorted(gauges.values()) == [10.0, 11.0]
    assert all(f'pid="{os.getpid()}"' in labels for labels in gauges)


def test_a_dead_process_keeps_its_counts_in_the_sums_and_leaves_the_gauges(
    tmp_path: Path,
) -> None:
    """A snapshot whose process is gone still counts in a sum (so it never goes down), and
    its per-process series are no longer shown."""
    dead = 2**22 + 12345  # above the kernel's default pid_max: no such process
    record = {
        "index": 1,
        "pid": dead,
        "families": [
            {
                "name": "kvevents_router_routes",
                "type": "counter",
                "help": "routed",
                "samples": [["kvevents_router_routes_total", {"worker": "http://e:1"}, 4]],
            },
            {
                "name": "kvevents_router_index_entries",
                "type": "gauge",
                "help": "entries",
                "samples": [["kvevents_router_index_entries", {}, 99]],
            },
        ],
    }
    (tmp_path / f"1-{dead}.metrics.json").write_text(json.dumps(record))
    (tmp_path / "0-1.metrics.json").write_text("{half a snapshot")  # unreadable: skipped
    text = GroupMetrics(_registry(routed=1, entries=3), tmp_path, index=1).render().decode()
    assert _value(text, "kvevents_router_routes_total") == [('{worker="http://e:1"}', 5.0)]
    assert [v for _, v in _value(text, "kvevents_router_index_entries")] == [3.0]


def _scrape(url: str) -> tuple[float, int]:
    """The group's routed requests and the answering process's pid, on a new connection."""
    with httpx.Client(base_url=url, timeout=10.0) as fresh:
        text = fresh.get("/metrics").text
        pid = fresh.get("/workers").json()["process"]["pid"]
    return sum(v for _, v in _value(text, "kvevents_router_lookups_total")), pid


@pytest.mark.slow
def test_eight_scrapes_of_a_two_process_router_never_go_down(engine: Engine) -> None:
    """Requests spread over two workers, then scrapes on new connections: each shows the
    group's count, whichever process answers, and none is lower than the one before; a
    worker killed and replaced takes nothing away."""
    proc = RouterProc([engine.url], "--workers", "2")
    try:
        wait_until(lambda: proc.connected() >= 2, 30, "the streams")
        routed = 0
        for i in range(24):
            with httpx.Client(base_url=proc.url, timeout=10.0) as fresh:
                answer = fresh.post("/route", json={"input_ids": list(range(i, i + 16))})
            if answer.status_code == 200:
                routed += 1
        assert routed > 0
        # each worker's snapshot is at most a second old: soon every scrape shows them all
        wait_until(lambda: _scrape(proc.url)[0] >= routed, 10, "the group's count")
        seen: list[float] = []
        pids: set[int] = set()
        for _ in range(8):
            count, pid = _scrape(proc.url)
            seen.append(count)
            pids.add(pid)
        assert seen == sorted(seen), seen
        assert seen[0] >= routed, (seen, routed)
        victim = next(iter(pids))
        os.kill(victim, signal.SIGKILL)
        after: list[float] = []
        wait_until(lambda: after.append(_scrape(proc.url)[0]) or len(after) >= 8, 30, "scrapes")
        assert after == sorted(after) and after[0] >= seen[-1], (seen, after)
    finally:
        proc.stop()
