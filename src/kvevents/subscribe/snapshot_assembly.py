"""One snapshot answer, put together as its parts arrive on a stream's replay socket.

A publisher that advertises snapshots answers a snapshot request with parts, each a
batch of events of the rank's state, then an end frame announcing how many parts it
sent, all at the same seq (:mod:`kvevents.wire.frames`). :class:`SnapshotAssembly`
decodes each part as it comes; a part that does not decode is skipped and reported (the
socket loop counts it as malformed), and the snapshot is then incomplete:
:meth:`SnapshotAssembly.finish` gives the whole state as one batch only when every part
announced arrived whole, at the end frame's seq, and otherwise says what was wrong.
Nothing here touches sockets.
"""

from __future__ import annotations

from kvevents.errors import WireError
from kvevents.wire.codec import decode_batch
from kvevents.wire.events import Event, KVEventBatch
from kvevents.wire.frames import SnapshotReply

__all__ = ["SnapshotAssembly"]


class SnapshotAssembly:
    """The parts of one snapshot answer for rank ``dp_rank``, decoded in arrival order."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.events: list[Event] = []
        self.parts = 0
        self.ts = 0.0
        self._seq: int | None = None
        self._broken: str | None = None  # why the answer cannot be used whole

    def add(self, part: SnapshotReply) -> str | None:
        """Take one ``part`` frame; a reason when it was skipped (it does not decode)."""
        if self._seq is None:
            self._seq = part.seq
        elif part.seq != self._seq:
            reason = f"snapshot part at seq {part.seq} in an answer at seq {self._seq}"
            self._broken = self._broken or reason
            return reason
        try:
            batch = decode_batch(part.body)
        except WireError as exc:
            reason = f"snapshot part {self.parts + 1} could not be decoded: {exc}"
            self._broken = self._broken or reason
            return reason
        self.parts += 1
        self.ts = batch.ts
        self.events.extend(batch.events)
        return None

    def finish(self, end: SnapshotReply) -> KVEventBatch | str:
        """The whole state as one batch, or why the answer cannot be used."""
        if self._broken is not None:
            return self._broken
        if self._seq is not None and end.seq != self._seq:
            return f"snapshot end at seq {end.seq} closes parts at seq {self._seq}"
        announced = end.parts
        if announced != self.parts:
            return f"the snapshot announced {announced} parts, {self.parts} arrived"
        return KVEventBatch(ts=self.ts, events=self.events, data_parallel_rank=self.dp_rank)
