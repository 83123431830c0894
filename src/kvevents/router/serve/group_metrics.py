"""One ``/metrics`` for a group of router processes (``--workers N``).

The kernel hands each scrape to any one of the group's processes, and each keeps its own
counters, so a scrape answered by one process alone would show counters that go down
from one scrape to the next. Instead every process writes a snapshot of its registry to
the group's folder (every second, and whenever it answers a scrape), and the process
that answers a scrape renders the group's from the snapshots:

* counters of work each process does alone (the requests it routed and relayed, its
  lookups, predictions and tokens; :data:`SUMMED`) are summed over every snapshot,
  those of processes that have since died included, so a sum never goes down, across
  scrapes or a worker's restart;
* everything else (gauges, and the counters of events every process applies to its own
  index, which would count each event N times if summed) is shown per process, with
  ``process`` (its index in the group) and ``pid`` labels, for the processes alive now.
  A restarted worker has a new ``pid``, so no series goes down.

A snapshot is written whole to a temporary name and renamed, so a reader never sees
half of one. Every number the answering process shows is in its own snapshot by then,
so the next scrape, whichever process answers it, shows at least as much.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

__all__ = ["SUMMED", "GroupMetrics", "process_alive", "write_whole"]

SUMMED = frozenset(
    {
        "kvevents_router_requests",
        "kvevents_router_routes",
        "kvevents_router_lookups",
        "kvevents_router_matched_tokens",
        "kvevents_router_prompt_tokens",
        "kvevents_router_engine_cached_tokens",
        "kvevents_router_engine_prompt_tokens",
        "kvevents_router_predictions",
        "kvevents_router_predicted_entries",
        "kvevents_router_routes_decided_by_prediction",
        "kvevents_router_pd_requests",
        "kvevents_router_pd_prefill_skipped",
        "kvevents_router_pd_prefill_chosen",
        "kvevents_router_pd_legs_failed",
    }
)
"""Families each process counts for its own work only: the group's value is their sum."""

_SNAPSHOT_SUFFIX = ".metrics.json"


class GroupMetrics:
    """Snapshots of one process's registry in ``folder``, and the group's rendering.

    ``index``: the process's place in the group (its ``process`` label).
    """

    def __init__(self, registry: CollectorRegistry, folder: str | Path, index: int) -> None:
        self.registry = registry
        self.folder = Path(folder)
        self.index = index
        self.pid = os.getpid()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._path = self.folder / f"{index}-{self.pid}{_SNAPSHOT_SUFFIX}"

    def write(self) -> None:
        """Write this process's snapshot now (whole, under its final name by a rename)."""
        families = [
            {
                "name": m.name,
                "type": m.type,
                "help": m.documentation,
                "samples": [[s.name, s.labels, s.value] for s in m.samples],
            }
            for m in self.registry.collect()
        ]
        record = {"index": self.index, "pid": self.pid, "families": families}
        write_whole(self._path, json.dumps(record).encode())

    def render(self) -> bytes:
        """The group's metrics in Prometheus text format (this process's snapshot first)."""
        self.write()
        snapshots = list(self._read())
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Merged(snapshots))
        return generate_latest(registry)

    def _read(self) -> Iterable[dict[str, Any]]:
        for path in sorted(self.folder.glob("*" + _SNAPSHOT_SUFFIX)):
            with contextlib.suppress(OSError, ValueError):  # gone or mid-write elsewhere
                record = json.loads(path.read_text())
                if isinstance(record, dict) and isinstance(record.get("families"), list):
                    yield record


def write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole: to a name of this process's first, then renamed,
    so a reader in another process sees the previous file or this one, never half."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Merged(Collector):
    """The group's families from its processes' snapshots (see the module docstring)."""

    def __init__(self, snapshots: Sequence[dict[str, Any]]) -> None:
        self.snapshots = snapshots

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        alive = {int(s["pid"]): process_alive(int(s["pid"])) for s in self.snapshots}
        for snapshot in self.snapshots:
            process = {"process": str(snapshot["index"]), "pid": str(snapshot["pid"])}
            for family in snapshot["families"]:
                name = family["name"]
                summed = name in SUMMED
                if not summed and not alive[int(snapshot["pid"])]:
                    continue
                metric = merged.get(name)
                if metric is None:
                    metric = merged[name] = Metric(name, family["help"], family["type"])
                    sums[name] = {}
                for sample, labels, value in family["samples"]:
                    if summed:
                        key = (sample, tuple(sorted(labels.items())))
                        sums[name][key] = sums[name].get(key, 0.0) + value
                    else:
                        metric.add_sample(sample, {**labels, **process}, value)
        for name, metric in merged.items():
            for (sample, labels), value in sums[name].items():
                metric.add_sample(sample, dict(labels), value)
            yield metric
