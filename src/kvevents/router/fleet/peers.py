"""Load notes between router processes, so N routers balance like one.

Each router process keeps its own index, but the load terms of the cost
(:mod:`kvevents.router.decide.scoring`) are about *requests*, which each sees only for
itself. So every process tells the others, in a note, each request it routes and ends:
``routed`` (a ``/route`` with ``record``: the holder's recent work grows), ``begin`` (a
forwarded request: recent work grows and its uncached blocks are in flight until its
``finish``), ``finish`` (answered or failed). A ``routed`` or ``begin`` note also says
whether its decision advanced the decay of every holder's recent work (``decays``: false
for P/D's prefill choice, whose decode choice advanced it), so recent work fades here
once per request, as it does on the sender.

What a note does is :class:`LoadNotes`; how it travels is a :class:`NoteTransport`.
Within one ``--workers`` group: ZeroMQ PUB/SUB over ``ipc://`` sockets in a folder the
parent makes (:class:`ZmqNoteTransport`, :class:`PeerNotes`), a non-blocking send on the
hot path; across machines, NATS (:mod:`kvevents.router.fleet.nats_sync`).

Best effort, never double-counted: every ``begin`` carries a ``ttl`` after which it is
dropped even without its ``finish``, so a dead peer's load goes with it; a duplicated
``begin`` or ``routed``, a ``finish`` without its ``begin`` and a ``begin`` after its
``finish`` change nothing. A process ignores its own notes. A note with a negative count
or rank, non-finite blocks, more than one request can carry, a ``decays`` that is not a
boolean, or a ``begin`` past :data:`MAX_PEER_INFLIGHT` is counted ``malformed`` and
ignored; so is one whose sender is not of the replica it came from
(:func:`~kvevents.router.fleet.senders.bus_name`), so nobody speaks, or says ``hello``,
for a replica but that replica.

Restarts and lost links: a sender id names its seat and run, ``SEAT#RUN``
(:mod:`kvevents.router.fleet.senders`). A new run's first note drops the in-flight
requests of the seat's previous run (they will never finish); a sender never heard
before makes this process send ``begin`` again for each request it has in flight. A
transport that loses its link (:class:`SyncTransport`'s ``on_link``) makes this router
drop the peers' requests heard over it (``reset``); once it is up, this router says
``hello`` and sends its ``begin`` notes again, and a peer hearing ``hello`` from a known
sender drops that sender's requests and sends its own again, so both sides count what is
in flight now.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import msgspec
import zmq
import zmq.asyncio

from kvevents.router.decide.router import NoteKind, Router, Ticket
from kvevents.router.fleet.senders import bus_name, machine_seat, seat_of, sender_id, started_at
from kvevents.types import Holder

__all__ = [
    "DEFAULT_MAX_REQUEST_TOKENS",
    "DEFAULT_NOTE_TTL",
    "MAX_DP_RANK",
    "MAX_PEER_INFLIGHT",
    "Deliver",
    "LoadNote",
    "LoadNotes",
    "NoteTransport",
    "PeerNotes",
    "SyncTransport",
    "WireKind",
    "ZmqNoteTransport",
    "cancel_and_wait",
    "machine_seat",
    "sender_id",
]


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task (None: nothing to do) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


log = logging.getLogger("kvevents.router")

DEFAULT_NOTE_TTL = 300.0
"""Seconds a peer's in-flight request counts without its ``finish`` (a lost note ages out)."""
DEFAULT_MAX_REQUEST_TOKENS = 16 * 1024 * 1024
"""Tokens one request can carry when not told (:class:`LoadNotes`): the router's default
``--max-body-bytes``, as a token takes at least a byte of body (a token id two, ``1,``;
a byte-level tokenizer's token one). A note claims at most this many, in blocks."""
MAX_PEER_INFLIGHT = 100_000
"""Requests one peer replica (all its ``--workers`` processes) may have counted in flight
here; a ``begin`` past it is malformed. Far above what a router forwards at once."""
MAX_DP_RANK = 65_535
"""The largest data-parallel rank a note may name (a rank past it is malformed)."""


WireKind = Literal["routed", "begin", "finish", "hello"]
"""A note's kind: a :data:`~kvevents.router.decide.router.NoteKind`, or ``hello`` (a sender back on
a link it lost: see the module docstring; its holder and numbers are zero)."""


class LoadNote(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One note on the wire: who sent it, what happened, to which holder.

    A msgpack array, positional: ``[sender, kind, worker, dp_rank, ticket, n_blocks,
    inflight_blocks, ttl, decays]``; ``sender`` the sender id
    (:mod:`~kvevents.router.fleet.senders`), ``kind`` a :data:`WireKind`, ``worker`` and
    ``dp_rank`` the holder, ``ticket`` the request's id within the sender (negative for a
    ``routed`` note), ``n_blocks`` its prompt blocks, ``inflight_blocks`` its uncached
    blocks (a ``begin``), ``ttl`` seconds it counts in flight without its ``finish``,
    ``decays`` whether its decision advanced the decay of recent work (a boolean).
    Fields are only ever appended, with a default for notes of older senders (which
    lack ``decays``: it advances); older receivers ignore the fields they do not know.
    """

    sender: str
    kind: WireKind
    worker: str
    dp_rank: int
    ticket: int
    n_blocks: int
    inflight_blocks: float
    ttl: float
    decays: bool = True


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(LoadNote)


def _in_range(note: LoadNote) -> bool:
    """Whether a decoded note's numbers are ones a router sends (the decoder checks only
    their types). A negative or non-finite count would not cancel out: the in-flight
    board clamps at 0, so a begin of -40 blocks and its finish leave +40 for ever, one
    of inf blocks wipes the holder's own in-flight blocks (inf - inf), and a negative
    ``n_blocks`` makes a holder's recent work negative, so it draws traffic."""
    blocks = note.inflight_blocks
    return note.n_blocks >= 0 and note.dp_rank >= 0 and 0.0 <= blocks < math.inf


def _within(note: LoadNote, max_blocks: int) -> bool:
    """Whether an in-range note claims no more than one request carries: a note of
    10**12 blocks, applied, counted for its whole ttl and pushed every request away from
    its holder. (A ``begin`` is bounded per replica too: :data:`MAX_PEER_INFLIGHT`.)"""
    return (
        note.n_blocks <= max_blocks
        and note.inflight_blocks <= max_blocks
        and note.dp_rank <= MAX_DP_RANK
    )


Deliver = Callable[[bytes, "str | None"], None]
"""How a transport hands on one raw note, with its origin: the replica name it came from
(the NATS subject's last token; the note's sender must be of it), or None where the
transport itself vouches for its senders (the ``--workers`` group's ipc sockets)."""


class NoteTransport(Protocol):
    """How notes travel: a non-blocking send, and a receiver started on the event loop."""

    ignore_prefix: str | None
    """Notes from senders starting with this are dropped on receipt (they arrive by
    another transport too); None: none are."""

    def send(self, raw: bytes) -> bool:
        """Queue one encoded note without waiting; False when it was dropped."""
        ...

    def start(self, deliver: Deliver) -> None:
        """Begin receiving (on the running event loop): ``deliver`` gets each raw note."""
        ...

    async def close(self) -> None:
        """Stop receiving and release the transport. Idempotent."""
        ...


class SyncTransport(NoteTransport, Protocol):
    """A transport that reports its connection (NATS), for ``/workers`` and ``/metrics``."""

    on_link: Callable[[bool], None] | None
    """Set by :class:`LoadNotes`: called with False when the connection is lost, True when
    it is up (the first connection too)."""

    name: str | None
    """The replica name given (``--sync-name``), or None: the command picks one."""

    def publish_as(self, name: str) -> None:
        """Send under replica ``name`` (:class:`LoadNotes` calls it before :meth:`start`
        with its sender's :func:`~kvevents.router.fleet.senders.bus_name`)."""
        ...

    def status(self) -> dict[str, Any]:
        """At least ``connected`` (bool) and ``dropped`` (notes not sent)."""
        ...


class ZmqNoteTransport:
    """ZeroMQ PUB/SUB: bind ``own``, connect to every endpoint of ``peers``."""

    ignore_prefix: str | None = None

    def __init__(
        self, own: str, peers: Sequence[str], *, context: zmq.asyncio.Context | None = None
    ) -> None:
        ctx = context or zmq.asyncio.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(own)
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        for endpoint in peers:
            self._sub.connect(endpoint)
        self._task: asyncio.Task[None] | None = None

    def send(self, raw: bytes) -> bool:
        try:
            self._pub.send(raw, zmq.NOBLOCK)
        except zmq.Again:  # a full queue drops the note: best effort
            return False
        return True

    def start(self, deliver: Deliver) -> None:
        self._task = asyncio.get_running_loop().create_task(self._receive(deliver))

    async def _receive(self, deliver: Deliver) -> None:
        while True:
            deliver(await self._sub.recv(), None)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        self._pub.close()
        self._sub.close()


class LoadNotes:
    """Send this router's notes on every transport; apply the others' to ``router``.

    ``sender``: this router's id, unique across every router that shares notes.
    ``follows``: whether a note's engine (its ``worker``) is one this router follows;
    notes about others are counted as ``foreign`` and ignored (None: every engine).
    ``max_request_tokens``: the most tokens one request carries (the router's
    ``--max-body-bytes``); a note claiming more blocks than that makes at the router's
    block size is malformed. ``clock`` is injectable for tests. Not thread-safe: one
    event loop.
    """

    def __init__(
        self,
        router: Router,
        sender: str,
        transports: Sequence[NoteTransport],
        *,
        ttl: float = DEFAULT_NOTE_TTL,
        clock: Callable[[], float] = time.monotonic,
        follows: Callable[[str], bool] | None = None,
        max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
    ) -> None:
        if not ttl > 0:
            raise ValueError(f"note ttl={ttl!r}: must be a positive number of seconds")
        if max_request_tokens < 1:
            raise ValueError(f"max_request_tokens={max_request_tokens!r}: must be at least 1")
        self.router = router
        self.sender = sender
        self.name = bus_name(sender)
        """This router's replica name: what its NATS subject ends with."""
        self.max_request_tokens = max_request_tokens
        self.transports = list(transports)
        self.ttl = ttl
        self.clock = clock
        self.follows = follows
        self.sent = 0
        self.dropped = 0
        self.received = 0
        self.duplicates = 0
        self.malformed = 0
        """Notes that do not decode, whose numbers are out of range, or that speak for
        another replica than the one they came from, ignored."""
        self.forged = 0
        """Of the malformed: notes whose sender is not of the replica whose NATS subject
        they came on, or that came on this replica's own subject from another process."""
        self.oversized = 0
        """Of the malformed: notes claiming more than one request carries (blocks, rank),
        or a ``begin`` past :data:`MAX_PEER_INFLIGHT` of its replica."""
        self.expired = 0
        self.foreign = 0
        """Notes about holders this router does not follow (another group's engines on a
        shared ``--sync-subject``), ignored."""
        self.superseded = 0
        """Peers' in-flight requests dropped, and notes ignored, because a later run of
        their sender's seat spoke (the sender was restarted)."""
        self.resent = 0
        """``begin`` notes sent again for a sender heard for the first time, or back on a
        link (its ``hello``, or this router's own link back)."""
        self.reset = 0
        """Peers' in-flight requests dropped because the link they were heard on went down
        or resynced (notes it dropped on the way in), or their sender said ``hello`` (it
        sends again those still in flight)."""
        self._heard_on: dict[str, NoteTransport] = {}  # sender -> the transport it came by
        self._senders: set[str] = {sender}
        self._seats: dict[str, str] = {}  # seat -> the latest sender heard in it
        self._gone: set[str] = set()  # senders a later run of their seat superseded
        self._own: dict[int, tuple[Ticket, int]] = {}  # this router's requests in flight
        self._remote: dict[tuple[str, int], tuple[Holder, float, float]] = {}
        self._held: dict[str, int] = {}  # replica name -> its entries in _remote
        self._warned: set[str] = set()  # origins of forged notes logged (at most 100)
        # notes already applied whose duplicates must change nothing: key -> forget after
        self._done: dict[tuple[str, int], float] = {}
        # when each entry of both is due, earliest first: (until, key, in _remote); an
        # entry removed or renewed since leaves its line here, skipped when it comes up
        self._due: list[tuple[float, tuple[str, int], bool]] = []
        self._routed_ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._next_sweep = clock() + 1.0
        router.note_listeners.append(self._local)

    # --- sending ----------------------------------------------------------------------

    def _local(
        self,
        kind: NoteKind,
        holder: Holder,
        n_blocks: int,
        ticket: Ticket | None,
        decays: bool = True,
    ) -> None:
        if ticket is not None:
            if kind == "begin":
                self._own[ticket.id] = (ticket, n_blocks)
            else:
                self._own.pop(ticket.id, None)
        self._send(kind, holder, n_blocks, ticket, decays)

    def _send(
        self,
        kind: NoteKind,
        holder: Holder,
        n_blocks: int,
        ticket: Ticket | None,
        decays: bool = True,
    ) -> None:
        raw = self._encode(kind, holder, n_blocks, ticket, decays)
        went = False
        for transport in self.transports:
            if transport.send(raw):
                went = True
            else:
                self.dropped += 1  # per transport that refused it
        self.sent += went

    def _encode(
        self,
        kind: NoteKind,
        holder: Holder,
        n_blocks: int,
        ticket: Ticket | None,
        decays: bool = True,
    ) -> bytes:
        note = LoadNote(
            self.sender,
            kind,
            holder.worker,
            holder.dp_rank,
            -next(self._routed_ids) if ticket is None else ticket.id,
            n_blocks,
            0.0 if ticket is None else ticket.blocks,
            self.ttl,
            decays,
        )
        return _ENCODER.encode(note)

    # --- receiving --------------------------------------------------------------------

    def start(self) -> None:
        for transport in self.transports:
            publish_as = getattr(transport, "publish_as", None)
            if publish_as is not None:  # a SyncTransport: it publishes under our name
                publish_as(self.name)
            transport.start(functools.partial(self._on_raw, transport=transport))
            if hasattr(transport, "on_link"):  # a SyncTransport: it can lose its connection
                transport.on_link = functools.partial(self._on_link, transport=transport)
        self._task = asyncio.get_running_loop().create_task(self._sweep())

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        with contextlib.suppress(ValueError):
            self.router.note_listeners.remove(self._local)
        for transport in self.transports:
            await transport.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.expire()

    def _on_raw(self, raw: bytes, origin: str | None = None, *, transport: NoteTransport) -> None:
        try:
            note = _DECODER.decode(raw)
        except msgspec.DecodeError:  # and a field of the wrong type: ``decays`` of 1, nil
            self.malformed += 1
            return
        if origin is not None and bus_name(note.sender) != origin:
            self._forged(note, origin, "a note speaks only for the replica it came from")
            return
        prefix = transport.ignore_prefix
        if prefix is not None and note.sender.startswith(prefix):
            return
        if origin == self.name:  # not ours (NATS does not echo them) nor our group's
            self._forged(note, origin, "another router uses this replica's name")
            return
        self.apply(note, transport)

    def _forged(self, note: LoadNote, origin: str, why: str) -> None:
        """Drop a note that speaks for a replica it did not come from (module docstring,
        "Who a note speaks for"); log the first from each origin."""
        self.malformed += 1
        self.forged += 1
        if origin not in self._warned and len(self._warned) < 100:
            self._warned.add(origin)
            log.warning(
                "load notes: a note from replica %r claims sender %r, dropped (%s; give each "
                "replica its own --sync-name and NATS credentials, docs/security.md)",
                origin,
                note.sender,
                why,
            )

    def apply(self, note: LoadNote, via: NoteTransport | None = None) -> None:
        """Apply one peer note to the router's loads, once (own notes are ignored).
        ``via``: the transport it came by (what a lost link drops; ``hello`` answered on)."""
        if not _in_range(note):
            self.malformed += 1
            return
        block_size = self.router.index.block_size or 1  # unknown yet: the loosest bound
        if not _within(note, -(-self.max_request_tokens // block_size)) or (
            note.kind == "begin" and self._held.get(bus_name(note.sender), 0) >= MAX_PEER_INFLIGHT
        ):
            self.malformed += 1
            self.oversized += 1
            return
        if note.sender not in self._senders:
            if note.sender in self._gone or not self._new_sender(note.sender):
                self.superseded += 1  # a dead run's note, late
                return
        elif note.sender == self.sender:
            return
        elif note.kind == "hello":  # a known sender back on a link it lost
            self.reset += self._drop_from(lambda sender: sender == note.sender)
            self._resend_own(via)
        if via is not None:
            self._heard_on[note.sender] = via
        if note.kind == "hello":
            return
        self.received += 1
        follows = self.follows
        if follows is not None and not follows(note.worker):  # another group's engine
            self.foreign += 1
            return
        holder = Holder(note.worker, note.dp_rank)
        key = (note.sender, note.ticket)
        now = self.clock()
        if key in self._done or (note.kind == "begin" and key in self._remote):
            self.duplicates += 1
            return
        # the sender's time-to-live, but never longer than ours (nor NaN, infinite or <= 0)
        until = now + (min(note.ttl, self.ttl) if note.ttl > 0 else self.ttl)
        if note.kind == "routed":
            self.router.remote_routed(holder, note.n_blocks, decays=note.decays)
            self._forget_at(key, until)
        elif note.kind == "begin":
            self.router.remote_routed(holder, note.n_blocks, decays=note.decays)
            self.router.remote_inflight(holder, 1, note.inflight_blocks)
            self._remote[key] = (holder, note.inflight_blocks, until)
            name = bus_name(note.sender)
            self._held[name] = self._held.get(name, 0) + 1
            heapq.heappush(self._due, (until, key, True))
        elif note.kind == "finish":
            held = self._remote.pop(key, None)
            if held is not None:
                self._release(note.sender)
                self.router.remote_inflight(held[0], -1, -held[1])
            self._forget_at(key, until)  # a late begin, or a duplicate, changes nothing
        if now >= self._next_sweep:
            self.expire()

    def _new_sender(self, sender: str) -> bool:
        """A sender heard for the first time: drop what an earlier run of its seat left
        in flight, and tell it of this router's own requests in flight. False (and the
        sender is remembered as gone) when it is itself an earlier run of its seat than
        the one heard there: a dead run whose notes come late."""
        seat = seat_of(sender)
        if seat is not None:
            earlier = self._seats.get(seat)
            if earlier is not None:
                then, now = started_at(earlier), started_at(sender)
                if then is not None and now is not None and now < then:
                    self._gone.add(sender)
                    return False
            self._seats[seat] = sender
            if earlier is not None:
                self.superseded += self._drop_from(lambda s: s == earlier)
                self._senders.discard(earlier)
                self._gone.add(earlier)
        self._senders.add(sender)
        self._resend_own(None)
        return True

    def _on_link(self, up: bool, transport: NoteTransport) -> None:
        """``transport`` lost its connection (False) or has it back (True): see the module
        docstring, "A lost link"."""
        if not up:
            dropped = self._drop_from(lambda sender: self._heard_on.get(sender) is transport)
            self.reset += dropped
            if dropped:
                log.info(
                    "load notes: link lost or resynced, %d peer requests in flight heard "
                    "over it dropped (its peers send those still in flight again)",
                    dropped,
                )
            return
        hello = LoadNote(self.sender, "hello", "", 0, 0, 0, 0.0, self.ttl)
        if transport.send(_ENCODER.encode(hello)):
            self._resend_own(transport)

    def _drop_from(self, senders: Callable[[str], bool]) -> int:
        """Drop the peers' in-flight requests of the ``senders`` that match, not remembered
        as done (a ``begin`` sent again counts anew); how many (the caller counts them)."""
        keys = [key for key in self._remote if senders(key[0])]
        for key in keys:
            holder, blocks, _ = self._remote.pop(key)
            self._release(key[0])
            self.router.remote_inflight(holder, -1, -blocks)
        return len(keys)

    def _release(self, sender: str) -> None:
        """One in-flight request of ``sender`` no longer counted (:data:`MAX_PEER_INFLIGHT`)."""
        name = bus_name(sender)
        left = self._held[name] - 1
        if left:
            self._held[name] = left
        else:
            del self._held[name]

    def _resend_own(self, via: NoteTransport | None) -> None:
        """``begin`` again for each request this router has in flight: on ``via`` only (a
        peer back on it), or on every transport (None). With no blocks routed and no decay:
        they count in flight again, not as a second routing in the holders' recent work."""
        for ticket, _ in list(self._own.values()):
            if via is None:
                self._send("begin", ticket.holder, 0, ticket, decays=False)
            elif not via.send(self._encode("begin", ticket.holder, 0, ticket, decays=False)):
                self.dropped += 1
            self.resent += 1

    def _forget_at(self, key: tuple[str, int], until: float) -> None:
        self._done[key] = until
        heapq.heappush(self._due, (until, key, False))

    def expire(self) -> None:
        """Drop peers' in-flight requests whose time-to-live has passed."""
        now = self.clock()
        self._next_sweep = now + 1.0
        due = self._due
        while due and due[0][0] <= now:  # O(entries due), not a walk over all of them
            until, key, in_flight = heapq.heappop(due)
            if not in_flight:
                if self._done.get(key) == until:
                    del self._done[key]
                continue
            held = self._remote.get(key)
            if held is None or held[2] != until:
                continue  # finished since
            del self._remote[key]
            self._release(key[0])
            self.router.remote_inflight(held[0], -1, -held[1])
            self.expired += 1
            self._forget_at(key, now + self.ttl)

    @property
    def remote_inflight(self) -> int:
        """Peers' requests now counted in flight on this router's holders."""
        return len(self._remote)

    def summary(self) -> dict[str, int]:
        """The counters, for ``/workers`` and ``/metrics``."""
        return {
            "sent": self.sent,
            "dropped": self.dropped,
            "received": self.received,
            "duplicates": self.duplicates,
            "malformed": self.malformed,
            "forged": self.forged,
            "oversized": self.oversized,
            "expired": self.expired,
            "foreign": self.foreign,
            "superseded": self.superseded,
            "resent": self.resent,
            "reset": self.reset,
            "peer_inflight": self.remote_inflight,
        }


class PeerNotes(LoadNotes):
    """Notes between the processes of one ``--workers`` group, over ipc PUB/SUB.

    ``own``: this process's PUB endpoint (bound); ``peers``: the others' (connected);
    ``extra``: further transports (NATS, ``--sync``).
    """

    def __init__(
        self,
        router: Router,
        sender: str,
        own: str,
        peers: Sequence[str],
        *,
        ttl: float = DEFAULT_NOTE_TTL,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
        extra: Sequence[NoteTransport] = (),
        follows: Callable[[str], bool] | None = None,
        max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
    ) -> None:
        transport = ZmqNoteTransport(own, peers, context=context)
        super().__init__(
            router,
            sender,
            [transport, *extra],
            ttl=ttl,
            clock=clock,
            follows=follows,
            max_request_tokens=max_request_tokens,
        )
