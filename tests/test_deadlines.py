"""One timer for many deadlines: each item expires at its own deadline, once, unless
forgotten first."""

from __future__ import annotations

import asyncio

import pytest

from kvevents.deadlines import Deadlines


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
