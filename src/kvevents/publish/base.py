"""The publisher interface: what an engine calls, its lifecycle and counters, the null one.

:class:`EventPublisher` is SGLang's and vLLM's abstract publisher (``publish``,
``shutdown``), plus a context manager. :class:`NullEventPublisher` accepts the same
constructor arguments as any publisher and publishes nothing.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from kvevents.errors import ConfigError
from kvevents.wire.events import KVEventBatch

__all__ = [
    "EventPublisher",
    "NullEventPublisher",
    "PublisherState",
    "PublisherStats",
    "resolve_publisher_rank",
]


class PublisherState(enum.Enum):
    """Lifecycle: RUNNING (accepts batches) -> DRAINING (shutdown sending the rest) -> CLOSED."""

    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"


@dataclass(frozen=True)
class PublisherStats:
    """A snapshot of a publisher's counters."""

    published: int = 0
    """Batches sent on the live socket."""
    dropped: int = 0
    """Batches refused because the queue was full; each one is a sequence gap."""
    send_errors: int = 0
    """Sends that raised; the batch stays replayable."""
    encode_errors: int = 0
    """Batches that could not be encoded: skipped, each one a sequence gap (logged)."""
    replay_requests: int = 0
    replayed: int = 0
    """Batches sent in replay answers."""
    replay_truncated: int = 0
    """Replay answers cut short because the client stopped reading or left."""
    malformed_requests: int = 0
    """Replay requests that were not ``[b"", start_seq]``; answered with the end marker."""
    handoffs: int = 0
    """publish() calls that waited for the sender to empty a backlog of handoff_backlog."""
    queued: int = 0
    """Batches waiting (at snapshot time)."""
    unsent: int = 0
    """Accepted batches never sent: still queued when shutdown's deadline passed, or
    queued by a publish() that raced the shutdown (which then raised)."""
    curve_handshakes: int = 0
    """CURVE handshakes completed by subscribers (live and replay; 0 without CURVE)."""
    curve_refused: int = 0
    """CURVE handshakes refused: unknown subscriber key, wrong server key or no CURVE."""
    snapshots: int = 0
    """Snapshot requests answered with the rank's block set (0 with snapshots off)."""
    snapshots_unavailable: int = 0
    """Snapshot requests answered "unavailable": snapshots off, or the set not exact."""
    snapshot_blocks: int = 0
    """Blocks in the rank's block set now (ghosts included; 0 with snapshots off)."""


_Publisher = TypeVar("_Publisher", bound="EventPublisher")


class EventPublisher(abc.ABC):
    """What an engine calls: ``publish(batch)`` each step, ``shutdown()`` once."""

    @abc.abstractmethod
    def publish(self, events: KVEventBatch) -> None:
        """Hand over one step's batch; returns at once."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop publishing and release sockets; calling it again does nothing."""

    def __enter__(self: _Publisher) -> _Publisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


def resolve_publisher_rank(attn_dp_rank: int | None, data_parallel_rank: int | None) -> int:
    """The rank from SGLang's ``attn_dp_rank=`` or vLLM's ``data_parallel_rank=`` (0 if neither)."""
    if attn_dp_rank is not None and data_parallel_rank is not None:
        raise TypeError(
            "give the publisher rank once, as attn_dp_rank= (SGLang) or "
            "data_parallel_rank= (vLLM), not both"
        )
    rank = attn_dp_rank if attn_dp_rank is not None else data_parallel_rank
    if rank is None:
        return 0
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ConfigError(f"publisher rank {rank!r} must be an int >= 0")
    return rank


class NullEventPublisher(EventPublisher):
    """Publishes nothing; what ``{}`` or ``{"publisher": "null"}`` configures."""

    def __init__(
        self,
        attn_dp_rank: int | None = None,
        *args: Any,
        data_parallel_rank: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.rank = resolve_publisher_rank(attn_dp_rank, data_parallel_rank)
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self.snapshot_enabled = False

    @property
    def stats(self) -> PublisherStats:
        return PublisherStats()

    def publish(self, events: KVEventBatch) -> None:
        return None

    def shutdown(self) -> None:
        return None
