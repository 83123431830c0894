"""Sequence tracking for one stream: a pure state machine, no sockets, no clock.

A :class:`StreamTracker` is fed what arrived (live messages, replay replies, the replay
end marker, a replay timeout, connection events) and answers with actions for the
socket loop: deliver this payload, send this signal, ask for a replay from this seq.
Keeping it free of sockets and time is what lets every transition be tested alone.

Invariants
----------
* ``last`` is the seq of the last payload handed out (delivered, or reported lost);
  ``-1`` before the first. Deliveries strictly increase and never skip a seq silently:
  every seq between two deliveries is covered by a :class:`Loss`.
* While a replay is outstanding, live messages are buffered in arrival order (at most
  ``max_pending``; overflowing abandons the replay and reports its gap lost) and handed
  out after it ends, so nothing newer overtakes the missed batches.
* Every replay makes progress or ends the gap: a replay that twice delivers nothing has
  its remaining gap reported lost, a timed-out one is asked again a bounded number of
  times, and a gap is signalled once however often it is asked for.
* A gap at the end of a burst, or batches published before the SUB's subscription took
  effect, show no symptom; so a quiet stream (:meth:`StreamTracker.probe`) and a
  connection that comes up (:meth:`StreamTracker.on_connected`) ask for a replay from
  ``last + 1``. A live message arriving meanwhile cancels the probe, so probing never
  holds live messages back.

Restart detection
-----------------
* Live seqs from one publisher only grow: a live seq at or below the highest seen live
  (``live_high``) is a new publisher, a :class:`Reset` at once (buffered live messages
  are the old one's and are dropped). One above ``live_high`` but at or below ``last`` is
  the late live copy of a replayed batch, and is skipped.
* After a reconnect a restarted engine may already be past ``last``. With a replay
  endpoint the tracker replays its last delivered batch (the anchor) and compares it byte
  for byte: different, or gone from an empty buffer, is a reset. The limits: an anchor
  no longer buffered cannot be checked (what was skipped is a :class:`Loss`); without
  replay, a forward jump after a reconnect is a :class:`Loss`, and continuing exactly at
  ``last + 1`` is taken as the same publisher; a restarted publisher whose batch at the
  anchor's seq is byte-identical is not told apart (batches carry wall-clock timestamps).

Snapshots
---------
With ``has_snapshot``, a replay that cannot reach ``last + 1`` (the buffer wrapped, or a
late join) is dropped and the rank's whole state asked for (:class:`RequestSnapshot`). A
complete answer at seq ``S`` gives a :class:`~kvevents.subscribe.items.Resync` and a
:class:`DeliverSnapshot`; one that fails falls back to what replay gives (a :class:`Loss`,
then the replay), and no snapshot is asked again until a replay delivers batches, so a
publisher that cannot give one costs one round trip per gap, never a loop.

Implausible seqs
----------------
A seq counts batches published, so it cannot leap: a live seq more than
:data:`MAX_SEQ_JUMP` (2**40, decades of batches) past the highest seen, or the end
marker's value on the live stream, is skipped and counted as ``Malformed`` (the socket
loop asks :meth:`StreamTracker.plausible`), not taken as a gap of 1.8e19 batches.

Cost: the in-order live case is one comparison (:meth:`StreamTracker.accept_in_order`);
everything else is O(1) per message plus O(buffered messages) when a replay ends.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from kvevents.subscribe.items import Gap, Loss, Reset, Resync, Signal

__all__ = [
    "MAX_SEQ_JUMP",
    "CancelReplay",
    "Deliver",
    "DeliverSnapshot",
    "Purpose",
    "RequestReplay",
    "RequestSnapshot",
    "StreamTracker",
    "TrackerAction",
]


MAX_SEQ_JUMP = 1 << 40
"""How far past the highest seq seen a seq may lie and still be believed."""

_END_SEQ = (1 << 64) - 1


class Deliver(NamedTuple):
    """Hand out ``payload`` as seq ``seq``; ``replayed`` when it came from a replay.

    ``payload`` is None for a replayed seq whose topic is not subscribed: it advances
    the sequence but carries nothing for this consumer.
    """

    seq: int
    payload: bytes | None
    replayed: bool


class RequestReplay(NamedTuple):
    """Ask the publisher for every buffered batch with seq >= ``start`` (cancels any
    replay still in flight)."""

    start: int


class CancelReplay(NamedTuple):
    """Forget the replay in flight (its late replies must not be read)."""


class RequestSnapshot(NamedTuple):
    """Ask the publisher for the rank's whole state (forgets the replay in flight)."""


class DeliverSnapshot(NamedTuple):
    """Hand out the snapshot just received, whole, as seq ``seq``."""

    seq: int


TrackerAction = Deliver | RequestReplay | CancelReplay | RequestSnapshot | DeliverSnapshot | Signal


class Purpose(enum.Enum):
    """Why a replay is outstanding."""

    JOIN = "join"  # a new or restarted stream: everything from seq 0
    GAP = "gap"  # fill last+1 .. the first buffered live seq
    VERIFY = "verify"  # after a reconnect: is seq `last` still the payload we delivered?
    PROBE = "probe"  # a quiet stream: was anything after `last` published and dropped?
    SNAPSHOT = "snapshot"  # replay cannot fill the gap: the rank's whole state instead


class StreamTracker:
    """Per-stream sequence state machine (see the module docstring for its invariants)."""

    def __init__(
        self,
        worker: str,
        dp_rank: int,
        *,
        has_replay: bool,
        max_pending: int = 50_000,
        has_snapshot: bool = False,
    ) -> None:
        self.worker = worker
        self.dp_rank = dp_rank
        self.has_replay = has_replay
        self.has_snapshot = has_replay and has_snapshot
        self._snapshot_allowed = True  # false after a failed one, until a replay ends well
        self._snapshot_from = 0  # the first seq the replay that gave way to it brought
        self.max_pending = max_pending
        self.last = -1
        # the last batch delivered with its payload: what a verifying replay compares
        self.anchor_seq = -1
        self.anchor_payload: bytes | None = None
        self.live_high = -1  # highest seq received live from this publisher
        self.replaying = False
        self.purpose = Purpose.JOIN
        self.replay_start = 0
        # live messages held during a replay: seq, payload, and the connection they came
        # on (``_connection`` when they arrived: it counts the drops)
        self.pending: list[tuple[int, bytes, int]] = []
        self._connection = 0
        self.suspect = False  # the connection dropped since `last` was delivered
        self._verified = False
        self._progress = False
        self._fruitless_start: int | None = None  # start of the last replay that gave nothing
        # the replay out is a new connection's check: asked again once if it times out
        self._recheck = False
        self._timeout_retries = 0  # timed-out replays re-asked in a row
        # counters, read by the stats
        self.gaps = 0
        self.replayed = 0
        self.lost = 0
        self.resets = 0
        self.snapshots = 0
        self.snapshot_failures = 0

    @property
    def can_verify(self) -> bool:
        """Whether a replay can prove that the publisher is the same one (a batch was
        delivered whose payload can be compared)."""
        return self.has_replay and self.anchor_payload is not None

    # --- inputs ------------------------------------------------------------------------

    def start(self, after: int | None = None) -> list[TrackerAction]:
        """A new stream: with a replay endpoint, first replay from 0 (slow joiner).

        ``after``: the consumer already holds the effect of every batch up to this seq
        (restored from a peer's snapshot), so the stream resumes there: a replay from
        ``after + 1`` fills what was published since, and live messages wait for it. A
        publisher whose buffer no longer reaches back to ``after + 1`` shows it in the
        replay's first seq (a :class:`Loss` of exactly the batches not buffered); one that
        buffers nothing newer answers with the end marker alone (nothing missed). Without
        a replay endpoint the first live seq tells: ``after + 1`` continues, anything
        further is a :class:`Loss` of the seqs between. Live seqs at or below ``after``
        mean the publisher restarted since the snapshot (:class:`Reset`); one that
        restarted and already published past ``after`` is not told apart (no payload to
        compare with, see "Restart detection").
        """
        out: list[TrackerAction] = []
        if after is not None and after >= 0:
            self.last = self.live_high = after
            if self.has_replay:
                self._begin_replay(Purpose.GAP, after + 1, out)
        elif self.has_replay:
            self._begin_replay(Purpose.JOIN, 0, out)
        return out

    def accept_in_order(self, seq: int, payload: bytes) -> bool:
        """Fast path: take ``seq`` if it is exactly the next one and nothing is pending.

        True means the tracker advanced and the caller delivers ``payload``; False means
        the caller must call :meth:`on_live` instead.
        """
        if seq == self.last + 1 and not self.replaying and not self.suspect:
            self.last = self.live_high = self.anchor_seq = seq
            self.anchor_payload = payload
            return True
        return False

    def plausible(self, seq: int) -> bool:
        """Whether ``seq`` can be a real seq of this stream (see "Implausible seqs")."""
        return seq != _END_SEQ and seq - max(self.last, self.live_high, 0) <= MAX_SEQ_JUMP

    def on_live(self, seq: int, payload: bytes) -> list[TrackerAction]:
        """A live message arrived."""
        out: list[TrackerAction] = []
        if self.live_high < seq <= self.last:
            # The live copy of a batch a replay delivered already: live seqs only grow,
            # so this is not a restart (that would go back to ``live_high`` or below).
            self.live_high = seq
            return out
        high, self.live_high = self.live_high, seq
        if self.replaying and self.purpose is Purpose.PROBE:
            self.replaying = False  # this message shows any gap by itself
            out.append(CancelReplay())
        if self.replaying:
            if seq <= high:
                # The publisher started again while the replay was out: what it buffered
                # is the old one's, and so is the replay's answer (the new replay
                # from 0 that the reset asks for replaces it).
                self.pending = []
                self._reset(seq, f"sequence went back from {high} to {seq} during a replay", out)
            self.pending.append((seq, payload, self._connection))
            if len(self.pending) > self.max_pending:
                self._abandon_replay(
                    f"more than {self.max_pending} live messages arrived during the replay", out
                )
            return out
        self._follow(seq, payload, out, self.has_replay, "no replay endpoint for this stream")
        return out

    def on_replay_reply(
        self, seq: int, payload: bytes, subscribed: bool = True
    ) -> list[TrackerAction]:
        """One replay reply (``subscribed`` is False when its topic is filtered out)."""
        out: list[TrackerAction] = []
        if not self.replaying or self.purpose is Purpose.SNAPSHOT:
            return out
        if self.purpose is Purpose.VERIFY and not self._verified:
            if seq < self.anchor_seq:
                return out  # older than asked for: keep looking
            self._verified = True  # (a buffer that no longer holds the anchor cannot tell)
            self._timeout_retries = 0  # its retry was spent on reaching the publisher
            if seq == self.anchor_seq and payload != self.anchor_payload:
                self._reset(None, "replay shows another batch at a seq already delivered", out)
                return out
        if seq <= self.last:
            return out
        if seq > self.last + 1 and self.has_snapshot and self._snapshot_allowed:
            # the buffer no longer holds what is missing: the whole state instead
            self.purpose = Purpose.SNAPSHOT
            self._snapshot_from = seq
            self._timeout_retries = 0
            out.append(RequestSnapshot())
            return out
        if seq > self.last + 1:
            self._lose(
                self.last + 1,
                seq - 1,
                "not in the publisher's replay buffer (overrun, or dropped by the publisher)",
                out,
            )
        self._progress = True
        self.last = seq
        if subscribed:
            self.anchor_seq, self.anchor_payload = seq, payload
            self.replayed += 1
            out.append(Deliver(seq, payload, True))
        else:
            out.append(Deliver(seq, None, True))
        return out

    def on_replay_end(self) -> list[TrackerAction]:
        """The replay end marker arrived: hand out what was buffered meanwhile."""
        out: list[TrackerAction] = []
        if not self.replaying:
            return out
        if self.purpose is Purpose.SNAPSHOT:
            return self.on_snapshot_failed("the publisher answered as to a replay request")
        if self.purpose is Purpose.VERIFY and not self._verified:
            self._reset(None, "the publisher's replay buffer is empty: it restarted", out)
            return out
        self.replaying = False
        self._timeout_retries = 0
        retry = True
        if self._progress:
            self._fruitless_start = None
            self._snapshot_allowed = True  # a replay that works again: a later gap may ask
        elif self.purpose is Purpose.PROBE:
            pass  # a probe that finds nothing says nothing about gaps
        elif self._fruitless_start == self.replay_start:
            retry = False  # the same request gave nothing twice: the gap cannot be filled
        else:
            self._fruitless_start = self.replay_start
        pending, self.pending = self.pending, []
        self._flush(pending, out, self.has_replay and retry, "replay did not return it")
        return out

    def on_replay_timeout(self) -> list[TrackerAction]:
        """No replay reply for too long (the caller discards that replay socket)."""
        out: list[TrackerAction] = []
        if not self.replaying:
            return out
        if self.purpose is Purpose.SNAPSHOT:
            return self.on_snapshot_failed("no answer within the replay timeout")
        unverified = self.purpose is Purpose.VERIFY and not self._verified
        if unverified and self._timeout_retries < 1:
            # The publisher's replay endpoint was not up yet after the reconnect (an
            # engine starting again): ask once more before the next messages are judged
            # by their seqs alone.
            self._timeout_retries += 1
            self._begin_replay(Purpose.VERIFY, self.anchor_seq, out)
            return out
        if not unverified and (
            (self._progress and self._timeout_retries < 2)
            or (self.pending and self._timeout_retries < 1)
        ):
            # The answer stopped midway (the publisher dropped the rest), or the request
            # went to a publisher that was not up yet while live messages now arrive:
            # ask again, on a fresh socket.
            self._timeout_retries += 1
            purpose = Purpose.PROBE if self.purpose is Purpose.PROBE else Purpose.GAP
            self._begin_replay(purpose, self.last + 1, out)
            return out
        self._timeout_retries = 0
        if self._recheck and not self.pending and not unverified:
            # The connection's check went unanswered: its request waited on a replay
            # socket still backing off from a publisher that was down, or went to the
            # old publisher. Ask once more (the socket loop gives it a fresh socket).
            self._begin_replay(Purpose.PROBE, self.last + 1, out)
            return out
        if self.purpose is Purpose.PROBE and not self.pending:
            self.replaying = False
            return out
        self._abandon_replay(f"replay from seq {self.replay_start} timed out", out)
        return out

    def on_snapshot(self, seq: int) -> list[TrackerAction]:
        """The whole snapshot asked for arrived, at seq ``seq``: it replaces the holder's
        state (:class:`Resync`, then :class:`DeliverSnapshot`), and the live messages that
        waited for it follow."""
        out: list[TrackerAction] = []
        if not self.replaying or self.purpose is not Purpose.SNAPSHOT:
            return out
        out.append(
            Resync(
                worker=self.worker,
                dp_rank=self.dp_rank,
                last_seq=self.last,
                new_seq=seq,
                reason="replay could not bring every batch missed: the publisher's "
                f"snapshot at seq {seq} replaces the holder's state",
            )
        )
        out.append(DeliverSnapshot(seq))
        self.snapshots += 1
        self.replaying = False
        self._timeout_retries = 0
        self._fruitless_start = None
        self._snapshot_allowed = True
        self.suspect = False
        self.last = seq
        self.anchor_seq, self.anchor_payload = -1, None  # no published payload to compare
        pending, self.pending = self.pending, []
        # live seqs seen before the snapshot are at most its seq, unless they were another
        # publisher's (it restarted meanwhile): live messages from here on are judged
        # against this one's
        self.live_high = min(self.live_high, max([seq] + [held[0] for held in pending]))
        self._flush(pending, out, self.has_replay, "replay did not return it")
        return out

    def on_snapshot_failed(self, reason: str) -> list[TrackerAction]:
        """The snapshot asked for did not come whole: the batches the replay could not
        bring are lost (``reason`` says why no snapshot), and replay resumes after them."""
        out: list[TrackerAction] = []
        if not self.replaying or self.purpose is not Purpose.SNAPSHOT:
            return out
        self.snapshot_failures += 1
        self._snapshot_allowed = False
        first = self._snapshot_from
        if first > self.last + 1:
            self._lose(
                self.last + 1,
                first - 1,
                f"not in the publisher's replay buffer, and no snapshot: {reason}",
                out,
            )
        self._begin_replay(Purpose.GAP, self.last + 1, out)
        return out

    def probe(self) -> list[TrackerAction]:
        """The stream has been quiet: ask the publisher for anything after ``last``."""
        out: list[TrackerAction] = []
        if not self.has_replay or self.replaying:
            return out
        if not self.suspect:
            self._begin_replay(Purpose.PROBE, self.last + 1, out)
        elif self.can_verify:
            # The verification after a reconnect timed out and nothing live came since:
            # verify again, or the tail after ``last`` would never be asked for.
            self.suspect = False
            self._begin_replay(Purpose.VERIFY, self.anchor_seq, out)
        return out

    def on_disconnected(self) -> None:
        """The live connection dropped: what comes next may be another publisher."""
        self._connection += 1
        if self.last >= 0:
            self.suspect = True

    def on_connected(self) -> list[TrackerAction]:
        """The live connection is up (the first time, or again): with a replay endpoint,
        ask for what was published after ``last``.

        After a drop the replay verifies the publisher: it starts at the anchor (the last
        batch delivered with its payload) and also fills anything after ``last``; a
        replay still in flight went to the old connection, and this one replaces it.
        Otherwise it is a probe from ``last + 1`` (the end marker alone when nothing is
        new), or, when a replay is already out, that replay: it covers ``last + 1`` too.
        A drop whose publisher cannot be verified asks nothing: its next live seq is
        judged alone (see "Restart detection").
        """
        out: list[TrackerAction] = []
        if not self.has_replay:
            return out
        if self.suspect:
            if self.can_verify:
                self.suspect = False
                self._begin_replay(Purpose.VERIFY, self.anchor_seq, out)
        elif self.replaying:
            self._recheck = True
        else:
            self._begin_replay(Purpose.PROBE, self.last + 1, out, recheck=True)
        return out

    # --- internals -----------------------------------------------------------------------

    def _follow(
        self,
        seq: int,
        payload: bytes,
        out: list[TrackerAction],
        replay_allowed: bool,
        reason: str,
        connection: int | None = None,
    ) -> None:
        """Handle one message outside a replay (live, or buffered during one: then
        ``connection`` is the one it came on).

        ``reason`` explains a loss when a gap cannot be replayed.
        """
        held = (seq, payload, self._connection if connection is None else connection)
        if self.suspect:
            self.suspect = False
            if seq > self.last and replay_allowed and self.can_verify:
                self.pending.append(held)
                self._begin_replay(Purpose.VERIFY, self.anchor_seq, out)
                return
            if seq > self.last + 1:
                reason = f"missed across a reconnect ({reason})"
        if seq == self.last + 1:
            self._deliver(seq, payload, out)
        elif seq > self.last + 1:
            if replay_allowed:
                retry = self.purpose is Purpose.GAP and self._fruitless_start == self.last + 1
                if not retry:  # the retry of a gap replay that gave nothing was told
                    self.gaps += 1
                    out.append(
                        Gap(
                            worker=self.worker,
                            dp_rank=self.dp_rank,
                            first_seq=self.last + 1,
                            last_seq=seq - 1,
                        )
                    )
                self.pending.append(held)
                self._begin_replay(Purpose.GAP, self.last + 1, out)
            else:
                self._lose(self.last + 1, seq - 1, reason, out)
                self._deliver(seq, payload, out)
        else:
            self._reset(seq, f"sequence went back from {self.last} to {seq}", out)
            if self.replaying:
                self.pending.append(held)
            else:
                self._follow(seq, payload, out, False, reason, held[2])

    def _flush(
        self,
        pending: list[tuple[int, bytes, int]],
        out: list[TrackerAction],
        replay_allowed: bool,
        reason: str,
    ) -> None:
        """Hand out messages buffered during a replay, in arrival order."""
        for i, (seq, payload, connection) in enumerate(pending):
            if seq <= self.last and not self.suspect:
                continue  # the replay delivered it already
            self._follow(seq, payload, out, replay_allowed, reason, connection)
            if self.replaying:  # a further gap or a reset started another replay
                self.pending.extend(pending[i + 1 :])
                return

    def _abandon_replay(self, reason: str, out: list[TrackerAction]) -> None:
        """Give up the outstanding replay: what it would have filled is lost."""
        if self.purpose is Purpose.VERIFY and not self._verified:
            self.suspect = True  # unverified: the next message is judged by its seq alone
        self.replaying = False
        pending, self.pending = self.pending, []
        self._flush(pending, out, False, reason)

    def _begin_replay(
        self, purpose: Purpose, start: int, out: list[TrackerAction], *, recheck: bool = False
    ) -> None:
        self.replaying = True
        self.purpose = purpose
        self.replay_start = start
        self._verified = False
        self._progress = False
        self._recheck = recheck
        out.append(RequestReplay(start))

    def _reset(self, new_seq: int | None, reason: str, out: list[TrackerAction]) -> None:
        out.append(
            Reset(
                worker=self.worker,
                dp_rank=self.dp_rank,
                last_seq=self.last,
                new_seq=new_seq,
                reason=reason,
            )
        )
        self.resets += 1
        if new_seq is None:  # another publisher since the drop: what came before is the old one's
            self.pending = [held for held in self.pending if held[2] == self._connection]
        self.last = -1
        self.live_high = -1 if new_seq is None else new_seq
        self.anchor_seq, self.anchor_payload = -1, None
        self.suspect = False
        self._fruitless_start = None
        self._snapshot_allowed = True  # another publisher: it may give one
        if self.has_replay:
            self._begin_replay(Purpose.JOIN, 0, out)
        else:
            self.replaying = False

    def _lose(self, first: int, last: int, reason: str, out: list[TrackerAction]) -> None:
        out.append(
            Loss(
                worker=self.worker,
                dp_rank=self.dp_rank,
                first_seq=first,
                last_seq=last,
                reason=reason,
            )
        )
        self.lost += last - first + 1
        self.last = last

    def _deliver(self, seq: int, payload: bytes, out: list[TrackerAction]) -> None:
        self.last = self.anchor_seq = seq
        self.anchor_payload = payload
        out.append(Deliver(seq, payload, False))
