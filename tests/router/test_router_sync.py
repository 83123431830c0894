"""Router replicas sharing in-flight load over a real NATS (``kvevents router --sync``):
notes arrive and count, NATS going away and coming back, duplicated and late notes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import nats
import pytest
from nats_support import NatsProxy, NatsServer
from router_support import Engine, RouterProc, wait_until

from kvevents import Holder, Router
from kvevents.errors import ConfigError
from kvevents.router.fleet.nats_sync import (
    RESYNC_INTERVAL,
    NatsNoteTransport,
    default_subject,
    shown_url,
    split_notes,
)
from kvevents.router.fleet.peers import LoadNote, LoadNotes
from process_support import run_kvevents
from subscriber_support import free_tcp_port

DP = 2


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Engine:
    # slow decoding, so a long request is in flight for a few seconds
    return make_engine(["--dp-size", str(DP), "--page-size", "4", "--decode-steps-per-s", "50"])


@pytest.fixture
def server() -> Iterator[NatsServer]:
    srv = NatsServer()
    yield srv
    srv.kill()


def sync_state(router: RouterProc) -> dict[str, Any]:
    process: dict[str, Any] = router.http.get("/workers").json()["process"]
    return process


def notes(router: RouterProc) -> dict[str, int]:
    counts: dict[str, int] = sync_state(router)["notes"]
    return counts


def connected(router: RouterProc) -> bool:
    return bool(sync_state(router)["sync"]["connected"])


def _router_with(holder: Holder) -> Router:
    made = Router(block_size=16)
    made.add_holder(holder)
    return made


async def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``check`` on the event loop until true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


def generate(router: RouterProc, tokens: list[int], max_new_tokens: int = 2) -> None:
    answer = router.post("/generate", {"input_ids": tokens, "max_new_tokens": max_new_tokens})
    assert answer.status_code == 200, answer.text


@pytest.mark.slow
def test_three_replicas_share_in_flight_load_and_survive_nats_restarts(
    engine: Engine, server: NatsServer
) -> None:
    """Every note one replica sends reaches the other two and counts once; with NATS
    killed each goes on alone and says so, and once it is back notes flow again."""
    routers = [RouterProc([engine.url], "--sync", server.url) for _ in range(3)]
    a, b, c = routers
    try:
        for r in routers:
            wait_until(lambda r=r: r.connected() == DP and connected(r), 20, "streams and NATS")
        # a long request through a is in flight on b and c while it runs
        long = threading.Thread(target=generate, args=(a, list(range(1, 17)), 150))
        long.start()
        try:
            for r in (b, c):
                wait_until(lambda r=r: notes(r)["peer_inflight"] == 1, 20, "a's request on peers")
        finally:
            long.join(timeout=60)
        assert not long.is_alive()
        for r in (b, c):
            wait_until(lambda r=r: notes(r)["peer_inflight"] == 0, 20, "its finish on peers")
        for i in range(5):
            generate(a, [100 + i] * 12)
        sent = notes(a)["sent"]
        assert sent == 12  # begin and finish of 6 requests
        for r in (b, c):
            wait_until(lambda r=r: notes(r)["received"] == sent, 20, "every note on b and c")
            assert notes(r)["duplicates"] == 0 and notes(r)["peer_inflight"] == 0
        assert notes(a)["received"] == 0  # its own notes are not counted

        server.kill()
        for r in routers:
            wait_until(lambda r=r: not connected(r), 20, "every replica to see NATS gone")
            metrics = r.http.get("/metrics").text
            assert "kvevents_router_sync_connected 0.0" in metrics
        generate(a, [7] * 12)  # routing goes on alone
        assert sync_state(a)["sync"]["dropped"] >= 2

        server.start()
        for r in routers:
            wait_until(lambda r=r: connected(r), 30, "every replica to reconnect")
            assert sync_state(r)["sync"]["disconnects"] >= 1
        before = notes(c)["received"]
        generate(b, [9] * 12)
        wait_until(lambda: notes(c)["received"] == before + 2, 20, "notes after the restart")
        metrics = c.http.get("/metrics").text
        assert "kvevents_router_sync_connected 1.0" in metrics
        assert "kvevents_router_sync_missed_messages_total 0.0" in metrics
        assert sync_state(c)["sync"]["missed"] == sync_state(c)["sync"]["resyncs"] == 0
    finally:
        for r in routers:
            r.stop()


@pytest.mark.slow
def test_duplicated_and_late_notes_change_nothing_twice(engine: Engine, server: NatsServer) -> None:
    """A begin sent twice counts once; its finish sent twice removes it once; a begin
    arriving after its finish, and a routed note sent twice, change nothing more."""
    router = RouterProc([engine.url], "--sync", server.url)
    subject = default_subject([engine.url]) + ".tester"  # the sender's own subject
    holder = (engine.url, 0)

    def note(kind: str, ticket: int) -> bytes:
        return msgspec.msgpack.encode(
            LoadNote("tester", kind, holder[0], holder[1], ticket, 8, 5.0, 60.0)  # type: ignore[arg-type]
        )

    async def publish(*raws: bytes) -> None:
        nc = await nats.connect(server.url, connect_timeout=5, max_reconnect_attempts=0)
        try:
            for raw in raws:
                await nc.publish(subject, raw)
            await nc.flush(timeout=5)
        finally:
            await nc.close()

    try:
        wait_until(lambda: connected(router), 20, "the router to join NATS")
        asyncio.run(publish(note("begin", 1), note("begin", 1)))
        wait_until(lambda: notes(router)["received"] == 2, 20, "both copies of the begin")
        assert notes(router)["peer_inflight"] == 1 and notes(router)["duplicates"] == 1
        asyncio.run(publish(note("finish", 1), note("finish", 1), note("begin", 1)))
        wait_until(lambda: notes(router)["received"] == 5, 20, "the finishes and the late begin")
        assert notes(router)["peer_inflight"] == 0 and notes(router)["duplicates"] == 3
        asyncio.run(publish(note("routed", -1), note("routed", -1)))
        wait_until(lambda: notes(router)["received"] == 7, 20, "both routed copies")
        assert notes(router)["duplicates"] == 4
    finally:
        router.stop()


@pytest.mark.slow
def test_a_batch_of_notes_in_one_message_counts_note_by_note(
    engine: Engine, server: NatsServer
) -> None:
    """Replicas publish the notes of a burst as one NATS message: each note in it is
    applied (and deduplicated) on its own, and a garbage element is counted malformed."""
    router = RouterProc([engine.url], "--sync", server.url)
    subject = default_subject([engine.url]) + ".batcher"  # the sender's own subject

    def note(kind: str, ticket: int) -> bytes:
        return msgspec.msgpack.encode(
            LoadNote("batcher", kind, engine.url, 0, ticket, 8, 5.0, 60.0)  # type: ignore[arg-type]
        )

    async def publish(raw: bytes) -> None:
        nc = await nats.connect(server.url, connect_timeout=5, max_reconnect_attempts=0)
        try:
            await nc.publish(subject, raw)
            await nc.flush(timeout=5)
        finally:
            await nc.close()

    try:
        wait_until(lambda: connected(router), 20, "the router to join NATS")
        batch = [note("begin", 1), note("begin", 2), note("begin", 2), b"\xc1junk"]
        asyncio.run(publish(msgspec.msgpack.encode(batch)))
        wait_until(lambda: notes(router)["received"] == 3, 20, "the batch's three notes")
        counts = notes(router)
        assert counts["peer_inflight"] == 2 and counts["duplicates"] == 1
        assert counts["malformed"] == 1
        asyncio.run(publish(msgspec.msgpack.encode([note("finish", 1), note("finish", 2)])))
        wait_until(lambda: notes(router)["peer_inflight"] == 0, 20, "both finishes")
    finally:
        router.stop()


def test_nats_credentials_in_the_sync_url_are_used_and_never_shown(engine: Engine) -> None:
    """``--sync nats://user:pass@host``: the router connects with them, and neither
    ``/workers`` nor its log (NATS lost and back) shows the password."""
    server = NatsServer(extra=("--user", "router", "--pass", "s3cretPW"))
    router = None
    try:
        url = server.url.replace("nats://", "nats://router:s3cretPW@")
        router = RouterProc([engine.url], "--sync", url)
        wait_until(lambda: connected(router), 20, "NATS with the credentials")
        assert sync_state(router)["sync"]["url"] == url.replace("router:s3cretPW", "***")
        server.kill()
        wait_until(lambda: not connected(router), 20, "NATS lost")
        server.start()
        wait_until(lambda: connected(router), 20, "NATS back")
        assert "s3cretPW" not in router.http.get("/workers").text
    finally:
        if router is not None:
            router.stop()
        server.kill()
    assert "NATS nats://***@127.0.0.1" in router.stderr and "s3cretPW" not in router.stderr


def test_shown_urls_mask_every_password_however_it_is_spelled() -> None:
    """Masking runs to the last @ of each URL's authority, as URL parsers split it."""
    assert shown_url("nats://user:p@ss@host:4222") == "nats://***@host:4222"
    assert shown_url("nats://u:pa,ss@h") == "nats://***@h"
    assert shown_url("nats://a:b@h1:4222,nats://c:d@h2:4222") == (
        "nats://***@h1:4222,nats://***@h2:4222"
    )
    assert shown_url("nats://h:4222") == "nats://h:4222"


@pytest.mark.slow
def test_a_silent_partition_from_nats_is_noticed_within_seconds(server: NatsServer) -> None:
    """NATS unreachable without a FIN or RST (the network between drops everything):
    the transport's pings go unanswered, so within seconds it says it is not connected
    and counts its notes dropped; nats-py's default (a ping every 120 s) kept it saying
    connected, its notes published into the void, for minutes."""

    async def main() -> None:
        proxy = NatsProxy(server.port)
        await proxy.start()
        transport = NatsNoteTransport(proxy.url, "t.partition", reconnect_wait=0.2)
        transport.publish_as("t")
        transport.start(lambda raw, origin: None)
        try:
            await until(lambda: transport.connected, 10, "the transport to join NATS")
            proxy.partition()
            await until(lambda: not transport.connected, 10, "the partition to be noticed")
            assert transport.status()["disconnects"] == 1
            assert not transport.send(b"note") and transport.dropped == 1
        finally:
            await transport.close()
            await proxy.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("nats://127.0.0.1:42x2", "cannot read a port from 1 to 65535"),
        ("nats://127.0.0.1:99999", "cannot read a port from 1 to 65535"),
        ("nats://127.0.0.1:0", "cannot read a port from 1 to 65535"),
        ("nats://[::1", "cannot read a port from 1 to 65535"),
        ("nats://", "names no host"),
        ("nats://user:pw@:4222", "names no host"),
        ("http://127.0.0.1:4222", "give a NATS URL"),
    ],
)
def test_a_sync_url_nats_cannot_use_is_refused_at_start(url: str, problem: str) -> None:
    """nats-py checks host and port only as it connects, and raises before its retry
    loop: such a URL was accepted, and the replica ran without sync for ever, saying
    only "not connected". It is refused up front, naming the option (not the password)."""
    with pytest.raises(ConfigError, match=problem) as refused:
        NatsNoteTransport(url, "t.x")
    assert str(refused.value).startswith("--sync '") and "e.g. nats://" in str(refused.value)
    assert "pw" not in str(refused.value)


@pytest.mark.slow
def test_kvevents_router_refuses_a_sync_url_without_a_port_number() -> None:
    """The command exits 2 with the message, before following any engine."""
    done = run_kvevents(
        "router", "--engine", "http://127.0.0.1:9", "--sync", "nats://127.0.0.1:42x2"
    )
    assert done.returncode == 2, done.stderr
    assert "kvevents router: error: --sync 'nats://127.0.0.1:42x2': cannot read a port" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_failure_nats_py_raises_is_shown_and_retried_and_close_does_not_raise(
    server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """What nats-py raises instead of retrying by itself (here: a URL it cannot parse,
    put past the start-up check) is logged and shown in ``last_error``, and connecting
    is tried again; before, the task died silently (``last_error`` None for ever) and
    ``close()`` raised its exception, so the router's shutdown failed."""

    async def main() -> None:
        transport = NatsNoteTransport(server.url, "t.retry", reconnect_wait=0.1)
        transport._connect_url = "nats://127.0.0.1:42x2"  # what nats-py refuses
        transport.publish_as("t")
        transport.start(lambda raw, origin: None)
        try:
            await until(lambda: transport.last_error is not None, 10, "the failure shown")
            assert not transport.connected and "invalid" in str(transport.last_error)
            transport._connect_url = server.url  # the cause goes away: it connects
            await until(lambda: transport.connected, 10, "the retry to connect")
        finally:
            await transport.close()

    with caplog.at_level(logging.ERROR, logger="kvevents.router"):
        asyncio.run(main())
    assert any("trying again" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_after_a_nats_outage_both_sides_count_what_is_in_flight_now(server: NatsServer) -> None:
    """B's link to NATS is cut while A finishes the requests B had heard begin, and B
    begins one and finishes another that A does not hear of. B drops what it learned
    over NATS as the link goes; back, it says hello and both send again what they have
    in flight, so each counts the other's requests in flight now. Before, B kept A's
    finished requests in flight up to the 300 s ttl, and A kept B's finished one."""
    holder = Holder("http://engine", 0)
    router = functools.partial(_router_with, holder)

    async def main() -> None:
        proxy = NatsProxy(server.port)
        await proxy.start()
        ra, rb = router(), router()
        a = LoadNotes(ra, "A", [NatsNoteTransport(server.url, "t.outage", reconnect_wait=0.2)])
        link = NatsNoteTransport(proxy.url, "t.outage", reconnect_wait=0.2)
        b = LoadNotes(rb, "B", [link])
        a.start()
        b.start()
        try:
            await until(lambda: a.transports[0].connected and link.connected, 10, "both on NATS")
            a_tickets = [ra.begin(ra.route(list(range(64)))) for _ in range(3)]
            b_tickets = [rb.begin(rb.route(list(range(64)))) for _ in range(2)]
            await until(lambda: b.remote_inflight == 3, 10, "A's requests on B")
            await until(lambda: a.remote_inflight == 2, 10, "B's requests on A")
            await proxy.cut()
            await until(lambda: not link.connected, 10, "B to see its link gone")
            assert (b.remote_inflight, rb.loads[holder].inflight_requests) == (0, 2)
            assert b.reset == 3
            for ticket in a_tickets[:2]:
                ra.finish(ticket)  # B does not hear of these
            rb.finish(b_tickets[0])  # nor A of this, nor of the next begin
            late = rb.begin(rb.route(list(range(64))))
            await proxy.heal()
            await until(lambda: link.connected, 10, "B back on NATS")
            await until(lambda: b.remote_inflight == 1, 10, "A's one request left, on B")
            await until(
                lambda: set(a._remote) == {("B", b_tickets[1].id), ("B", late.id)},
                10,
                "B's two requests in flight now, on A",
            )
            assert rb.loads[holder].inflight_requests == 2 + 1
            assert ra.loads[holder].inflight_requests == 1 + 2
        finally:
            await a.close()
            await b.close()
            await proxy.close()

    asyncio.run(main())


@pytest.mark.slow
def test_a_replica_that_joins_hears_of_the_requests_in_flight_before_it_routes(
    server: NatsServer,
) -> None:
    """B connects after A began requests: its first connection says hello, so A sends its
    begins again and B counts them before it routes anything (it learned of them only
    once its own first note reached A)."""
    holder = Holder("http://engine", 0)
    router = functools.partial(_router_with, holder)

    async def main() -> None:
        ra, rb = router(), router()
        a = LoadNotes(ra, "A", [NatsNoteTransport(server.url, "t.join", reconnect_wait=0.2)])
        b = LoadNotes(rb, "B", [NatsNoteTransport(server.url, "t.join", reconnect_wait=0.2)])
        a.start()
        try:
            await until(lambda: a.transports[0].connected, 10, "A on NATS")
            for _ in range(3):
                ra.begin(ra.route(list(range(64))))
            await until(lambda: a.transports[0].batches >= 1, 10, "A's begins published")
            b.start()
            await until(lambda: b.remote_inflight == 3, 10, "A's requests on B")
            assert rb.loads[holder].inflight_requests == 3 and b.sent == 0
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


@pytest.mark.slow
def test_a_replica_restarted_on_its_port_takes_its_earlier_runs_place_at_once(
    engine: Engine, server: NatsServer
) -> None:
    """A replica killed with a request in flight and started again on the same machine and
    port: its hello makes the peer drop what the dead run left in flight (it counted it
    until the 300 s time-to-live, a restarted replica being a stranger)."""
    port = str(free_tcp_port())
    peer = RouterProc([engine.url], "--sync", server.url)
    routers = [peer, RouterProc([engine.url], "--port", port, "--sync", server.url)]
    first = routers[1]

    def long_request() -> None:
        with contextlib.suppress(httpx.HTTPError):  # its router is killed under it
            first.post("/generate", {"input_ids": [5] * 16, "max_new_tokens": 300})

    try:
        for r in routers:
            wait_until(lambda r=r: r.connected() == DP and connected(r), 20, "streams and NATS")
        threading.Thread(target=long_request, daemon=True).start()
        wait_until(lambda: notes(peer)["peer_inflight"] == 1, 20, "the request on the peer")
        routers.remove(first)
        first.stop(signal.SIGKILL, expect=None)
        assert notes(peer)["peer_inflight"] == 1
        routers.append(RouterProc([engine.url], "--port", port, "--sync", server.url))
        wait_until(lambda: notes(peer)["peer_inflight"] == 0, 20, "the dead run's request gone")
        assert notes(peer)["superseded"] == 1
    finally:
        for r in routers:
            r.stop(expect=None)


@pytest.mark.slow
def test_notes_nats_drops_on_the_way_in_are_counted_and_followed_by_a_resync(
    server: NatsServer,
) -> None:
    """B reads NATS too slowly for a burst (its subscription holds 5 notes unread), so
    NATS drops the rest, among them peer A's ``finish`` of a request B counts in flight.
    Before, B kept that request in flight for its ttl (300 s) and said nothing. Now it
    counts the notes missed and, once the burst is over, drops the load it heard over
    NATS and says hello; A sends its one request still in flight again, and B counts
    exactly that one."""
    holder = Holder("http://engine", 0)
    subject = "t.slow"
    ready, flood, flooded, done = (threading.Event() for _ in range(4))

    def note(kind: str, ticket: int, sender: str = "A") -> bytes:
        return msgspec.msgpack.encode(
            LoadNote(sender, kind, holder.worker, holder.dp_rank, ticket, 4, 4.0, 300.0)  # type: ignore[arg-type]
        )

    async def peer_a() -> None:
        """Peer A, by hand: two requests begin, a burst of other notes, one finishes."""
        nc = await nats.connect(server.url)

        async def on_message(msg: Any) -> None:
            for raw in split_notes(msg.data):
                if msgspec.msgpack.decode(raw, type=LoadNote).kind == "hello":
                    await nc.publish(f"{subject}.A", note("begin", 2))  # what A has in flight

        await nc.subscribe(f"{subject}.*", cb=on_message)
        for ticket in (1, 2):
            await nc.publish(f"{subject}.A", note("begin", ticket))
        await nc.flush()
        ready.set()
        await asyncio.to_thread(flood.wait, 10)
        for ticket in range(100, 150):  # another peer's notes of nothing in flight
            await nc.publish(f"{subject}.C", note("finish", ticket, sender="C"))
        await nc.publish(f"{subject}.A", note("finish", 1))
        await nc.flush()
        flooded.set()
        await asyncio.to_thread(done.wait, 30)
        await nc.close()

    thread = threading.Thread(target=lambda: asyncio.run(peer_a()), daemon=True)

    async def main() -> None:
        link = NatsNoteTransport(server.url, subject, reconnect_wait=0.2, pending_limit=5)
        b = LoadNotes(_router_with(holder), "B", [link])
        b.start()
        try:
            await until(lambda: link.connected, 10, "B on NATS")
            thread.start()
            await until(lambda: b.remote_inflight == 2, 10, "A's two requests on B")
            flood.set()
            # B's event loop busy while the burst arrives: NATS queues it for B unread
            assert flooded.wait(10), "peer A did not publish its burst"
            time.sleep(0.3)
            await until(lambda: link.resyncs == 1, 10, "B to resync")
            await until(lambda: b.remote_inflight == 1, 10, "A's request still in flight, on B")
            assert link.missed > 0 and link.status()["missed"] == link.missed
            assert ("A", 2) in b._remote and ("A", 1) not in b._remote
            await asyncio.sleep(RESYNC_INTERVAL + 0.2)
            assert link.resyncs == 1  # one burst, one resync
        finally:
            done.set()
            await b.close()

    asyncio.run(main())
    thread.join(timeout=30)
