"""One timer for many deadlines: each item expires at its own deadline, once, unless
forgotten first."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from kvevents.http.deadlines import Deadlines

LOOPS: dict[str, Callable[[Coroutine[Any, Any, Any]], Any]] = {
    "asyncio": asyncio.run,
    "uvloop": uvloop.run,
}


async def _expiring(deadlines: dict[str, float], forget: set[str]) -> dict[str, float]:
    """Watch each item at now + its delay, forget those named; when each expired (loop time)."""
    loop = asyncio.get_running_loop()
    expired: dict[str, float] = {}
    watched: Deadlines[str] = Deadlines(lambda item: expired.setdefault(item, loop.time()))
    start = loop.time()
    for item, delay in deadlines.items():
        watched.watch(item, start + delay, loop)
    for item in forget:
        watched.forget(item)
    await asyncio.sleep(max(deadlines.values()) + 0.1)
    assert len(watched) == 0
    return {item: at - start for item, at in expired.items()}


@pytest.mark.slow
@pytest.mark.parametrize("order", [("a", "b", "c"), ("c", "b", "a"), ("b", "c", "a")])
def test_each_item_expires_at_its_own_deadline_in_any_order_of_watching(
    order: tuple[str, ...],
) -> None:
    """Deadlines watched latest first or earliest first: each expires at (not before, nor
    long after) its own; the timer is moved earlier when an earlier one comes."""
    delays = {"a": 0.05, "b": 0.15, "c": 0.25}
    expired = asyncio.run(_expiring({item: delays[item] for item in order}, set()))
    assert set(expired) == {"a", "b", "c"}
    for item, at in expired.items():
        assert delays[item] - 0.002 <= at < delays[item] + 0.08, (item, at)


def test_a_forgotten_item_never_expires_and_the_others_still_do() -> None:
    """The earliest item ended in time: the timer set for it finds nothing due, and is set
    again for the next one."""
    expired = asyncio.run(_expiring({"a": 0.03, "b": 0.1, "c": 0.12}, {"a", "c"}))
    assert set(expired) == {"b"}


def test_an_expiry_that_ends_another_item_expires_that_one_no_more() -> None:
    """Expiring one closes a second that was due at the same time (forgetting it): the
    second is not expired after it was forgotten."""

    async def run() -> list[str]:
        loop = asyncio.get_running_loop()
        calls: list[str] = []

        def expire(item: str) -> None:
            calls.append(item)
            watched.forget("a" if item == "b" else "b")

        watched: Deadlines[str] = Deadlines(expire)
        at = loop.time() + 0.02
        watched.watch("a", at, loop)
        watched.watch("b", at, loop)
        await asyncio.sleep(0.1)
        return calls

    assert len(asyncio.run(run())) == 1


def test_watching_again_moves_an_items_deadline() -> None:
    async def run() -> float:
        loop = asyncio.get_running_loop()
        expired: list[float] = []
        watched: Deadlines[str] = Deadlines(lambda item: expired.append(loop.time()))
        start = loop.time()
        watched.watch("a", start + 0.02, loop)
        watched.watch("a", start + 0.12, loop)
        await asyncio.sleep(0.2)
        assert len(expired) == 1
        return expired[0] - start

    assert asyncio.run(run()) >= 0.118


def test_an_expiry_that_raises_is_reported_and_the_others_still_expire() -> None:
    """One item's expiry fails: the loop's exception handler hears of it, the other items
    due with it expire, and one due later still expires at its own deadline."""

    async def run() -> tuple[list[str], list[dict[str, Any]], int]:
        loop = asyncio.get_running_loop()
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _, context: reported.append(context))
        expired: list[str] = []

        def expire(item: str) -> None:
            if item == "bad":
                raise RuntimeError("a failing expiry")
            expired.append(item)

        watched: Deadlines[str] = Deadlines(expire)
        start = loop.time()
        for item, delay in (("bad", 0.02), ("a", 0.02), ("b", 0.02), ("later", 0.1)):
            watched.watch(item, start + delay, loop)
        await asyncio.sleep(0.2)
        return expired, reported, len(watched)

    expired, reported, left = asyncio.run(run())
    assert expired == ["a", "b", "later"] and left == 0
    assert len(reported) == 1 and isinstance(reported[0]["exception"], RuntimeError)


@pytest.mark.slow
def test_an_expiry_that_watches_an_item_leaves_the_earlier_ones_on_time() -> None:
    """An expiry watches a new item due much later: an item due between them still
    expires at its own deadline, not with the new one."""

    async def run() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        at: dict[str, float] = {}

        def expire(item: str) -> None:
            at[item] = loop.time() - start
            if item == "first":
                watched.watch("far", loop.time() + 0.4, loop)

        watched: Deadlines[str] = Deadlines(expire)
        watched.watch("first", start + 0.02, loop)
        watched.watch("between", start + 0.1, loop)
        await asyncio.sleep(0.6)
        return at

    at = asyncio.run(run())
    assert set(at) == {"first", "between", "far"}
    assert at["between"] < 0.2 and at["far"] >= 0.4


@pytest.mark.slow
@pytest.mark.parametrize("run", LOOPS.values(), ids=LOOPS.keys())
def test_a_timer_fires_about_once_per_deadline_on_either_loop(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    """uvloop's clock is in milliseconds and its timers may fire just before a deadline:
    that counts as due, so the one timer does not fire again and again until then. Every
    item expires, none before its deadline less that resolution."""

    async def go() -> tuple[int, list[float]]:
        loop = asyncio.get_running_loop()
        fired = 0
        early: list[float] = []
        deadline_of: dict[int, float] = {}

        def expire(item: int) -> None:
            early.append(deadline_of[item] - loop.time())

        watched: Deadlines[int] = Deadlines(expire)
        real_fire = watched._fire

        def counting(at_loop: asyncio.AbstractEventLoop) -> None:
            nonlocal fired
            fired += 1
            real_fire(at_loop)

        watched._fire = counting  # type: ignore[method-assign]
        start = loop.time()
        for i in range(20):  # one timeout: deadlines in order, 13 ms apart
            deadline_of[i] = start + 0.05 + i * 0.013
            watched.watch(i, deadline_of[i], loop)
        await asyncio.sleep(0.5)
        assert len(watched) == 0
        return fired, early

    fired, early = run(go())
    assert len(early) == 20
    assert max(early) <= 0.0011  # never more than the clock's resolution ahead
    assert fired <= 2 * 20, f"{fired} firings for 20 deadlines"


def test_items_of_a_loop_that_ended_are_dropped_and_a_new_loop_is_served() -> None:
    """An item left watched when its loop ended is never expired in the next loop (its
    connection belonged to the old one); the next loop's items expire on its own timer."""
    expired: list[str] = []
    watched: Deadlines[str] = Deadlines(expired.append)

    async def leave() -> None:
        loop = asyncio.get_running_loop()
        watched.watch("old", loop.time() + 0.05, loop)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        watched.watch("new", loop.time() + 0.02, loop)
        await asyncio.sleep(0.15)

    asyncio.run(leave())
    asyncio.run(serve())
    assert expired == ["new"]


@pytest.mark.slow
def test_the_timer_of_a_loop_left_behind_does_nothing_when_it_fires() -> None:
    """Loop A watches an item and stops before its timer fires; loop B watches its own.
    When A runs again and its timer fires, B's item is left to B's timer, and A's item,
    dropped when B began, never expires."""
    expired: list[str] = []
    watched: Deadlines[str] = Deadlines(expired.append)
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        first.call_soon(lambda: watched.watch("a", first.time() + 0.02, first))
        first.run_until_complete(asyncio.sleep(0))
        second.call_soon(lambda: watched.watch("b", second.time() + 0.3, second))
        second.run_until_complete(asyncio.sleep(0))
        first.run_until_complete(asyncio.sleep(0.1))  # A's timer fires here
        assert expired == []
        second.run_until_complete(asyncio.sleep(0.4))
        assert expired == ["b"]
    finally:
        first.close()
        second.close()
