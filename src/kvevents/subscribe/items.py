"""What a :class:`~kvevents.subscribe.subscriber.Subscriber` yields: batches and signals.

Every item is either a :class:`Delivery` ``(holder, seq, batch)`` or a :class:`Signal`.
A holder is one independent KV cache: ``Holder(worker, dp_rank)``, where ``worker`` is
the engine URL (or a name given to an explicit endpoint) and ``dp_rank`` the rank whose
stream it is.

Signals, per stream, in the order they happened relative to that stream's batches:

* :class:`Gap` -- sequence numbers ``first_seq..last_seq`` did not arrive live; a replay
  was requested. Informational: the missing batches follow (as ordinary deliveries),
  and whatever replay cannot supply is reported as a :class:`Loss`.
* :class:`Loss` -- ``first_seq..last_seq`` will never be delivered (no replay endpoint,
  the publisher's buffer no longer holds them, the publisher dropped them, replay timed
  out, or a payload could not be decoded). The consumer's view of that holder may now be
  incomplete; it decides whether to keep or drop it.
* :class:`Reset` -- the stream restarted (its engine restarted: the sequence went back,
  or the publisher's replay buffer proved it forgot what we saw). The consumer must drop
  everything it holds for that holder; the new stream follows from its seq 0.
* :class:`Resync` -- a :class:`Reset` whose new state comes whole: replay could not fill
  a gap (the publisher's buffer wrapped, or the subscriber joined late), and the
  publisher, which advertises snapshots, sent the rank's whole block set instead. The
  consumer drops the holder's state as for a reset; the next item of that holder is one
  :class:`Delivery` at seq ``new_seq`` whose batch (``AllBlocksCleared`` then the stores)
  rebuilds it, and the stream continues from ``new_seq + 1``. No :class:`Loss`.
* :class:`Unreachable` -- an engine's ``/server_info`` or a stream's endpoint cannot be
  reached yet; retries continue with backoff. Sent once per failure streak.
* :class:`Malformed` -- frames of a stream were skipped: a wrong frame layout, or a seq
  that cannot be real (see :mod:`kvevents.subscribe.stream`). Informational: the stream
  goes on; at most one per stream per read of its socket, with the count skipped.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import msgspec

from kvevents.types import Holder
from kvevents.wire.events import KVEventBatch

__all__ = [
    "Delivery",
    "Gap",
    "Item",
    "Loss",
    "Malformed",
    "Removed",
    "Reset",
    "Resync",
    "Signal",
    "Unreachable",
]


class Delivery(NamedTuple):
    """One batch, delivered in sequence order for its holder (live or replayed)."""

    holder: Holder
    seq: int
    batch: KVEventBatch


class Signal(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every signal; ``kind`` names it ("gap", "loss", "reset", "resync",
    "unreachable", "malformed", "removed").

    ``dp_rank`` is None only for an :class:`Unreachable` engine whose ranks are not
    known yet.
    """

    kind: ClassVar[str] = "signal"
    worker: str
    dp_rank: int | None

    @property
    def holder(self) -> Holder | None:
        """The holder this signal is about, or None for a whole engine."""
        return None if self.dp_rank is None else Holder(self.worker, self.dp_rank)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"signal": kind, "worker", "dp_rank", ...fields}``."""
        out: dict[str, Any] = {"signal": self.kind}
        out.update(msgspec.structs.asdict(self))
        return out


class Gap(Signal, frozen=True, kw_only=True):
    """``first_seq..last_seq`` (inclusive) were missed live; a replay from ``first_seq`` was asked."""

    kind: ClassVar[str] = "gap"
    first_seq: int
    last_seq: int


class Loss(Signal, frozen=True, kw_only=True):
    """``first_seq..last_seq`` (inclusive) will never be delivered; ``reason`` says why."""

    kind: ClassVar[str] = "loss"
    first_seq: int
    last_seq: int
    reason: str

    @property
    def count(self) -> int:
        return self.last_seq - self.first_seq + 1


class Reset(Signal, frozen=True, kw_only=True):
    """The stream restarted: drop the holder's state. ``last_seq`` was the last seq seen
    from the old stream, ``new_seq`` the first seen from the new one (None if only the
    replay buffer showed it)."""

    kind: ClassVar[str] = "reset"
    last_seq: int
    new_seq: int | None
    reason: str


class Resync(Reset, frozen=True, kw_only=True):
    """The holder's state is replaced by its publisher's snapshot at ``new_seq``: drop it
    (as for a :class:`Reset`); the :class:`Delivery` that follows (seq ``new_seq``)
    carries the whole block set. ``last_seq`` was the last seq delivered before."""

    kind: ClassVar[str] = "resync"


class Unreachable(Signal, frozen=True, kw_only=True):
    """``address`` (an engine URL or a stream endpoint) cannot be reached; retrying."""

    kind: ClassVar[str] = "unreachable"
    address: str
    reason: str


class Removed(Signal, frozen=True, kw_only=True):
    """The engine no longer has this rank (it restarted with fewer): its stream is no
    longer followed, and whatever it held is gone. ``reason`` says how it was found."""

    kind: ClassVar[str] = "removed"
    reason: str


class Malformed(Signal, frozen=True, kw_only=True):
    """``count`` frames from the ``source`` socket ("live" or "replay") were skipped;
    ``reason`` describes the first of them."""

    kind: ClassVar[str] = "malformed"
    source: str
    count: int
    reason: str


Item = Delivery | Signal
"""What :meth:`~kvevents.Subscriber.get` returns: a batch or a signal."""
