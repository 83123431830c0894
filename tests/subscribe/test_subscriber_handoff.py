"""The handoff between the subscriber's socket thread and its consumer."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvevents.subscribe.handoff import Handoff, HandoffClosed


def test_items_come_out_in_order_across_chunks() -> None:
    """Items put as chunks come out one by one in the order they were put."""
    h: Handoff[int] = Handoff()
    h.put([1, 2, 3])
    h.put([4])
    assert [h.get(timeout=1) for _ in range(4)] == [1, 2, 3, 4]
    assert h.get(timeout=0.01) is None
    assert h.get_nowait() == (False, None)


def test_full_handoff_makes_the_producer_wait_until_the_consumer_takes() -> None:
    """A producer putting into a full handoff waits, and proceeds once the consumer takes an item."""
    h: Handoff[int] = Handoff(max_items=2)
    h.put([1, 2])
    done = threading.Event()

    def produce() -> None:
        h.put([3])
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    assert not done.wait(0.2)
    assert h.get(timeout=1) == 1
    assert done.wait(5)
    t.join(5)
    assert [h.get(timeout=1), h.get(timeout=1)] == [2, 3]


def test_close_wakes_consumer_and_producer_and_carries_the_error() -> None:
    """close(error) wakes a waiting consumer, which raises HandoffClosed carrying the error; put then returns False."""
    h: Handoff[int] = Handoff()
    raised: list[BaseException] = []

    def consume() -> None:
        try:
            h.get()
        except HandoffClosed as exc:
            raised.append(exc)

    t = threading.Thread(target=consume)
    t.start()
    boom = RuntimeError("boom")
    h.close(boom)
    t.join(5)
    assert not t.is_alive()
    assert isinstance(raised[0], HandoffClosed) and raised[0].error is boom
    assert h.put([1]) is False
    with pytest.raises(HandoffClosed):
        h.get_nowait()


def test_async_get_is_woken_from_another_thread_and_cancellation_loses_nothing() -> None:
    """aget() wakes when another thread puts; an aget cancelled while waiting does not swallow the next item."""
    h: Handoff[int] = Handoff()

    async def main() -> list[int | None]:
        waiter = asyncio.create_task(h.aget())
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        threading.Timer(0.05, h.put, args=([7, 8],)).start()
        first = await h.aget(timeout=5)
        second = await h.aget(timeout=5)
        third = await h.aget(timeout=0.05)
        return [first, second, third]

    assert asyncio.run(main()) == [7, 8, None]


def test_async_waits_make_no_task_and_a_timeout_keeps_the_next_item() -> None:
    """A waiting aget() is a future and a timer, not a task of its own (a router waits once
    per batch it follows); after it times out, an item put later goes to the next aget()."""
    h: Handoff[int] = Handoff()

    async def main() -> tuple[int, int | None, int | None, int | None]:
        waiter = asyncio.create_task(h.aget(timeout=5))
        await asyncio.sleep(0.05)
        tasks_while_waiting = len(asyncio.all_tasks())  # main and the waiter only
        threading.Timer(0.02, h.put, args=([3],)).start()
        got = await waiter
        timed_out = await h.aget(timeout=0.05)
        h.put([4])
        return tasks_while_waiting, got, timed_out, await h.aget(timeout=1)

    assert asyncio.run(main()) == (2, 3, None, 4)
