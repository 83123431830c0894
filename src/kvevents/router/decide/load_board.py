"""The router's view of every holder's load, in one flat table (:class:`LoadBoard`).

A router updates one holder's load per event (a request begun or finished, an engine's
poll) but reads every candidate's on each decision. While the loads hold still a
:class:`~kvevents.router.decide.scoring.Ranking` answers without reading them all; a
relayed request (or a ``/route`` with ``record``) changes them every time, and a Python
step per holder plus the decay of every holder's ``recent`` work would then grow with the
fleet on every request. So:

* every holder's load is a row of six floats (routable, the engine's requests, this
  router's requests and blocks in flight, the raw recent work, the requests routed): a
  Python list per slot for one Python pass over few candidates, and a copy in one flat
  float64 table (``_STRIDE`` per slot, changed rows copied when read) for the native scan
  (``best_unmatched``, :func:`board_top_scores`) over many;
* ``recent`` is stored raw beside one scale that every routed request multiplies by the
  decay: recent work is ``raw * scale`` and a routed request adds ``blocks / scale``, so
  the decay is one multiplication, not one per holder. The scale is folded into the raw
  figures before it gets small enough to lose precision.

The board is a read-only ``Mapping[Holder, HolderLoad]`` (what :attr:`Router.loads
<kvevents.router.decide.router.Router.loads>` shows); each ``HolderLoad`` it hands out is a
copy, so loads change only through the board's methods. A row's first field is 1.0
exactly when the engine says the rank is available and the router does not see it
stalled (:mod:`kvevents.router.decide.stalls`); both are kept beside the rows, so the
scans read only the row and rank a stalled holder last, as a down one. When no
candidate is routable but some are only stalled, the router decides again with those
rows lifted (:meth:`LoadBoard.lifted`).
"""

from __future__ import annotations

import contextlib
from array import array
from bisect import insort
from collections.abc import Iterator, Mapping, Sequence

from kvevents import kernels
from kvevents.index.types import DEFAULT_CREDITS, HolderMatch, TierCredits
from kvevents.router.decide.cost import least_recent, own_part, request_part
from kvevents.router.decide.scoring import HolderLoad, HolderScore, ScoringWeights
from kvevents.types import Holder

__all__ = ["LoadBoard", "board_top_scores"]

# a slot's fields in the table: the layout the native scan and board_choice read
# (load_scan.h's ROW_*; tests/router/test_load_board.py holds the two alike)
_AVAILABLE, _ENGINE, _INFLIGHT, _BLOCKS, _RAW, _ROUTED = range(6)
_STRIDE = 6
_FOLD_BELOW = 1e-100
"""The scale is folded into the raw figures before it falls below this: a raw figure is
then at most ``blocks * 1e100``, far from float64's limits, and loses no precision."""
_COMPILED_FROM = 8
"""Candidates from which the native scan is called (below, the Python pass over them
costs about as little)."""
_COMPILED_TOP = 16
"""The most scores taken from the native scan (it keeps its best few by insertion: every
holder in order, as score() would rank them, for a score of all of them)."""
_ZERO = HolderMatch(0, 0, 0)
_DEFAULT_WEIGHTS = ScoringWeights()


_Row = list[float]
"""One slot's fields, in the table's order (see the module docstring)."""
_Candidates = tuple[Sequence[Holder], "array[int]", list[_Row], dict[Holder, int]]
"""A candidate list, its slots, their rows, and each holder's position in it."""


class LoadBoard(Mapping[Holder, HolderLoad]):
    """See the module docstring."""

    def __init__(self) -> None:
        self.scale = 1.0
        """``recent = raw * scale`` for every holder."""
        self._rows: list[_Row] = []
        """Per slot, its fields: a list each, changed in place and never replaced (the
        Python pass reads them; a list item costs no float object)."""
        self._table = array("d")
        self._stale: set[int] = set()
        """Slots whose row changed since :meth:`table` last copied it."""
        self._slots: dict[Holder, int] = {}
        self._by_worker: dict[str, list[Holder]] = {}
        """Each engine's holders (what an engine's failed poll changes, without a scan)."""
        self._snapshot: dict[Holder, HolderLoad] | None = None
        self._candidates: dict[int, _Candidates] = {}
        self._ended: list[float] = []
        """Per slot, the requests in flight there that have ended so far (see :meth:`ended`)."""
        self._up: list[bool] = []
        """Per slot, whether the engine says the rank is available (its last word)."""
        self._stalls: dict[int, int] = {}
        """Per stalled slot, its causes (bits: :meth:`set_stalled`); empty when none is."""

    @classmethod
    def of(cls, loads: Mapping[Holder, HolderLoad]) -> LoadBoard:
        """A board holding ``loads`` (as a router's would after reaching them)."""
        board = cls()
        for holder, load in loads.items():
            slot = board.slot(holder)
            board._up[slot] = load.available
            if load.stalled:
                board._stalls[slot] = 1
            board._rows[slot][:] = [
                1.0 if load.routable else 0.0,
                float(load.engine_requests),
                float(load.inflight_requests),
                float(load.inflight_blocks),
                float(load.recent_blocks),
                float(load.routed),
            ]
        return board

    def table(self) -> array[float]:
        """Every slot's row, :data:`_STRIDE` float64 each, as the native scan reads
        them: the rows changed since the last call are copied in first."""
        table, rows, stale = self._table, self._rows, self._stale
        if len(table) < _STRIDE * len(rows):
            table.frombytes(bytes(8 * (_STRIDE * len(rows) - len(table))))
        for slot in stale:
            table[slot * _STRIDE : slot * _STRIDE + _STRIDE] = array("d", rows[slot])
        stale.clear()
        return table

    # --- the Mapping: what the router's loads show -----------------------------------

    def __getitem__(self, holder: Holder) -> HolderLoad:
        return self._load(self._slots[holder])  # a new copy: changing it changes nothing

    def __iter__(self) -> Iterator[Holder]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, holder: object) -> bool:
        return holder in self._slots

    def snapshot(self) -> dict[Holder, HolderLoad]:
        """Every holder's load as it is now, for scoring: the same dict until a change,
        so read it only (a read through the mapping makes a copy per holder)."""
        snapshot = self._snapshot
        if snapshot is None:
            snapshot = self._snapshot = {h: self._load(s) for h, s in self._slots.items()}
        return snapshot

    def _load(self, slot: int) -> HolderLoad:
        _, engine, inflight, blocks, raw, routed = self._rows[slot]
        return HolderLoad(
            engine_requests=int(engine),
            inflight_requests=int(inflight),
            inflight_blocks=blocks,
            routed=int(routed),
            available=self._up[slot],
            recent_blocks=raw * self.scale,
            stalled=slot in self._stalls,
        )

    # --- changing loads ---------------------------------------------------------------

    def slot(self, holder: Holder) -> int:
        """``holder``'s slot, added idle (available, nothing counted) when new."""
        slot = self._slots.get(holder)
        if slot is None:
            holder = Holder(*holder)
            slot = self._slots[holder] = len(self._rows)
            self._by_worker.setdefault(holder.worker, []).append(holder)
            self._rows.append([1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
            self._ended.append(0.0)
            self._up.append(True)
            self._stale.add(slot)
            self._snapshot = None
        return slot

    def add_inflight(self, holder: Holder, requests: int, blocks: float) -> bool:
        """Add (or, negative, remove) requests in flight and their uncached blocks; never
        below zero. Removing from a holder not on the board does nothing (False).

        The engine's request count moves with them (never below zero either): a request
        this router (or a peer) begins or ends after the engine's last poll is one more
        or one fewer on the engine now. The engine's requests that are not this
        router's, ``engine - inflight``, so stay what the poll said until the next one:
        a request that ends between two polls leaves no phantom behind (before, the
        rank then looked busy with a foreign request until the next poll), and one begun
        between them is not taken for one of the engine's own."""
        slot = self._slots.get(holder)
        if slot is None:
            if requests <= 0:
                return False
            slot = self.slot(holder)
        row = self._rows[slot]
        before = row[_INFLIGHT]
        requests_now = before + requests
        blocks_now = row[_BLOCKS] + blocks
        row[_INFLIGHT] = requests_now if requests_now > 0.0 else 0.0
        row[_BLOCKS] = blocks_now if blocks_now > 0.0 else 0.0
        change = row[_INFLIGHT] - before
        if change < 0.0:
            self._ended[slot] -= change
        engine_now = row[_ENGINE] + change
        row[_ENGINE] = engine_now if engine_now > 0.0 else 0.0
        self._stale.add(slot)
        self._snapshot = None
        return True

    def note_routed(self, holder: Holder, blocks: float, decay: float, *, count: bool) -> None:
        """A request of ``blocks`` prompt blocks went to ``holder``: every holder's recent
        work decays by ``decay`` (the scale), then ``holder``'s grows by ``blocks``;
        ``count``: it is also counted in ``routed`` (this router's own request). O(1)."""
        slot = self.slot(holder)
        scale = self.scale * decay
        if scale < _FOLD_BELOW:
            for row in self._rows:
                row[_RAW] *= scale
            self._stale.update(range(len(self._rows)))
            scale = 1.0
        self.scale = scale
        row = self._rows[slot]
        row[_RAW] += blocks / scale
        if count:
            row[_ROUTED] += 1.0
        self._stale.add(slot)
        self._snapshot = None

    def holders_of(self, worker: str) -> Sequence[Holder]:
        """The holders of engine ``worker`` on the board, in the order they came."""
        return self._by_worker.get(worker, ())

    def ended(self, holder: Holder) -> float:
        """Requests in flight on ``holder`` (this router's and its peers') that have
        ended so far: what a load poll reads before it asks, to take out of the
        engine's count those that end while it waits (:meth:`Router.update_load
        <kvevents.router.decide.router.Router.update_load>`)."""
        slot = self._slots.get(holder)
        return 0.0 if slot is None else self._ended[slot]

    def set_engine(
        self, holder: Holder, available: bool, engine_requests: int | None = None
    ) -> bool:
        """What an engine's poll says of a rank (``engine_requests`` None: not told);
        True when that changed anything."""
        slot = self.slot(holder)
        row = self._rows[slot]
        before = (self._up[slot], row[_ENGINE])
        self._up[slot] = available
        if engine_requests is not None:
            row[_ENGINE] = float(engine_requests)
        if (available, row[_ENGINE]) == before:
            return False
        self._set_routable(slot)
        return True

    def set_stalled(self, holder: Holder, cause: int, stalled: bool) -> bool:
        """Mark ``holder`` stalled for ``cause`` (a bit: the router's causes are
        :data:`~kvevents.router.decide.stalls.REQUESTS` and
        :data:`~kvevents.router.decide.stalls.ENGINE`), or no longer for it; it is
        stalled while any cause holds. True when that changed anything."""
        slot = self._slots.get(holder)
        if slot is None:
            return False
        before = self._stalls.get(slot, 0)
        after = before | cause if stalled else before & ~cause
        if after == before:
            return False
        if after:
            self._stalls[slot] = after
        else:
            del self._stalls[slot]
        self._set_routable(slot)
        return True

    def stalled_by(self, holder: Holder) -> int:
        """``holder``'s stall causes (bits, see :meth:`set_stalled`); 0 when not stalled."""
        slot = self._slots.get(holder)
        return 0 if slot is None else self._stalls.get(slot, 0)

    @property
    def any_stalled(self) -> bool:
        """True while any holder is stalled."""
        return bool(self._stalls)

    @contextlib.contextmanager
    def lifted(self) -> Iterator[None]:
        """Within it, every stalled holder the engine says is available is routable
        (its row says so); after it, stalled again: for a decision among candidates of
        which none is routable otherwise. Change nothing else within it."""
        lifted = {slot: causes for slot, causes in self._stalls.items() if self._up[slot]}
        for slot in lifted:
            del self._stalls[slot]
            self._set_routable(slot)
        try:
            yield
        finally:
            for slot, causes in lifted.items():
                self._stalls[slot] = causes
                self._set_routable(slot)

    def _set_routable(self, slot: int) -> None:
        """Set the row's first field from the engine's word and the stalls; mark it changed."""
        self._rows[slot][_AVAILABLE] = 1.0 if self._up[slot] and slot not in self._stalls else 0.0
        self._stale.add(slot)
        self._snapshot = None

    def set_worker_available(self, worker: str, available: bool) -> bool:
        """Every rank of ``worker`` on the board (un)available; True when any changed."""
        changed = False
        for holder in self._by_worker.get(worker, ()):
            changed |= self.set_engine(holder, available)
        return changed

    # --- reading loads for a decision -------------------------------------------------

    def candidates(self, holders: Sequence[Holder]) -> _Candidates:
        """A candidate list's slots (in its order), their rows, and each holder's
        position in the list; kept per list object (a router's candidate lists are
        kept objects)."""
        kept = self._candidates.get(id(holders))
        if kept is not None and kept[0] is holders:
            return kept
        if len(self._candidates) >= 64:
            self._candidates.clear()
        slots = [self.slot(h) for h in holders]
        kept = self._candidates[id(holders)] = (
            holders,
            array("q", slots),
            [self._rows[slot] for slot in slots],
            {h: i for i, h in enumerate(holders)},
        )
        return kept


def board_top_scores(
    board: LoadBoard,
    holders: Sequence[Holder],
    n_blocks: int,
    matches: Mapping[Holder, HolderMatch],
    top: int,
    *,
    credits: TierCredits = DEFAULT_CREDITS,
    weights: ScoringWeights | None = None,
    predicted: Mapping[Holder, int] | None = None,
) -> list[HolderScore]:
    """``score(...)[:top]`` over ``board``'s loads, exactly (``top`` at least 1;
    ValueError without holders), made without scoring every holder.

    Few candidates, many scores asked (every holder's, say) or no native core: one pass
    over them, each compared with the ``top``-th best so far. Many candidates: the native
    scan (``best_unmatched``, :mod:`kvevents.kernels`) picks the best ``top`` as if
    none cached anything of the request, and only those and the holders that match it
    (or have predictions) are scored here: a match only lowers a cost, so a holder
    that matches nothing and is not among the scan's best ``top`` has ``top`` holders
    before it either way.
    """
    if not holders:
        raise ValueError("board_top_scores: no holders to choose from")
    weights = weights or _DEFAULT_WEIGHTS
    top = max(1, top)
    _, slots, rows, positions = board.candidates(holders)
    scale = board.scale
    lw, bw, fb = weights.load_weight, weights.balance_weight, weights.foreign_request_blocks
    order: Sequence[int]
    if len(slots) < _COMPILED_FROM or top > _COMPILED_TOP or (compiled := kernels.loaded()) is None:
        order = range(len(slots))
        least = least_recent([row[_RAW] * scale for row in rows if row[_AVAILABLE]])
    else:
        touched = [positions[h] for h in matches if h in positions]
        if predicted:
            touched += [positions[h] for h in predicted if h in positions and h not in matches]
        picked, least = compiled.best_unmatched(
            slots, board.table(), scale, float(n_blocks), lw, bw, fb, min(len(slots), top)
        )
        order = [i for i in picked if i not in touched] + touched
    gpu, cpu, disk = credits.gpu, credits.cpu, credits.disk
    pcredit = weights.predicted_credit
    get_match = matches.get
    get_predicted = predicted.get if predicted else None
    # the best ``top`` so far (all of them when ``top`` covers every one, sorted once at
    # the end), best first, each score behind its sort key (unique: i), and the key a
    # holder must beat once ``top`` are kept (one comparison per holder)
    every = top >= len(order)
    ranked: list[tuple[bool, float, float, float, float, int, HolderScore]] = []
    bound: tuple[bool, float, float, float, float, int] | None = None
    for i in order:
        h = holders[i]
        available, engine, inflight, blocks, raw, routed = rows[i]
        recent = raw * scale
        pending, balance, own = own_part(engine, inflight, blocks, recent, least, lw, bw, fb)
        m = get_match(h, _ZERO)
        p = 0 if get_predicted is None else get_predicted(h, 0)
        cached, prefill, cost = request_part(n_blocks, m, p, own, gpu, cpu, disk, pcredit)
        unavailable = available == 0.0
        if bound is not None and (unavailable, cost, pending, recent, routed, i) > bound:
            continue
        entry = (
            unavailable,
            cost,
            pending,
            recent,
            routed,
            i,
            HolderScore(
                worker=h.worker,
                dp_rank=h.dp_rank,
                matched=m,
                cached_blocks=cached,
                prefill_blocks=prefill,
                pending_blocks=pending,
                cost=cost,
                routed=int(routed),
                available=not unavailable,
                recent_blocks=recent,
                balance_blocks=balance,
                predicted_blocks=p,
            ),
        )
        if every:
            ranked.append(entry)
            continue
        insort(ranked, entry)
        if len(ranked) > top:
            ranked.pop()
        if len(ranked) == top:
            bound = ranked[-1][:6]
    if every:
        ranked.sort()
    return [entry[-1] for entry in ranked]
