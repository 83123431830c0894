"""Load notes across machines over NATS Core (``kvevents router --sync nats://HOST:PORT``).

Router replicas on different machines each follow every engine and keep their own index;
they share in-flight load, the :class:`~kvevents.router.fleet.peers.LoadNote` of
:mod:`kvevents.router.fleet.peers`, under one subject per router group (``--sync-subject``,
by default derived from the engines followed: :func:`default_subject`). NATS Core is
at-most-once, which is what the notes need: a lost note only ages out.

Trust: each replica publishes on ``<group subject>.<NAME>`` (:mod:`kvevents.router.fleet.senders`)
and hears ``<group subject>.*``; a note whose sender is not the subject's last token is
dropped, so NATS permissions per subject keep a credential from speaking for another
replica (docs/security.md). Credentials and TLS: :mod:`kvevents.router.fleet.sync_security`,
and a TLS connection is TLS or nothing (:mod:`kvevents.router.fleet.nats_link`).

The hot path never waits for NATS: :meth:`~NatsNoteTransport.send` appends to a bounded
queue; a task publishes everything queued ``batch_window`` seconds after the first note as
one message (a msgpack array of notes, or a lone note as itself: :func:`split_notes`),
because one nats-py publish costs a real share of a ``/route`` request's CPU and a
batch shares it. Notes a few milliseconds late change nothing: engines' load reports are
slower. While NATS is unreachable notes are dropped and counted, not buffered (stale
notes would arrive late), and :meth:`~NatsNoteTransport.status` says so; nats-py
reconnects by itself, and a silent connection is noticed by unanswered pings
(:data:`PING_INTERVAL`).

A replica that reads more slowly than peers publish loses messages in nats-py (a *slow
consumer*), and a lost ``finish`` or ``begin`` would skew the load until its ttl. Each
loss is counted (``missed``), and once the losses stop (:data:`RESYNC_DELAY`, at most
once a :data:`RESYNC_INTERVAL`) the replica drops the peers' load it heard over NATS and
says hello, so every peer sends its requests in flight again. Needs ``kvevents[sync]``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import ssl
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import DEFAULT_SUB_PENDING_MSGS_LIMIT

from kvevents.errors import ConfigError
from kvevents.router.fleet.nats_link import (
    check_url,
    open_client,
    shown_url,
    url_credentials,
)
from kvevents.router.fleet.peers import Deliver, cancel_and_wait
from kvevents.router.fleet.senders import check_bus_name
from kvevents.router.fleet.sync_security import SyncSecurity

__all__ = ["NatsNoteTransport", "default_subject", "shown_url", "split_notes"]

MAX_BATCH = 1000
"""Notes per NATS message at most (about 70 bytes each, far below NATS's 1 MB limit)."""

PING_INTERVAL = 2.0
"""Seconds between pings to NATS. A connection that went silent without closing (a
network partition: no FIN, no RST) is noticed only by pings that go unanswered; with
nats-py's default of 120 s a replica said ``connected`` for minutes while its notes went
nowhere. A ping is a few bytes each way."""

RESYNC_DELAY = 0.05
"""Seconds without a message dropped on the way in before the resync that makes up for
the ones that were: the rest of a burst is dropped before it, not after."""
RESYNC_INTERVAL = 1.0
"""Seconds at least between two resyncs (each one has every peer send its requests in
flight again), and at most from a drop to its resync while drops go on."""
MAX_OUTSTANDING_PINGS = 2
"""Pings unanswered before the connection is taken for dead and nats-py reconnects: a
silent one is noticed after 4 to 6 seconds, a busy server is not mistaken for a dead one."""

_BATCH_ENCODER = msgspec.msgpack.Encoder()
_BATCH_DECODER = msgspec.msgpack.Decoder(list[bytes])


def split_notes(payload: bytes) -> list[bytes]:
    """The encoded notes of one NATS message: a batch's elements, or the message itself."""
    try:
        return _BATCH_DECODER.decode(payload)
    except msgspec.DecodeError:  # one note (or garbage, which the note decoder counts)
        return [payload]


log = logging.getLogger("kvevents.router")


def default_subject(engines: Iterable[str]) -> str:
    """``kvevents.notes.<12 hex digits>``: one subject per set of engine URLs followed."""
    digest = hashlib.sha256("\n".join(sorted(set(engines))).encode()).hexdigest()
    return f"kvevents.notes.{digest[:12]}"


class NatsNoteTransport:
    """Notes over the NATS subjects of one router group; see the module docstring.

    ``subject``: the group's subject; each replica publishes on ``subject.NAME`` (set by
    :meth:`publish_as`) and hears ``subject.*``. ``security``: credentials and TLS
    (default: none). ``name``: the replica name given (``--sync-name``), or None.
    ``ignore_prefix``: senders whose notes arrive by another transport too (the other
    processes of this ``--workers`` group), dropped on receipt here.
    """

    def __init__(
        self,
        url: str,
        subject: str,
        *,
        security: SyncSecurity | None = None,
        name: str | None = None,
        ignore_prefix: str | None = None,
        reconnect_wait: float = 0.5,
        max_queue: int = 10_000,
        batch_window: float = 0.005,
        pending_limit: int | None = None,
    ) -> None:
        check_url(url)
        self.security = security = security or SyncSecurity()
        if security.auth is not None and url_credentials(url):
            raise ConfigError(
                f"--sync {shown_url(url)!r}: credentials both in the URL and in the --sync-* "
                "options; give them once, in the options"
            )
        self.require_tls = url.startswith("tls://") or security.tls_options
        """Whether a connection without TLS is refused (module docstring, "Trust")."""
        self.name = None if name is None else check_bus_name(name)
        if not subject or any(c in subject for c in " \t\r\n*>") or ".." in subject:
            raise ValueError(
                f"--sync-subject {subject!r}: a NATS subject is dot-separated tokens with "
                "no spaces or wildcards, e.g. kvevents.notes.fleet1"
            )
        self._connect_url = url
        self.url = shown_url(url)
        """The URL as shown (``/workers``, logs): credentials in it masked."""
        self.subject = subject
        self.publish_subject: str | None = None
        """``subject.NAME``: where this replica's notes go (:meth:`publish_as`)."""
        self.ignore_prefix = ignore_prefix
        self.reconnect_wait = reconnect_wait
        self.batch_window = batch_window
        self.batches = 0
        self.connected = False
        self.disconnects = 0
        self.reconnects = 0
        self.dropped = 0
        self.missed = 0
        """Peers' messages (one note, or a batch) NATS dropped before this replica read
        them (a slow consumer)."""
        self.resyncs = 0
        """Times this replica started again from its peers' requests in flight now,
        after notes were missed."""
        self.pending_limit = pending_limit
        """Messages the subscription holds unread before nats-py drops more (None: its
        default, half a million)."""
        self.last_error: str | None = None
        self._logged: str | None = None  # the last error logged, while it repeats
        self._url_auth = url_credentials(url)
        self._resync_at: asyncio.TimerHandle | None = None
        self._resync_due = 0.0  # when a resync must happen, drops or not (loop time)
        self._last_resync = float("-inf")
        self.on_link: Callable[[bool], None] | None = None
        """Called with False when the connection is lost, True when it is back
        (:class:`~kvevents.router.fleet.peers.LoadNotes` sets it)."""
        self._queue: collections.deque[bytes] = collections.deque(maxlen=max_queue)
        self._wake = asyncio.Event()
        self._nc: Client | None = None
        self._task: asyncio.Task[None] | None = None

    def publish_as(self, name: str) -> None:
        """Publish on ``subject.name``: ``name`` is the replica of this transport's sender
        (:func:`~kvevents.router.fleet.senders.bus_name`), what its receivers check."""
        self.publish_subject = f"{self.subject}.{check_bus_name(name, 'note sender name')}"

    def send(self, raw: bytes) -> bool:
        if not self.connected:
            self.dropped += 1
            return False
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1  # the oldest queued note gives way
        self._queue.append(raw)
        self._wake.set()
        return True

    def start(self, deliver: Deliver) -> None:
        if self.publish_subject is None:
            raise RuntimeError("NatsNoteTransport.publish_as(name) before start()")
        self._task = asyncio.get_running_loop().create_task(self._run(deliver))

    async def close(self) -> None:
        task, self._task = self._task, None
        with contextlib.suppress(Exception):  # _run logged and recorded every failure
            await cancel_and_wait(task)
        self.connected = False
        await self._drop_connection()
        if self._resync_at is not None:  # after the connection: it may have set one
            self._resync_at.cancel()
            self._resync_at = None

    def warnings(self) -> list[str]:
        """What this link leaves open, for the command to say at start (docs/security.md)."""
        said = []
        if not self.security.identified and not self._url_auth:
            said.append(
                f"--sync {self.url}: the NATS link has no credentials: whoever reaches this "
                "NATS server can read the group's load notes and publish notes that steer its "
                "routing. Give NATS credentials (--sync-user, --sync-token-file, "
                "--sync-nkey-seed-file or --sync-creds-file) and let each replica publish on "
                "its own subject only (docs/security.md)"
            )
        if self._url_auth:
            said.append(
                f"--sync {self.url}: credentials in the URL show in ps; give them with "
                "--sync-user and --sync-password-file (or $KVEVENTS_SYNC_PASSWORD), or "
                "--sync-token-file (or $KVEVENTS_SYNC_TOKEN)"
            )
        if not self.require_tls and (self._url_auth or self.security.auth in ("user", "token")):
            said.append(
                f"--sync {self.url}: no TLS, so the NATS password or token crosses the network "
                "in plain text; use a tls:// URL (and --sync-ca-certs for a private CA)"
            )
        return said

    def status(self) -> dict[str, Any]:
        """For ``/workers`` (``process.sync``) and ``/metrics``."""
        return {
            "url": self.url,
            "subject": self.subject,
            "publish_subject": self.publish_subject,
            "tls": self.require_tls,
            "auth": self.security.auth or ("url" if self._url_auth else None),
            "connected": self.connected,
            "disconnects": self.disconnects,
            "reconnects": self.reconnects,
            "dropped": self.dropped,
            "missed": self.missed,
            "resyncs": self.resyncs,
            "batches": self.batches,
            "last_error": self.last_error,
        }

    # --- the task ---------------------------------------------------------------------

    async def _run(self, deliver: Deliver) -> None:
        """Connect and publish for ever. nats-py retries a lost connection by itself; a
        failure it raises instead (from connecting or subscribing: a TLS or an auth
        setting it refuses) is logged and shown in :meth:`status`, and everything starts
        again after a wait that doubles up to a minute, so it is neither silent nor a
        tight loop."""
        wait = self.reconnect_wait
        while True:
            try:
                await self._session(deliver)
            except Exception as exc:  # any failure: say so, and try again
                if self.connected:
                    self.connected = False
                    self._link(False)
                self.last_error = shown_url(f"{type(exc).__name__}: {exc}")
                log.error(
                    "NATS %s: %s; routing without the other replicas' load, trying again in %.1f s",
                    self.url,
                    self.last_error,
                    wait,
                )
                await self._drop_connection()
                await asyncio.sleep(wait)
                wait = min(wait * 2, 60.0)

    def _report(self, exc: Exception) -> None:
        """What nats-py reported (every failed attempt, and errors from the server): shown
        in :meth:`status`; logged as an error once while it repeats, unless the server is
        merely unreachable (its disconnection was logged)."""
        self.last_error = shown_url(f"{type(exc).__name__}: {exc}")
        unreachable = isinstance(exc, (OSError, asyncio.TimeoutError)) and not isinstance(
            exc, ssl.SSLError
        )
        if unreachable or self.last_error == self._logged:
            log.debug("NATS %s: %s", self.url, self.last_error)
            return
        self._logged = self.last_error
        alone = (
            "" if self.connected else "; routing without the other replicas' load until it connects"
        )
        log.error("NATS %s: %s%s", self.url, self.last_error, alone)

    def _link(self, up: bool) -> None:
        if self.on_link is not None:
            self.on_link(up)

    def _missed_one(self) -> None:
        """NATS dropped a message on its way in: count it, and resync once the drops stop
        (see the module docstring)."""
        self.missed += 1
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._resync_at is None:
            self._resync_due = now + RESYNC_INTERVAL
        else:
            self._resync_at.cancel()
        at = max(min(now + RESYNC_DELAY, self._resync_due), self._last_resync + RESYNC_INTERVAL)
        self._resync_at = loop.call_at(at, self._resync)

    def _resync(self) -> None:
        """Start again from the peers' requests in flight now (see the module docstring)."""
        self._resync_at = None
        if not self.connected or self._task is None:
            return  # the connection coming back says hello itself; or closing
        self._last_resync = asyncio.get_running_loop().time()
        self.resyncs += 1
        self.last_error = "nats: slow consumer, messages dropped"
        log.warning(
            "NATS %s: %d messages of peer load notes missed so far (this replica read them "
            "too slowly); asking the peers for their requests in flight again",
            self.url,
            self.missed,
        )
        self._link(False)
        self._link(True)

    async def _drop_connection(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(nats.errors.Error, OSError, asyncio.TimeoutError):
                await asyncio.wait_for(nc.close(), timeout=2.0)

    async def _session(self, deliver: Deliver) -> None:
        async def on_message(msg: Msg) -> None:
            origin = msg.subject.rpartition(".")[2]  # the replica it came from: subject.NAME
            for raw in split_notes(msg.data):
                deliver(raw, origin)

        async def on_error(exc: Exception) -> None:
            if isinstance(exc, nats.errors.SlowConsumerError):
                self._missed_one()  # one per message dropped: kept cheap
                return
            self._report(exc)

        async def on_disconnected() -> None:
            if self.connected:
                self.disconnects += 1
                log.warning(
                    "NATS %s unreachable: routing without the other replicas' load", self.url
                )
                self.connected = False
                self._link(False)

        async def on_reconnected() -> None:
            self.reconnects += 1
            self.connected = True
            log.warning("NATS %s reachable again: sharing load notes", self.url)
            self._link(True)

        # max_reconnect_attempts=-1 retries the first connection too, for ever, so a
        # replica started before NATS joins once it is up; pending_size=0: no buffering
        # while disconnected (a publish then fails, and the note is counted as dropped).
        self._nc = nc = await open_client(
            self._connect_url,
            self.security,
            require_tls=self.require_tls,
            name="kvevents-router",
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=self.reconnect_wait,  # seconds
            connect_timeout=2,
            ping_interval=PING_INTERVAL,
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            pending_size=0,
            no_echo=True,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
        )
        limit = DEFAULT_SUB_PENDING_MSGS_LIMIT if self.pending_limit is None else self.pending_limit
        await nc.subscribe(f"{self.subject}.*", cb=on_message, pending_msgs_limit=limit)
        self.connected = True
        self._logged = None
        log.info("NATS %s: sharing load notes on %s.*", self.url, self.subject)
        subject = self.publish_subject
        assert subject is not None, "start() checked it"
        self._link(True)  # the first connection too: peers then tell it what is in flight
        queue = self._queue
        while True:
            await self._wake.wait()
            if self.batch_window > 0:
                await asyncio.sleep(self.batch_window)  # let the notes of a burst gather
            self._wake.clear()
            while queue:
                batch = [queue.popleft() for _ in range(min(len(queue), MAX_BATCH))]
                payload = batch[0] if len(batch) == 1 else _BATCH_ENCODER.encode(batch)
                try:
                    await nc.publish(subject, payload)
                    self.batches += 1
                except (nats.errors.Error, OSError) as exc:
                    self.dropped += len(batch)
                    self.last_error = shown_url(f"{type(exc).__name__}: {exc}")
