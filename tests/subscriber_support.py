"""Helpers shared by the subscriber tests: bounded waits and raw wire-level peers.

Every wait here has a deadline; every socket is closed by its owner.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from kvevents.signals import Delivery, Signal
from kvevents.subscriber import Subscriber
from kvevents.wire import parse_replay_request

Item = Delivery | Signal


def collect(
    sub: Subscriber,
    *,
    until: Callable[[list[Item]], bool],
    timeout: float = 20.0,
) -> list[Item]:
    """Items from ``sub`` until ``until(items)`` holds; fails after ``timeout`` seconds."""
    items: list[Item] = []
    deadline = time.monotonic() + timeout
    while not until(items):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(
                f"condition not met within {timeout} s; got {len(items)} items, last: {items[-5:]}"
            )
        item = sub.get(timeout=min(remaining, 0.5))
        if item is not None:
            items.append(item)
    return items


def deliveries(items: list[Item]) -> list[Delivery]:
    return [i for i in items if isinstance(i, Delivery)]


def signals(items: list[Item], kind: str | None = None) -> list[Signal]:
    return [i for i in items if isinstance(i, Signal) and (kind is None or i.kind == kind)]


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Wait (bounded) until ``predicate()`` is true, checking every 20 ms."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.02)


def wait_subscribed(xpub: zmq.Socket[bytes], timeout: float = 10.0) -> bytes:
    """Wait until a subscriber's subscription reaches an XPUB socket; returns it."""
    if not xpub.poll(int(timeout * 1000)):
        raise AssertionError(f"no subscription reached the XPUB socket within {timeout} s")
    return xpub.recv()


def recv_replay_request(router: zmq.Socket[bytes], timeout: float = 10.0) -> tuple[bytes, int]:
    """The next replay request on a raw ROUTER: ``(identity, start_seq)``."""
    if not router.poll(int(timeout * 1000)):
        raise AssertionError(f"no replay request within {timeout} s")
    return parse_replay_request(router.recv_multipart())


def bind_local(ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> tuple[zmq.Socket[bytes], str]:
    """A socket bound on an OS-chosen loopback port, with its address."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    return sock, sock.last_endpoint.decode()
