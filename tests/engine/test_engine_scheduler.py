"""The per-rank scheduler: admission, decoding, one event batch per step, load figures."""

from __future__ import annotations

import math

import pytest

from kvevents import AllBlocksCleared, BlockStored, KVEventBatch
from kvevents.engine.cache import PrefixCache
from kvevents.engine.scheduler import QueueFullError, Scheduler


class RecordingPublisher:
    """Unit-test stand-in for a publisher: keeps every batch."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)


def make(rank: int = 2, **kw: float) -> tuple[Scheduler, RecordingPublisher]:
    pub = RecordingPublisher()
    sched = Scheduler(rank, PrefixCache(page_size=4, capacity=64), pub, clock=lambda: 123.0, **kw)  # type: ignore[arg-type]
    return sched, pub


def run_until_idle(sched: Scheduler, limit: int = 1000) -> list[object]:
    done = []
    for _ in range(limit):
        if not sched.has_work:
            return done
        done.extend(sched.step().finished)
    raise AssertionError("scheduler did not go idle")


def test_one_batch_per_step_tagged_with_rank() -> None:
    """Requests admitted in one step publish their stores as one batch carrying the rank and clock."""
    sched, pub = make()
    sched.submit("a", list(range(8)), 2)
    sched.submit("b", list(range(100, 112)), 2)
    result = sched.step()
    assert result.admitted == 2 and result.events == 2
    (batch,) = pub.batches
    assert batch.data_parallel_rank == 2 and batch.ts == 123.0
    assert [type(e) for e in batch.events] == [BlockStored, BlockStored]
    assert sched.step().finished and not pub.batches[1:]  # decode steps publish nothing


def test_completion_reports_prompt_cached_and_output_tokens() -> None:
    """A finished request reports its rank, prompt tokens, cached tokens and max_new_tokens outputs."""
    sched, _ = make()
    sched.submit(1, list(range(10)), 3)
    (first,) = run_until_idle(sched)
    sched.submit(2, [*range(9), 99], 0)
    (second,) = run_until_idle(sched)
    assert (first.dp_rank, first.prompt_tokens, first.cached_tokens) == (2, 10, 0)
    assert first.completion_tokens == 3
    assert (second.cached_tokens, second.completion_tokens) == (8, 0)
    load = sched.load()
    assert load["hit_rate"] == pytest.approx(8 / 20)
    assert (load["running"], load["waiting"], load["blocks_used"], load["blocks_total"]) == (
        0,
        0,
        2,
        64,
    )


def test_simulated_duration_follows_configured_speeds() -> None:
    """A step lasts uncached tokens / prefill speed, plus one decode step when anything decoded."""
    sched, _ = make(prefill_tokens_per_s=1000.0, decode_steps_per_s=10.0)
    sched.submit("a", list(range(20)), 2)
    assert sched.step().duration_s == pytest.approx(0.02)
    assert sched.step().duration_s == pytest.approx(0.1)
    fast, _ = make(prefill_tokens_per_s=math.inf, decode_steps_per_s=math.inf)
    fast.submit("a", list(range(20)), 5)
    assert all(fast.step().duration_s == 0.0 for _ in range(5))


def test_running_batch_and_queue_are_bounded() -> None:
    """At most max_running requests run at once, and submit beyond max_waiting raises QueueFullError."""
    pub = RecordingPublisher()
    sched = Scheduler(0, PrefixCache(4, 64), pub, max_running=2, max_waiting=3)
    for i in range(3):
        sched.submit(i, [i] * 4, 5)
    with pytest.raises(QueueFullError, match="max_waiting=3"):
        sched.submit(9, [9], 1)
    sched.step()
    assert (sched.load()["running"], sched.load()["waiting"]) == (2, 1)


def test_flush_publishes_all_blocks_cleared_at_once() -> None:
    """flush() empties the cache and publishes AllBlocksCleared in its own batch immediately."""
    sched, pub = make()
    sched.submit("a", list(range(8)), 1)
    run_until_idle(sched)
    assert sched.flush() == 1
    assert isinstance(pub.batches[-1].events[0], AllBlocksCleared)
    assert sched.load()["blocks_used"] == 0


def test_bad_speeds_are_refused() -> None:
    """Non-positive speeds or limits are refused naming the parameter."""
    with pytest.raises(ValueError, match="decode_steps_per_s=0"):
        Scheduler(0, PrefixCache(4, 4), RecordingPublisher(), decode_steps_per_s=0)
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        make()[0].submit("x", [1], -1)
