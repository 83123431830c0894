"""One data-parallel rank's scheduler: a request queue stepping at a simulated speed.

Each :meth:`Scheduler.step` does what an engine's scheduler loop does once:

1. admit waiting requests (FIFO) while fewer than ``max_running`` run: the prefix cache
   matches, pins and inserts their prompt pages; the step prefills the uncached tokens
   and emits each admitted request's first output token;
2. every request admitted in an earlier step decodes one token; those that reached
   ``max_new_tokens`` finish and unpin their pages;
3. the step's cache events, if any, leave as **one** ``KVEventBatch`` through the rank's
   publisher (any object with ``publish(batch)``).

The step returns how long it would take on the simulated hardware
(``uncached prompt tokens / prefill_tokens_per_s``, plus ``1 / decode_steps_per_s`` when
anything decoded); the caller waits that long before the next step, and ``inf`` speeds
mean no waiting. The scheduler itself never sleeps and reads no clock except ``clock``
(wall time for batch timestamps), so tests drive it step by step.

Only prompt pages are cached: simulated output tokens are not the text a real model
would produce, so caching them would only invent reuse that a trace does not have.

A disaggregated decode submits its request with ``received_blocks``: the leading full
blocks whose KV a prefill engine sent. Admission stores them like any prompt page (one
``BlockStored`` for those the cache lacked) but they are not prefilled here: the
request's cached tokens are the larger of its own cache hit and the received blocks it
reuses: at most every block but a block-aligned prompt's last
(:mod:`kvevents.index.reusable`), which is what a real vLLM decode reports of KV a
connector moved in whole blocks (``ExampleConnector``); transfers that hand over more
of the last block report up to a block more. The simulation keeps the one rule its
router and prefix cache share.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvevents.engine.cache import Admission, CacheEvent, PrefixCache
from kvevents.errors import KVEventsError
from kvevents.index.reusable import reusable_blocks
from kvevents.wire.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.wire.hashing import tokens_to_array

__all__ = ["BatchPublisher", "Completion", "QueueFullError", "Scheduler", "StepResult"]

_OUTPUT_ALPHABET = b"abcdefghijklmnopqrstuvwxyz "


class BatchPublisher(Protocol):
    """What the scheduler needs from a publisher."""

    def publish(self, batch: KVEventBatch) -> Any: ...


class QueueFullError(KVEventsError, RuntimeError):
    """The rank's waiting queue is at ``max_waiting``; the client should retry later."""


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request."""

    request_id: Any
    dp_rank: int
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens not prefilled: found in the cache, or received from a prefill engine."""
    output_ids: list[int]

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


@dataclass(slots=True)
class _Request:
    request_id: Any
    tokens: Sequence[int]
    max_new_tokens: int
    generated: int = 0
    admission: Admission | None = None
    keys: dict[str, Any] = field(default_factory=dict)
    """``cache_salt`` / ``extra_keys`` / ``lora_name`` / ``lora_id`` for
    :meth:`PrefixCache.admit`, when given."""
    received_blocks: int = 0
    """Leading full blocks whose KV came from a prefill engine (not prefilled here)."""
    reused_tokens: int = 0
    """Prompt tokens not prefilled here: the cache hit or the received blocks, the larger."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step did: its simulated duration, finished requests, events published."""

    duration_s: float
    finished: list[Completion] = field(default_factory=list)
    events: int = 0
    admitted: int = 0


class Scheduler:
    """The scheduler of data-parallel rank ``dp_rank`` (see the module docstring).

    ``prefill_tokens_per_s`` and ``decode_steps_per_s`` set the simulated speed (``inf``:
    as fast as the host runs). ``max_running`` caps the running batch, ``max_waiting``
    the queue (:meth:`submit` raises :class:`QueueFullError` beyond it).
    """

    def __init__(
        self,
        dp_rank: int,
        cache: PrefixCache,
        publisher: BatchPublisher,
        *,
        prefill_tokens_per_s: float = 1_000_000.0,
        decode_steps_per_s: float = 1_000.0,
        max_running: int = 64,
        max_waiting: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        for name, value in (
            ("prefill_tokens_per_s", prefill_tokens_per_s),
            ("decode_steps_per_s", decode_steps_per_s),
        ):
            if not value > 0:
                raise ValueError(f"Scheduler: {name}={value!r} must be > 0 (inf: no waiting)")
        if max_running < 1 or max_waiting < 1:
            raise ValueError(
                f"Scheduler: max_running={max_running} and max_waiting={max_waiting} must be >= 1"
            )
        self.dp_rank = dp_rank
        self.cache = cache
        self.publisher = publisher
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.decode_steps_per_s = decode_steps_per_s
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._clock = clock
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self.steps = 0
        self.batches_published = 0
        self.events_published = 0
        self.blocks_stored = 0
        self.blocks_removed = 0
        self.requests_finished = 0

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def submit(
        self,
        request_id: Any,
        token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        cache_salt: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        lora_name: str | None = None,
        lora_id: int | None = None,
        received_blocks: int = 0,
    ) -> None:
        """Queue a request; it is admitted by a later :meth:`step`.

        ``cache_salt`` and ``extra_keys`` (per block) name its blocks as vLLM's do, and
        ``lora_name`` runs it under that adapter (:meth:`PrefixCache.admit`).
        ``received_blocks``: leading full blocks a prefill engine sent (module docstring).
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        if received_blocks < 0:
            raise ValueError(f"received_blocks={received_blocks} must be >= 0")
        if len(self._waiting) >= self.max_waiting:
            raise QueueFullError(
                f"dp_rank {self.dp_rank}: {len(self._waiting)} requests waiting "
                f"(max_waiting={self.max_waiting}); retry later"
            )
        req = _Request(
            request_id, tokens_to_array(token_ids), max_new_tokens, received_blocks=received_blocks
        )
        given = {
            "cache_salt": cache_salt,
            "extra_keys": extra_keys,
            "lora_name": lora_name,
            "lora_id": lora_id,
        }
        req.keys = {k: v for k, v in given.items() if v is not None}
        self._waiting.append(req)

    def step(self) -> StepResult:
        """Run one scheduler step (see the module docstring)."""
        self.steps += 1
        finished: list[_Request] = []
        still_running: list[_Request] = []
        decoded = bool(self._running)
        for req in self._running:
            req.generated += 1
            (finished if req.generated >= req.max_new_tokens else still_running).append(req)
        prefill_tokens = 0
        admitted = 0
        while (
            self._waiting and len(still_running) < self.max_running and admitted < self.max_running
        ):
            req = self._waiting.popleft()
            req.admission = admission = self.cache.admit(req.tokens, **req.keys)
            page = self.cache.page_size
            received = min(req.received_blocks, reusable_blocks(admission.prompt_tokens, page))
            received *= page
            req.reused_tokens = max(admission.cached_tokens, received)
            prefill_tokens += admission.prompt_tokens - req.reused_tokens
            admitted += 1
            if req.max_new_tokens > 0:
                req.generated = 1
            (finished if req.generated >= req.max_new_tokens else still_running).append(req)
        self._running = still_running
        for req in finished:
            assert req.admission is not None
            self.cache.release(req.admission)
        events = self._publish(self.cache.take_events())
        duration = prefill_tokens / self.prefill_tokens_per_s
        if decoded:
            duration += 1.0 / self.decode_steps_per_s
        self.requests_finished += len(finished)
        return StepResult(
            duration_s=duration,
            finished=[self._completion(r) for r in finished],
            events=events,
            admitted=admitted,
        )

    def flush(self) -> int:
        """Flush the cache now and publish ``AllBlocksCleared`` in its own batch; returns events."""
        self.cache.flush()
        return self._publish(self.cache.take_events())

    def load(self) -> dict[str, Any]:
        """Load figures: requests running and waiting, blocks used and total, hit rate."""
        stats = self.cache.stats
        return {
            "dp_rank": self.dp_rank,
            "running": len(self._running),
            "waiting": len(self._waiting),
            "blocks_used": len(self.cache),
            "blocks_pinned": self.cache.pinned,
            "blocks_total": self.cache.capacity,
            "hit_rate": stats.hit_rate,
            "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens,
            "requests_finished": self.requests_finished,
            "batches_published": self.batches_published,
            "events_published": self.events_published,
            "blocks_stored": self.blocks_stored,
            "blocks_removed": self.blocks_removed,
        }

    def _publish(self, events: list[CacheEvent]) -> int:
        if not events:
            return 0
        for event in events:
            if isinstance(event, BlockStored):
                self.blocks_stored += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.blocks_removed += len(event.block_hashes)
        batch = KVEventBatch(ts=self._clock(), events=events, data_parallel_rank=self.dp_rank)
        self.publisher.publish(batch)
        self.batches_published += 1
        self.events_published += len(events)
        return len(events)

    def _completion(self, req: _Request) -> Completion:
        assert req.admission is not None
        repeats = req.generated // len(_OUTPUT_ALPHABET) + 1
        output = list((_OUTPUT_ALPHABET * repeats)[: req.generated])
        return Completion(
            req.request_id,
            self.dp_rank,
            req.admission.prompt_tokens,
            req.reused_tokens,
            output,
        )
