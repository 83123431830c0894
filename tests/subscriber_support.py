"""Helpers shared by the subscriber tests: bounded waits and raw wire-level peers.

Every wait here has a deadline; every socket is closed by its owner.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Delivery,
    Holder,
    Reset,
    Signal,
    Subscriber,
)
from kvevents.wire.frames import parse_replay_request
from process_support import KVEventsProcess

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


class EngineProcess(KVEventsProcess):
    """`kvevents engine` as a subprocess, stderr discarded; :meth:`stop` ends it."""

    def __init__(self, args: list[str], kv_config: dict[str, Any], timeout: float = 60.0):
        argv = [*args, "--kv-events-config", json.dumps(kv_config)]
        super().__init__("engine", argv, timeout=timeout, capture_stderr=False)

    def generate(self, tokens: list[int], rank: int) -> None:
        body = {"input_ids": tokens, "max_new_tokens": 2, "routed_dp_rank": rank}
        response = self.http.post("/generate", json=body)
        assert response.status_code == 200, response.text

    def published(self) -> dict[int, int]:
        """Batches each rank has published so far."""
        load = self.http.get("/load").json()
        return {r["dp_rank"]: r["batches_published"] for r in load["ranks"]}

    def kv_blocks(self, rank: int) -> set[int]:
        response = self.http.get("/kv_blocks", params={"dp_rank": rank})
        assert response.status_code == 200, response.text
        return set(response.json()["block_hashes"])

    def stop(self, sig: int = signal.SIGTERM, expect: int | None = None) -> int:
        """Stop it (SIGTERM, then kill); the exit code is not checked unless ``expect``."""
        return super().stop(sig, expect)


def free_tcp_port() -> int:
    """A loopback port the OS reports free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HeldBlocks:
    """A consumer's view per holder: engine hashes stored minus removed, dropped on Reset."""

    def __init__(self) -> None:
        self.held: dict[Holder, set[int | bytes]] = {}
        self.delivered: dict[Holder, list[int]] = {}
        self.removed = 0  # blocks removed, over every holder

    def apply(self, items: list[Item]) -> None:
        for item in items:
            if isinstance(item, Reset):
                assert item.holder is not None
                self.held.pop(item.holder, None)
                self.delivered.pop(item.holder, None)
            elif isinstance(item, Delivery):
                held = self.held.setdefault(item.holder, set())
                self.delivered.setdefault(item.holder, []).append(item.seq)
                for event in item.batch.events:
                    if isinstance(event, BlockStored):
                        held.update(event.block_hashes)  # type: ignore[arg-type]
                    elif isinstance(event, BlockRemoved):
                        held.difference_update(event.block_hashes)
                        self.removed += len(event.block_hashes)
                    elif isinstance(event, AllBlocksCleared):
                        held.clear()
