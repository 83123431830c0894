"""Peers' load notes advance the decay of recent work as the sender's decisions did: once
per P/D request (the prefill choice's note says it does not), so replicas agree on
balance; a note of an older sender (no ``decays``) advances it, a bad value is malformed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

import msgspec
import pytest
from nats_support import NatsServer
from sync_security_support import until

from kvevents import Holder, Router
from kvevents.router.decide.pd import PDPools, decide_pd
from kvevents.router.decide.scoring import ScoringWeights
from kvevents.router.fleet.nats_sync import NatsNoteTransport
from kvevents.router.fleet.peers import LoadNote, LoadNotes, NoteTransport

BS = 4
P0, P1 = Holder("http://prefill:1", 0), Holder("http://prefill:1", 1)
D0, D1 = Holder("http://decode:1", 0), Holder("http://decode:1", 1)
HOLDERS = (P0, P1, D0, D1)
POOLS = PDPools(["http://prefill:1"], ["http://decode:1"])
WEIGHTS = ScoringWeights(balance_half_life=2.0)  # recent work fades fast: drift shows
PROMPTS = [list(range(1 + i, 1 + i + 8 * (i % 5 + 1))) for i in range(12)]


def _router() -> Router:
    router = Router(block_size=BS, weights=WEIGHTS)
    for holder in HOLDERS:
        router.add_holder(holder, block_size=BS)
    return router


class Wire:
    """A transport that keeps what is sent and hands on what a test delivers."""

    ignore_prefix: str | None = None

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.deliver: Callable[[bytes, str | None], None] | None = None

    def send(self, raw: bytes) -> bool:
        self.sent.append(raw)
        return True

    def start(self, deliver: Callable[[bytes, str | None], None]) -> None:
        self.deliver = deliver

    async def close(self) -> None:
        self.deliver = None


def _route_pd(router: Router, counted: Literal["begin", "record"]) -> None:
    """Route every prompt of PROMPTS in P/D and count both legs, as the relay (``begin``)
    or ``/route`` with ``record`` does: decode leg first."""
    for prompt in PROMPTS:
        decision = decide_pd(router, POOLS, [prompt], max_local_prefill_tokens=0)
        assert decision.prefill is not None
        for leg in (decision.decode, decision.prefill):
            router.begin(leg) if counted == "begin" else router.record(leg)


def _recent(router: Router) -> dict[Holder, float]:
    return {h: router.loads[h].recent_blocks for h in HOLDERS}


def _old_note(kind: str, ticket: int, holder: Holder, n_blocks: int) -> bytes:
    """A note as a sender before ``decays`` encodes it: eight fields."""
    return msgspec.msgpack.encode(
        ["old", kind, holder.worker, holder.dp_rank, ticket, n_blocks, 0.0, 30.0]
    )


@pytest.mark.parametrize("counted", ["begin", "record"])
def test_a_replica_hearing_pd_notes_holds_the_senders_recent_work(
    counted: Literal["begin", "record"],
) -> None:
    """A replica that applies a P/D router's notes, encoded and decoded as on the wire, ends
    with the sender's recent work on every holder: the prefill leg's note does not fade it
    a second time."""

    async def main() -> None:
        sender, receiver = _router(), _router()
        out, into = Wire(), Wire()
        s_notes = LoadNotes(sender, "S", [out], ttl=30.0)
        r_notes = LoadNotes(receiver, "R", [into], ttl=30.0)
        s_notes.start()
        r_notes.start()
        try:
            _route_pd(sender, counted)
            notes = [msgspec.msgpack.decode(raw, type=LoadNote) for raw in out.sent]
            assert [n.decays for n in notes] == [True, False] * len(PROMPTS)
            assert into.deliver is not None
            for raw in out.sent:
                into.deliver(raw, None)
            assert (r_notes.received, r_notes.malformed) == (2 * len(PROMPTS), 0)
            want = _recent(sender)
            assert sum(want.values()) < sum(len(p) // BS for p in PROMPTS) * 2  # it faded
            assert _recent(receiver) == pytest.approx(want, rel=1e-12)
        finally:
            await s_notes.close()
            await r_notes.close()

    asyncio.run(main())


def test_a_note_without_decays_advances_the_decay_as_before() -> None:
    """An older sender's note (eight fields, no ``decays``) fades every holder's recent
    work by one request before adding its blocks, as every note did before."""
    router = _router()
    notes = LoadNotes(router, "me", [Wire()], ttl=30.0)
    wire = notes.transports[0]
    notes._on_raw(_old_note("routed", -1, D0, 16), transport=wire)
    notes._on_raw(_old_note("begin", 1, D1, 8), transport=wire)
    assert (notes.received, notes.malformed) == (2, 0)
    recent = _recent(router)
    assert recent[D0] == pytest.approx(16 * WEIGHTS.decay)
    assert recent[D1] == pytest.approx(8.0)
    assert router.loads[D1].inflight_requests == 1


@pytest.mark.parametrize("bad", [1, 0, "false", None, 1.0, [True]])
def test_a_note_whose_decays_is_not_a_boolean_is_malformed_and_changes_nothing(
    bad: object,
) -> None:
    """A ``decays`` that is not true or false drops the note, counted malformed; the same
    note with a boolean is applied."""
    router = _router()
    notes = LoadNotes(router, "me", [Wire()], ttl=30.0)
    wire: NoteTransport = notes.transports[0]
    router.record(router.route(list(range(64))))
    before = _recent(router)
    fields = ["peer", "begin", D0.worker, D0.dp_rank, 1, 16, 4.0, 30.0]
    notes._on_raw(msgspec.msgpack.encode([*fields, bad]), transport=wire)
    assert (notes.malformed, notes.received, notes.remote_inflight) == (1, 0, 0)
    assert _recent(router) == before and router.loads[D0].inflight_requests == 0
    notes._on_raw(msgspec.msgpack.encode([*fields, False]), transport=wire)
    assert (notes.malformed, notes.received, notes.remote_inflight) == (1, 1, 1)
    after = _recent(router)
    assert after[D0] == pytest.approx(before[D0] + 16, rel=1e-12)  # added, nothing faded
    assert all(after[h] == before[h] for h in HOLDERS if h != D0)


def test_a_begin_sent_again_does_not_fade_the_peers_recent_work() -> None:
    """The ``begin`` notes a router sends again for a newcomer carry no blocks and no
    decay: the peer counts the requests in flight, its recent work stays as it was."""

    async def main() -> None:
        router, peer = _router(), _router()
        out = Wire()
        notes = LoadNotes(router, "A", [out], ttl=30.0)
        peer_notes = LoadNotes(peer, "B", [Wire()], ttl=30.0)
        notes.start()
        try:
            tickets = [router.begin(router.route(p)) for p in PROMPTS[:3]]
            peer.record(peer.route(list(range(64))))
            before = _recent(peer)
            sent = len(out.sent)
            notes.apply(LoadNote("B", "routed", D0.worker, D0.dp_rank, -1, 0, 0.0, 30.0))
            again = [msgspec.msgpack.decode(raw, type=LoadNote) for raw in out.sent[sent:]]
            assert [(n.kind, n.n_blocks, n.decays) for n in again] == [("begin", 0, False)] * 3
            for note in again:
                peer_notes.apply(note)
            assert peer_notes.remote_inflight == 3
            assert sum(peer.loads[h].inflight_requests for h in HOLDERS) == len(tickets)
            assert _recent(peer) == before
        finally:
            await notes.close()
            await peer_notes.close()

    asyncio.run(main())


@pytest.mark.slow
def test_over_real_nats_a_pd_replicas_balance_matches_the_senders(plain: NatsServer) -> None:
    """Two replicas on a real nats-server: the one that hears a P/D replica's begins holds
    the same recent work per holder as the sender."""

    async def main() -> None:
        sender, receiver = _router(), _router()
        a_link = NatsNoteTransport(plain.url, "t.pd", reconnect_wait=0.2)
        b_link = NatsNoteTransport(plain.url, "t.pd", reconnect_wait=0.2)
        a = LoadNotes(sender, "A", [a_link], ttl=60.0)
        b = LoadNotes(receiver, "B", [b_link], ttl=60.0)
        a.start()
        b.start()
        try:
            await until(lambda: a_link.connected and b_link.connected, 10, "both on NATS")
            _route_pd(sender, "begin")
            await until(lambda: b.received == 2 * len(PROMPTS), 10, "every leg's note on B")
            assert b.malformed == 0 and b.remote_inflight == 2 * len(PROMPTS)
            assert _recent(receiver) == pytest.approx(_recent(sender), rel=1e-12)
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())
