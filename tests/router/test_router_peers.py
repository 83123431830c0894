"""Load notes between router processes: applied once, ignored when own, aged out when lost."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zmq.asyncio

from kvevents import Holder, Router
from kvevents.router.fleet.peers import LoadNote, LoadNotes, PeerNotes, sender_id

H = Holder("http://engine", 0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _peer(tmp_path: Path, clock: Clock, ctx: zmq.asyncio.Context) -> tuple[Router, PeerNotes]:
    router = Router(block_size=16)
    router.add_holder(H)
    notes = PeerNotes(router, "me", f"ipc://{tmp_path}/me", [], ttl=30.0, context=ctx, clock=clock)
    return router, notes


def _note(kind: str, ticket: int = 1, sender: str = "other") -> LoadNote:
    return LoadNote(sender, kind, H.worker, H.dp_rank, ticket, 8, 5.0, 30.0)  # type: ignore[arg-type]


def test_begin_and_finish_notes_add_and_remove_in_flight_load_once(tmp_path: Path) -> None:
    """A peer's begin counts in flight once (duplicates ignored); its finish removes it once."""
    ctx = zmq.asyncio.Context()
    clock = Clock()
    router, notes = _peer(tmp_path, clock, ctx)
    try:
        notes.apply(_note("begin"))
        notes.apply(_note("begin"))  # the same note twice
        load = router.loads[H]  # a copy, as the router's loads hand out
        assert (load.inflight_requests, load.inflight_blocks) == (1, 5.0)
        assert load.recent_blocks == 8.0
        notes.apply(_note("finish"))
        notes.apply(_note("finish"))  # late duplicate: nothing left to remove
        load = router.loads[H]
        assert (load.inflight_requests, load.inflight_blocks) == (0, 0.0)
        notes.apply(_note("finish", ticket=7))  # a finish whose begin never came
        load = router.loads[H]
        assert (load.inflight_requests, load.inflight_blocks) == (0, 0.0)
    finally:
        asyncio.run(notes.close())
        ctx.term()


def test_own_notes_are_ignored_and_lost_finishes_age_out(tmp_path: Path) -> None:
    """Notes from this process change nothing; a begin without finish expires after its ttl."""
    ctx = zmq.asyncio.Context()
    clock = Clock()
    router, notes = _peer(tmp_path, clock, ctx)
    try:
        notes.apply(_note("begin", sender="me"))
        assert router.loads[H].inflight_requests == 0
        notes.apply(_note("begin", ticket=2))
        clock.now += 29.0
        notes.expire()
        assert router.loads[H].inflight_requests == 1
        clock.now += 2.0
        notes.expire()
        assert (router.loads[H].inflight_requests, notes.expired) == (0, 1)
    finally:
        asyncio.run(notes.close())
        ctx.term()


def test_a_notes_time_to_live_is_never_longer_than_this_routers(tmp_path: Path) -> None:
    """A sender's ttl counts when shorter than ours; a longer, infinite, NaN or
    non-positive one is ours (30 s here), so no peer keeps a request in flight for ever.
    Begins finished before their time leave nothing behind when it comes."""
    ctx = zmq.asyncio.Context()
    clock = Clock()
    router, notes = _peer(tmp_path, clock, ctx)
    try:
        for ticket, ttl in enumerate([10.0, 1e9, float("inf"), float("nan"), -1.0, 0.0], 1):
            note = msgspec.structs.replace(_note("begin", ticket=ticket), ttl=ttl)
            notes.apply(note)
        notes.apply(_note("begin", ticket=7))
        notes.apply(_note("finish", ticket=7))  # finished: its due line is skipped
        assert router.loads[H].inflight_requests == 6
        clock.now += 11.0
        notes.expire()
        assert (router.loads[H].inflight_requests, notes.expired) == (5, 1)
        clock.now += 20.0
        notes.expire()
        assert (router.loads[H].inflight_requests, notes.expired) == (0, 6)
        clock.now += 31.0  # and what was remembered of them is forgotten in turn
        notes.expire()
        assert (notes._remote, notes._done, notes._due) == ({}, {}, [])
    finally:
        asyncio.run(notes.close())
        ctx.term()


def test_notes_about_engines_this_router_does_not_follow_are_ignored(tmp_path: Path) -> None:
    """On a shared subject, another group's notes name engines this router does not
    follow: counted as foreign, they add no holder and take nothing from the recent
    work of this router's own holders."""
    ctx = zmq.asyncio.Context()
    clock = Clock()
    router, notes = _peer(tmp_path, clock, ctx)
    notes.follows = {H.worker}.__contains__  # what RouterService.workers gives it
    try:
        notes.apply(_note("routed", ticket=1))  # our own engine's: some recent work
        before = router.loads[H].recent_blocks
        for rank in range(50):
            other = LoadNote("other", "routed", "http://elsewhere", rank, 100 + rank, 64, 0.0, 30.0)
            notes.apply(other)
        assert notes.foreign == 50 and notes.received == 51
        assert list(router.loads) == [H]
        assert router.loads[H].recent_blocks == before
    finally:
        asyncio.run(notes.close())
        ctx.term()


def test_local_decisions_are_sent_as_notes_a_peer_applies(tmp_path: Path) -> None:
    """begin/finish on one router reach another over real sockets and move its load."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        a_router, b_router = Router(block_size=16), Router(block_size=16)
        for r in (a_router, b_router):
            r.add_holder(H)
        a = PeerNotes(a_router, "a", f"ipc://{tmp_path}/a", [f"ipc://{tmp_path}/b"], context=ctx)
        b = PeerNotes(b_router, "b", f"ipc://{tmp_path}/b", [f"ipc://{tmp_path}/a"], context=ctx)
        a.start()
        b.start()
        try:
            decision = a_router.route(list(range(64)))
            deadline = asyncio.get_running_loop().time() + 10.0
            ticket = None
            while b.received == 0:  # PUB/SUB joins take a moment: resend until one lands
                assert asyncio.get_running_loop().time() < deadline, "no note arrived in 10 s"
                if ticket is not None:
                    a_router.finish(ticket)
                    await asyncio.sleep(0.05)
                    b._remote.clear()
                    left = b_router.loads[H]  # the note that landed, taken out again
                    b_router.remote_inflight(H, -left.inflight_requests, -left.inflight_blocks)
                    b.received = 0
                ticket = a_router.begin(decision)
                await asyncio.sleep(0.05)
            assert b_router.loads[H].inflight_requests == 1
            assert ticket is not None
            a_router.finish(ticket)
            while b_router.loads[H].inflight_requests:
                assert asyncio.get_running_loop().time() < deadline, "finish did not arrive"
                await asyncio.sleep(0.01)
        finally:
            await a.close()
            await b.close()
            ctx.term()

    asyncio.run(main())


class FakeTransport:
    """A transport that keeps what is sent and refuses it when told to."""

    def __init__(self, ignore_prefix: str | None = None, up: bool = True) -> None:
        self.ignore_prefix = ignore_prefix
        self.up = up
        self.sent: list[bytes] = []
        self.deliver: Callable[[bytes], None] | None = None

    def send(self, raw: bytes) -> bool:
        if self.up:
            self.sent.append(raw)
        return self.up

    def start(self, deliver: Callable[[bytes], None]) -> None:
        self.deliver = deliver

    async def close(self) -> None:
        self.deliver = None


def test_notes_go_out_on_every_transport_and_group_copies_are_ignored() -> None:
    """A note is sent on each transport (a refused send counts as dropped); a note from
    this process's own group arriving over the cross-machine transport is ignored, and a
    routed note delivered twice counts once."""

    async def main() -> None:
        router = Router(block_size=16)
        router.add_holder(H)
        ipc, nats_like = FakeTransport(), FakeTransport(ignore_prefix="g1/", up=False)
        notes = LoadNotes(router, "g1/0", [ipc, nats_like], ttl=30.0)
        notes.start()
        try:
            router.record(router.route(list(range(64))))
            assert (len(ipc.sent), notes.sent, notes.dropped) == (1, 1, 1)
            assert nats_like.deliver is not None and ipc.deliver is not None
            nats_like.deliver(msgspec.msgpack.encode(_note("begin", sender="g1/1")))
            assert notes.received == 0 and router.loads[H].inflight_requests == 0
            routed = msgspec.msgpack.encode(_note("routed", ticket=-3))
            before = router.loads[H].recent_blocks
            ipc.deliver(routed)
            nats_like.deliver(routed)
            assert router.loads[H].recent_blocks > before
            assert (notes.received, notes.duplicates) == (2, 1)
        finally:
            await notes.close()

    asyncio.run(main())


def test_a_restarted_peer_takes_its_earlier_runs_in_flight_requests_with_it() -> None:
    """The first note of a later run in a seat (``SEAT#RUN``) drops what the earlier run
    left in flight, and the earlier run's late notes change nothing; senders without a
    seat, or in another seat, are left alone."""
    router = Router(block_size=16)
    router.add_holder(H)
    notes = LoadNotes(router, sender_id("g/0", "a"), [FakeTransport()], ttl=30.0)
    old, new = sender_id("g/1", "run1"), sender_id("g/1", "run2")
    notes.apply(_note("begin", ticket=1, sender=old))
    notes.apply(_note("begin", ticket=2, sender=old))
    notes.apply(_note("begin", ticket=1, sender="seatless"))
    notes.apply(_note("begin", ticket=1, sender=sender_id("g/2", "run1")))
    assert router.loads[H].inflight_requests == 4
    notes.apply(_note("routed", ticket=-1, sender=new))
    assert (router.loads[H].inflight_requests, notes.superseded) == (2, 2)
    notes.apply(_note("begin", ticket=3, sender=old))  # the dead run, late: ignored
    notes.apply(_note("finish", ticket=1, sender=old))
    assert (router.loads[H].inflight_requests, notes.superseded) == (2, 4)
    notes.apply(_note("begin", ticket=1, sender=new))  # the new run's own ticket 1 counts
    assert router.loads[H].inflight_requests == 3
    with pytest.raises(ValueError, match="must not contain '#'"):
        sender_id("a#b", "run")


def test_a_dead_runs_late_note_heard_after_its_replacement_changes_nothing() -> None:
    """Runs that end in their start time (as --workers' ``PID-TIME_NS``) are ordered by it:
    the dead run's first note, arriving after its replacement spoke, neither counts nor
    marks the live run gone; a later run still supersedes it."""
    router = Router(block_size=16)
    router.add_holder(H)
    wire = FakeTransport()
    notes = LoadNotes(router, sender_id("g/0", "9-5"), [wire], ttl=30.0)
    dead, live, later = (
        sender_id("g/1", f"{pid}-{t}") for pid, t in ((7, 100), (8, 200), (9, 300))
    )
    notes.apply(_note("begin", ticket=1, sender=live))
    sent = len(wire.sent)
    notes.apply(_note("begin", ticket=1, sender=dead))
    notes.apply(_note("begin", ticket=2, sender=dead))
    assert (router.loads[H].inflight_requests, notes.superseded) == (1, 2)
    assert len(wire.sent) == sent  # nothing re-sent to a dead run
    notes.apply(_note("begin", ticket=2, sender=live))  # the live run still counts
    assert router.loads[H].inflight_requests == 2
    notes.apply(_note("begin", ticket=1, sender=later))
    assert (router.loads[H].inflight_requests, notes.superseded) == (1, 4)


def test_a_newcomer_hears_again_of_the_requests_in_flight_here() -> None:
    """When a sender is heard for the first time, this router sends ``begin`` again for
    each of its requests still in flight (not for those finished), so a peer that started
    after them counts them too; a peer that had them takes the copies as duplicates."""

    async def main() -> None:
        router = Router(block_size=16)
        router.add_holder(H)
        wire = FakeTransport()
        notes = LoadNotes(router, sender_id("g/0", "a"), [wire], ttl=30.0)
        notes.start()
        try:
            tickets = [router.begin(router.route(list(range(64 + i)))) for i in range(3)]
            router.finish(tickets[0])
            sent = len(wire.sent)
            peer_router = Router(block_size=16)
            peer_router.add_holder(H)
            peer = LoadNotes(peer_router, sender_id("g/1", "b"), [FakeTransport()], ttl=30.0)
            notes.apply(_note("routed", ticket=-1, sender=peer.sender))
            resent = [msgspec.msgpack.decode(raw, type=LoadNote) for raw in wire.sent[sent:]]
            assert [(n.kind, n.ticket) for n in resent] == [("begin", t.id) for t in tickets[1:]]
            assert notes.resent == 2
            for note in resent:
                peer.apply(note)
            load = peer_router.loads[H]
            assert load.inflight_requests == 2
            assert load.inflight_blocks == sum(t.blocks for t in tickets[1:])
            notes.apply(_note("routed", ticket=-2, sender=peer.sender))  # not new: no resend
            assert len(wire.sent) == sent + 2
        finally:
            await notes.close()

    asyncio.run(main())


def test_notes_with_out_of_range_numbers_are_counted_malformed_and_change_nothing() -> None:
    """Negative blocks or ranks and non-finite in-flight blocks decode (the types are
    right) but are refused: applied, a begin/finish pair of them would not cancel out
    (the board clamps at 0: a begin of -40 blocks left +40 for ever, one of inf blocks
    wiped this router's own) and a negative routed note would draw traffic."""
    router = Router(block_size=16)
    router.add_holder(H)
    router.begin(router.route(list(range(64))))
    before = router.loads[H]
    wire = FakeTransport()
    notes = LoadNotes(router, "me", [wire], ttl=30.0)
    bad = [
        {"inflight_blocks": -40.0},
        {"inflight_blocks": float("inf")},
        {"inflight_blocks": float("nan")},
        {"n_blocks": -1},
        {"dp_rank": -1},
    ]
    for ticket, change in enumerate(bad, 1):
        for kind in ("begin", "finish"):
            note = msgspec.structs.replace(_note(kind, ticket=ticket), **change)
            notes._on_raw(msgspec.msgpack.encode(note), transport=wire)
    routed = msgspec.structs.replace(_note("routed", ticket=-1), n_blocks=-(10**6))
    notes._on_raw(msgspec.msgpack.encode(routed), transport=wire)
    after = router.loads[H]
    assert (notes.malformed, notes.received, notes.remote_inflight) == (11, 0, 0)
    assert (after.inflight_requests, after.inflight_blocks) == (
        before.inflight_requests,
        before.inflight_blocks,
    )
    assert after.recent_blocks == before.recent_blocks
    notes.apply(_note("begin", ticket=1))  # a note in range from the same sender counts
    assert (notes.received, router.loads[H].inflight_requests) == (1, 2)


class LinkTransport(FakeTransport):
    """A FakeTransport that can lose its connection, as NATS can (``on_link``)."""

    def __init__(self) -> None:
        super().__init__()
        self.on_link: Callable[[bool], None] | None = None


def test_a_lost_link_drops_what_was_heard_over_it_and_hello_asks_again() -> None:
    """The link going down drops the in-flight requests of the peers heard over it (not
    those heard over the other transport); back, this router says hello and sends its
    own begins again, on that link only. A known peer's hello drops that peer's requests
    (their finishes may have been lost) and has this router send its begins to it."""

    async def main() -> None:
        router = Router(block_size=16)
        router.add_holder(H)
        ipc, link = FakeTransport(), LinkTransport()
        notes = LoadNotes(router, "me", [ipc, link], ttl=30.0)
        notes.start()
        try:
            assert link.on_link is not None and link.deliver is not None
            assert ipc.deliver is not None
            own = router.begin(router.route(list(range(64))))
            link.deliver(msgspec.msgpack.encode(_note("begin", ticket=1, sender="far")))
            link.deliver(msgspec.msgpack.encode(_note("begin", ticket=2, sender="far")))
            ipc.deliver(msgspec.msgpack.encode(_note("begin", ticket=1, sender="near")))
            assert router.loads[H].inflight_requests == 4
            sent, resent = (len(ipc.sent), len(link.sent)), notes.resent
            link.on_link(False)
            assert (router.loads[H].inflight_requests, notes.reset) == (2, 2)
            assert notes._remote.keys() == {("near", 1)}
            link.on_link(True)
            assert len(ipc.sent) == sent[0]
            back = [msgspec.msgpack.decode(raw, type=LoadNote) for raw in link.sent[sent[1] :]]
            assert [(n.kind, n.ticket) for n in back] == [("hello", 0), ("begin", own.id)]
            assert notes.resent == resent + 1
            link.deliver(msgspec.msgpack.encode(_note("begin", ticket=3, sender="far")))
            link.deliver(link.sent[-2])  # our own hello: ignored
            hello = msgspec.structs.replace(back[0], sender="far")
            link.deliver(msgspec.msgpack.encode(hello))
            assert (router.loads[H].inflight_requests, notes.reset) == (2, 3)
            assert notes._remote.keys() == {("near", 1)}
            again = msgspec.msgpack.decode(link.sent[-1], type=LoadNote)
            assert (again.kind, again.ticket, notes.resent) == ("begin", own.id, resent + 2)
            # in flight again, not routed again: the peer's recent work counts it once
            assert (again.n_blocks, again.inflight_blocks) == (0, own.blocks)
            assert len(ipc.sent) == sent[0]
            link.deliver(msgspec.msgpack.encode(_note("begin", ticket=3, sender="far")))
            assert router.loads[H].inflight_requests == 3  # sent again: it counts anew
        finally:
            await notes.close()

    asyncio.run(main())
