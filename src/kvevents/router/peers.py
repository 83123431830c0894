"""Load notes between router processes, so N routers balance like one.

Each router process keeps its own index (every one follows every engine's streams), but
the load terms of the cost (:mod:`kvevents.router.scoring`) are about *requests*, which
each process sees only for itself. So every process tells the others, in a note, each
request it routes and each that ends:

* ``routed``: a decision someone else forwards (``/route`` with ``record``): the
  holder's ``recent`` work grows by the prompt's blocks, as for a local decision;
* ``begin``: a request this process forwards: ``recent`` grows, and the request's
  uncached blocks are in flight on the holder until its ``finish`` note;
* ``finish``: the forwarded request ended (answered or failed).

Transport: ZeroMQ PUB/SUB over ``ipc://`` sockets in a folder the parent process makes
(one PUB per process, bound; one SUB per process, connected to every other), so notes
never leave the machine and cost a non-blocking send on the hot path. Best effort: a
note that is lost only leaves load that ages out, because every ``begin`` carries a
time-to-live (``ttl``) after which the receiver drops it even without a ``finish``; so a
peer that dies takes its in-flight load with it after at most ``ttl`` seconds. A process
ignores its own notes, and a ``finish`` whose ``begin`` it never saw changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import msgspec
import zmq
import zmq.asyncio

from kvevents.router.core import NoteKind, Router, Ticket
from kvevents.types import Holder

__all__ = ["DEFAULT_NOTE_TTL", "LoadNote", "PeerNotes"]

log = logging.getLogger("kvevents.router")

DEFAULT_NOTE_TTL = 300.0
"""Seconds a peer's in-flight request counts without its ``finish`` (a lost note ages out)."""


class LoadNote(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One note on the wire (msgpack array): who sent it, what happened, to which holder."""

    sender: str
    kind: NoteKind
    worker: str
    dp_rank: int
    ticket: int
    n_blocks: int
    inflight_blocks: float
    ttl: float


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(LoadNote)


class PeerNotes:
    """Send this process's notes and apply the other processes' to ``router``.

    ``own``: this process's PUB endpoint (bound); ``peers``: the others' (connected).
    ``clock`` is injectable for tests. Not thread-safe: one event loop.
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
    ) -> None:
        if not ttl > 0:
            raise ValueError(f"note ttl={ttl!r}: must be a positive number of seconds")
        self.router = router
        self.sender = sender
        self.ttl = ttl
        self.clock = clock
        self.sent = 0
        self.received = 0
        self.malformed = 0
        self.expired = 0
        self._ctx = context or zmq.asyncio.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(own)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        for endpoint in peers:
            self._sub.connect(endpoint)
        self._remote: dict[tuple[str, int], tuple[Holder, float, float]] = {}
        self._task: asyncio.Task[None] | None = None
        self._next_sweep = clock() + 1.0
        router.note_listeners.append(self._local)

    # --- sending ----------------------------------------------------------------------

    def _local(self, kind: NoteKind, holder: Holder, n_blocks: int, ticket: Ticket | None) -> None:
        note = LoadNote(
            self.sender,
            kind,
            holder.worker,
            holder.dp_rank,
            0 if ticket is None else ticket.id,
            n_blocks,
            0.0 if ticket is None else ticket.blocks,
            self.ttl,
        )
        with contextlib.suppress(zmq.Again):  # a full queue drops the note: best effort
            self._pub.send(_ENCODER.encode(note), zmq.NOBLOCK)
            self.sent += 1

    # --- receiving --------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._receive())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(ValueError):
            self.router.note_listeners.remove(self._local)
        self._pub.close()
        self._sub.close()

    async def _receive(self) -> None:
        while True:
            try:
                raw = await asyncio.wait_for(self._sub.recv(), timeout=1.0)
            except asyncio.TimeoutError:
                self.expire()
                continue
            try:
                note = _DECODER.decode(raw)
            except msgspec.DecodeError:
                self.malformed += 1
                continue
            self.apply(note)

    def apply(self, note: LoadNote) -> None:
        """Apply one peer note to the router's loads (own notes are ignored)."""
        if note.sender == self.sender:
            return
        self.received += 1
        holder = Holder(note.worker, note.dp_rank)
        key = (note.sender, note.ticket)
        if note.kind == "routed":
            self.router.remote_routed(holder, note.n_blocks)
        elif note.kind == "begin":
            if key in self._remote:
                return  # a duplicate
            self.router.remote_routed(holder, note.n_blocks)
            self.router.remote_inflight(holder, 1, note.inflight_blocks)
            self._remote[key] = (holder, note.inflight_blocks, self.clock() + note.ttl)
        elif note.kind == "finish":
            held = self._remote.pop(key, None)
            if held is not None:
                self.router.remote_inflight(held[0], -1, -held[1])
        if self.clock() >= self._next_sweep:
            self.expire()

    def expire(self) -> None:
        """Drop peers' in-flight requests whose time-to-live has passed."""
        now = self.clock()
        self._next_sweep = now + 1.0
        stale = [k for k, (_, _, until) in self._remote.items() if until <= now]
        for key in stale:
            holder, blocks, _ = self._remote.pop(key)
            self.router.remote_inflight(holder, -1, -blocks)
            self.expired += 1

    @property
    def remote_inflight(self) -> int:
        """Peers' requests now counted in flight on this router's holders."""
        return len(self._remote)
