"""One readiness for a group of router processes (``--workers N``).

The kernel hands each connection, a readiness probe's too, to any one of the group's
processes, and each follows the engines' streams on its own, so one process can be
ready while another (just started, or restarted) still waits for its streams. A probe
answered by one process alone would say the group is ready while half its requests go
to a process that routes blind. Instead every process writes its own readiness to the
group's folder whenever it changes (:meth:`GroupReadiness.publish`, whole, by a rename),
and the process answering ``/ready`` adds the others' (:meth:`GroupReadiness.others`):
the group is ready when every running process is. A process that is not running (it
died, and the group starts it again) takes no connections, so it holds nothing back;
the one started in its place says it is starting until it is ready.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import msgspec

from kvevents.router.serve.group_metrics import process_alive, write_whole

__all__ = ["GroupReadiness", "ProcessReadiness"]

_SUFFIX = ".ready.json"


class ProcessReadiness(msgspec.Struct):
    """One process's readiness as it last wrote it."""

    index: int
    """Its place in the group."""
    pid: int
    ok: bool
    reasons: list[str]
    routable: int
    holders: int


class GroupReadiness:
    """This process's readiness file in ``folder`` and its siblings' (``count`` in all)."""

    def __init__(self, folder: str | Path, index: int, count: int) -> None:
        self.folder = Path(folder)
        self.index = index
        self.count = count
        self.pid = os.getpid()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._written: ProcessReadiness | None = None
        self.publish(False, ["starting: its streams are not followed yet"], 0, 0)

    def _path(self, index: int) -> Path:
        return self.folder / f"{index}{_SUFFIX}"

    def publish(self, ok: bool, reasons: list[str], routable: int, holders: int) -> None:
        """Write this process's readiness, unless it is what was written last."""
        state = ProcessReadiness(self.index, self.pid, ok, list(reasons), routable, holders)
        if state == self._written:
            return
        try:
            write_whole(self._path(self.index), msgspec.json.encode(state))
        except OSError:  # the folder is gone: the group is stopping
            return
        self._written = state

    def others(self) -> dict[int, ProcessReadiness | None]:
        """The other processes' readiness by index: None for one that has written none yet
        (it is starting); a process no longer running is left out."""
        found: dict[int, ProcessReadiness | None] = {}
        for index in range(self.count):
            if index == self.index:
                continue
            state: ProcessReadiness | None = None
            with contextlib.suppress(OSError, msgspec.DecodeError):  # not written yet
                state = msgspec.json.decode(self._path(index).read_bytes(), type=ProcessReadiness)
            if state is not None and not process_alive(state.pid):
                continue
            found[index] = state
        return found
