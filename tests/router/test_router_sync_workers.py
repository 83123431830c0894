"""``kvevents router --workers 2 --sync nats://``: every worker process of the group syncs.

Real processes: a ``kvevents engine``, a two-process router and a one-process router
both with ``--sync`` against a real ``nats-server``. The group's processes share one
port (``SO_REUSEPORT``), so which one answers depends on the connection: each check
here opens fresh connections until both processes have answered.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from nats_support import NatsServer
from prometheus_client.parser import text_string_to_metric_families
from router_support import Engine, RouterProc, wait_until

DP = 2  # the ranks of the shared `engine` (tests/conftest.py)
PROMPT = list(range(500, 532))  # 8 blocks of 4


@pytest.fixture
def server() -> Iterator[NatsServer]:
    srv = NatsServer()
    yield srv
    srv.kill()


def per_process(url: str, path: str = "/workers", tries: int = 64) -> dict[int, Any]:
    """What each process of a ``--workers 2`` group answers on ``path``, by process index.

    Each try is a new connection, which ``SO_REUSEPORT`` may hand to either process;
    stops once both have answered (or after ``tries``: then fewer are returned)."""
    seen: dict[int, Any] = {}
    for _ in range(tries):
        with httpx.Client(base_url=url, timeout=10.0) as fresh:
            info = fresh.get("/workers").json()
            index = int(info["process"]["index"])
            seen[index] = info if path == "/workers" else fresh.get(path).text
        if len(seen) == 2:
            break
    return seen


def both(url: str, check: Any) -> bool:
    """True when both processes answered and ``check(workers_json)`` holds for each."""
    seen = per_process(url)
    return len(seen) == 2 and all(check(info) for info in seen.values())


def record(url: str, times: int) -> None:
    """``/route`` with ``record`` ``times`` times, each on a new connection."""
    for _ in range(times):
        with httpx.Client(base_url=url, timeout=10.0) as fresh:
            answer = fresh.post("/route", json={"input_ids": PROMPT, "record": True})
            assert answer.status_code == 200, answer.text


def samples(text: str, name: str, **labels: str) -> list[float]:
    """The values of metric ``name`` with ``labels`` in a scrape: one per process of the
    group, as its ``/metrics`` shows them (``process`` and ``pid`` labels)."""
    return [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]


def scraped(url: str, check: Any) -> bool:
    """True when both processes answered ``/metrics`` and ``check(text)`` holds for each."""
    metrics = per_process(url, "/metrics")
    return len(metrics) == 2 and all(check(text) for text in metrics.values())


def notes(info: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = info["process"]["notes"]
    return counts


def synced(info: dict[str, Any]) -> bool:
    return bool(info["process"]["sync"]["connected"])


def following(info: dict[str, Any]) -> bool:
    return sum(s["status"] == "connected" for s in info["streams"]) == DP


def test_notes_from_another_router_reach_every_worker_process(
    engine: Engine, server: NatsServer
) -> None:
    """Another router's notes arrive, over NATS, at both processes of a ``--workers 2``
    group; the group's own notes still go between its processes (and out over NATS,
    once per note); with NATS killed and restarted, the processes go on alone, say so
    per process, keep their own notes flowing, and then sync again."""
    group = RouterProc([engine.url], "--workers", "2", "--sync", server.url)
    other = RouterProc([engine.url], "--sync", server.url)
    try:
        wait_until(
            lambda: both(group.url, lambda i: following(i) and synced(i)),
            30,
            "both processes following every stream and joined to NATS",
        )
        wait_until(lambda: synced(other.http.get("/workers").json()), 20, "the other router")

        record(other.url, 4)
        assert notes(other.http.get("/workers").json())["sent"] == 4
        wait_until(
            lambda: both(group.url, lambda i: notes(i)["received"] == 4),
            20,
            "the other router's 4 notes on both processes",
        )
        for info in per_process(group.url).values():
            assert notes(info)["duplicates"] == 0
            routed = sum(h["load"]["recent_blocks"] for h in info["holders"])
            assert routed > 0  # the other router's decisions count in this process's cost
        notes_total = "kvevents_router_peer_notes_total"
        wait_until(  # each process's figures reach the group's /metrics within a second
            lambda: scraped(
                group.url,
                lambda text: (
                    samples(text, "kvevents_router_sync_connected") == [1.0, 1.0]
                    and samples(text, notes_total, direction="received") == [4.0, 4.0]
                    and samples(text, notes_total, direction="reset") == [0.0, 0.0]
                ),
            ),
            20,
            "both processes connected, with the 4 notes, in the group's /metrics",
        )

        # the group's own notes: each process hears the other's once (over ipc; the
        # NATS copy of a sibling's note is dropped), and the other router hears all
        record(group.url, 6)

        def group_settled() -> bool:
            seen = per_process(group.url)
            if len(seen) < 2:
                return False
            sent = {i: notes(info)["sent"] for i, info in seen.items()}
            received = {i: notes(info)["received"] for i, info in seen.items()}
            return sum(sent.values()) == 6 and all(received[i] == 4 + sent[1 - i] for i in (0, 1))

        wait_until(group_settled, 20, "the group's 6 notes, each on the sibling process once")
        wait_until(
            lambda: notes(other.http.get("/workers").json())["received"] == 6,
            20,
            "the group's 6 notes on the other router",
        )
        for info in per_process(group.url).values():
            assert notes(info)["duplicates"] == 0

        server.kill()
        wait_until(
            lambda: both(group.url, lambda i: not synced(i)),
            20,
            "both processes to see NATS gone",
        )
        wait_until(
            lambda: scraped(
                group.url,
                lambda text: samples(text, "kvevents_router_sync_connected") == [0.0, 0.0],
            ),
            20,
            "both processes unconnected in the group's /metrics",
        )
        seen = per_process(group.url)
        assert len(seen) == 2
        before = {i: notes(info) for i, info in seen.items()}
        before_dropped = {i: info["process"]["sync"]["dropped"] for i, info in seen.items()}
        record(group.url, 6)  # routing goes on; notes between the processes still flow

        def sibling_notes_without_nats() -> bool:
            seen = per_process(group.url)
            if len(seen) < 2:
                return False
            sent = {i: notes(seen[i])["sent"] - before[i]["sent"] for i in (0, 1)}
            got = {i: notes(seen[i])["received"] - before[i]["received"] for i in (0, 1)}
            return sum(sent.values()) == 6 and all(got[i] == sent[1 - i] for i in (0, 1))

        wait_until(sibling_notes_without_nats, 20, "the group's notes over ipc without NATS")
        for i, info in per_process(group.url).items():  # not sent to NATS, and counted so
            sent = notes(info)["sent"] - before[i]["sent"]
            dropped = info["process"]["sync"]["dropped"] - before_dropped[i]
            assert dropped == sent, (i, sent, dropped)

        server.start()
        wait_until(
            lambda: both(group.url, lambda i: synced(i) and i["process"]["sync"]["disconnects"]),
            30,
            "both processes to rejoin NATS",
        )
        wait_until(lambda: synced(other.http.get("/workers").json()), 30, "the other router back")
        counts = {i: notes(info)["received"] for i, info in per_process(group.url).items()}
        record(other.url, 3)
        wait_until(
            lambda: both(
                group.url,
                lambda i: notes(i)["received"] == counts[int(i["process"]["index"])] + 3,
            ),
            20,
            "the other router's notes on both processes after NATS came back",
        )
    finally:
        other.stop()
        group.stop()
