"""The plain ``/route`` and ``/query`` answered in one native call (:mod:`kvevents.kernels.native`).

:class:`NativeRoute` answers a request given as token ids alone (the body
``{"input_ids": [...]}``: for ``/route``, top 4 and nothing recorded) when every
condition of the exact answer holds, and None otherwise, for the Python path to answer:

* the extension is built and on (it also keeps the index's mirrors);
* the index's matches are plain: GPU blocks only, no side groups (hybrid models), at
  most 64 holder slots (:meth:`~kvevents.index.mask_table.MaskTable.native_mirrors`);
  predictions count as in Python (their masks are mirrored too);
* the block size is known and at most 60 tokens;
* ``/route`` only: the router keeps a :class:`~kvevents.router.decide.scoring.Ranking` of its holders (the
  loads held still since the last request; the second request after a change makes
  it), whose figures and the credits are plain floats (a plan of them is made once
  per ranking: :func:`plan_of`);
* ``/route`` only: an available holder wins, and every float of the answer is one
  msgspec writes without an exponent.

The answer is then the bytes the Python path writes, and the match is recorded in the
index as its own would be (a lookup, the recency of the blocks matched). Like the Python
path, the extension matches only the blocks an engine reuses of the request (every full
block but a block-aligned prompt's last, :mod:`kvevents.index.reusable`), computing the
cap from the token count, while the keys it answers are every full block.

:meth:`NativeRoute.choose` chooses the holder of a relayed request the same way, and
the best few of a recorded ``/route`` (:meth:`Router.route
<kvevents.router.decide.router.Router.route>`'s one pass, at most 16 scores: the loads changed
since the last request, as every relayed or recorded request changes them), reading
every candidate's load from the board's table instead of a ranking's plan
(:func:`seats_of` tells the extension where each candidate sits on the board and in the
index).
"""

from __future__ import annotations

import logging
import math
import struct
from array import array
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, TypeAlias

import msgspec

from kvevents.index import PrefixIndex, TierCredits
from kvevents.index.types import HolderMatch
from kvevents.kernels import native
from kvevents.router.decide.load_board import LoadBoard
from kvevents.router.decide.scoring import HolderScore, Ranking, ScoringWeights
from kvevents.router.prompts.token_body import DEFAULT_TOP
from kvevents.types import Holder
from kvevents.wire.hashing import ROOT_KEY

if TYPE_CHECKING:
    from kvevents.kernels import MaskMirror

__all__ = [
    "NativeRoute",
    "Plan",
    "QueryPlan",
    "Routing",
    "Seats",
    "plan_of",
    "query_plan_of",
    "seats_of",
]

Plan = tuple[bytes, tuple[bytes, ...], float, float, float, bytes, float]
"""What the native call reads of a ranking: per candidate its figures (packed) and its
answer's fixed bytes, the tiers' credits, the answer's bytes after ``n_blocks``' value,
and the predictions' credit."""

QueryPlan = tuple[bytes, tuple[bytes, ...], bytes]
"""What the native ``/query`` reads: per candidate its slot (int64s) and its match's
fixed bytes, and the answer's bytes after ``prompt_tokens``' value."""

Seats = tuple[bytes, tuple[float, float, float, float, float, float, float]]
"""What the native choice over the load board reads: per candidate its board slot and
index slot (int64 pairs), and the weights and credits it scores with."""

_Keying: TypeAlias = "tuple[array[int], int, int, MaskMirror, int]"
"""The arguments every native call starts with: the tokens, the block size, the parent
key, the blocks' mirror and the live slots."""
_Plain = tuple[ModuleType, PrefixIndex, int, _Keying, "MaskMirror | None"]
"""What every native call reads: the extension, the index, the block size, its keying
and the predictions' mirror (None for none: :meth:`NativeRoute._plain`)."""

log = logging.getLogger("kvevents.router")

_CANDIDATE = struct.Struct("=dddqqq")  # own, pending, recent, routed, unavailable, slot
_SEAT = struct.Struct("=qq")  # board slot, index slot
_encode = msgspec.json.encode


class Routing(Protocol):
    """What :class:`NativeRoute` reads of its router (:class:`~kvevents.router.decide.router.Router`)."""

    index: PrefixIndex
    loads: LoadBoard
    weights: ScoringWeights

    def _kept_ranking(self, holders: list[Holder]) -> Ranking | None: ...

    def _watch_stalls(self) -> None: ...


class NativeRoute:
    """See the module docstring; one per router."""

    def __init__(self, router: Routing) -> None:
        self.router = router
        self._module = native.load()
        self._module_top = 0 if self._module is None else self._module.MAX_TOP
        self._made_for: tuple[Ranking, PrefixIndex, TierCredits, int] | None = None
        self._plan: Plan | None = None
        self._query_made_for: tuple[list[Holder], PrefixIndex, int] | None = None
        self._query_plan: QueryPlan | None = None
        self._seats_made_for: (
            tuple[list[Holder], list[Holder], PrefixIndex, LoadBoard, ScoringWeights, TierCredits]
            | None
        ) = None
        self._seats: Seats | None = None
        self.answered = 0
        """Requests answered natively, ``/route`` and ``/query`` (for /workers)."""
        self.chosen = 0
        """Requests whose holder was chosen natively over the load board (:meth:`choose`:
        relayed and recorded ones, for /workers)."""
        self.failures = 0
        """Native calls that raised (a bug; the Python path answered them)."""

    def _failed(self, path: str) -> None:
        self.failures += 1
        if self.failures == 1:
            log.exception(
                "the native %s call failed; the Python path answers instead (KVEVENTS_NATIVE=0 "
                "turns the native calls off; please report this)",
                path,
            )

    def _plain(self, tokens: Sequence[int]) -> _Plain | None:
        """What every native call reads (see :class:`_Plain`) when one can answer a
        request of ``tokens`` at all (every call's common conditions), else None."""
        module = self._module
        if module is None or type(tokens) is not array or tokens.typecode != "I":
            return None
        index = self.router.index
        block_size = index.block_size
        if block_size is None or block_size > module.MAX_BLOCK_TOKENS:
            return None
        mirrors = index.native_mirrors(keyed=len(tokens) >= block_size)
        if mirrors is None:
            return None
        mirror, predicted = mirrors
        keying = (tokens, block_size, ROOT_KEY, mirror, index._live)
        return module, index, block_size, keying, predicted

    def answer(self, tokens: Sequence[int]) -> bytes | None:
        """The plain ``/route`` answer for ``tokens`` (an ``array("I")``), or None when
        the Python path must answer (see the module docstring)."""
        plain = self._plain(tokens)
        if plain is None:
            return None
        module, index, block_size, keying, predicted = plain
        self.router._watch_stalls()  # a stall due now ends the kept ranking
        ranking = self.router._kept_ranking(index.holders())
        if ranking is None:
            return None
        credits = index.credits
        # the plan's objects themselves: an equal object may still differ where the plan
        # reads it (credits of 1 and of 1.0 are equal, and write apart)
        kept = self._made_for
        if (
            kept is None
            or kept[0] is not ranking
            or kept[1] is not index
            or kept[2] is not credits
            or kept[3] != block_size
        ):
            self._plan = plan_of(ranking, index, credits, block_size)
            self._made_for = (ranking, index, credits, block_size)
        plan = self._plan
        if plan is None:
            return None
        answer: bytes | None
        try:
            answer, keys, longest = module.route_answer(*keying, plan, DEFAULT_TOP, predicted)
        except Exception:  # a bug: the Python path answers, the log says it once
            self._failed("/route")
            return None
        if answer is None:
            return None
        index.note_plain_match(keys, longest)
        self.answered += 1
        return answer

    def query(self, tokens: Sequence[int]) -> bytes | None:
        """The plain ``/query`` answer for ``tokens`` (an ``array("I")``), or None when
        the Python path must answer (as :meth:`answer`, but no ranking is needed:
        ``/query`` scores nothing)."""
        plain = self._plain(tokens)
        if plain is None:
            return None
        module, index, block_size, keying, predicted = plain
        holders = index.holders()
        # the same list (a new one after any holder came or went), never an equal one:
        # equal lists of holders may sit in other slots
        kept = self._query_made_for
        if kept is None or kept[0] is not holders or kept[1] is not index or kept[2] != block_size:
            self._query_plan = query_plan_of(holders, index, block_size)
            self._query_made_for = (holders, index, block_size)
        plan = self._query_plan
        if plan is None:
            return None
        answer: bytes
        try:
            answer, keys, longest = module.query_answer(*keying, plan, predicted)
        except Exception:  # a bug: the Python path answers, the log says it once
            self._failed("/query")
            return None
        index.note_plain_match(keys, longest)
        self.answered += 1
        return answer

    def choose(
        self, tokens: Sequence[int], holders: list[Holder], top: int
    ) -> tuple[array[int], list[HolderScore], bool] | None:
        """The best ``top`` of ``holders`` for a request of ``tokens`` (an ``array("I")``),
        best first, as :func:`~kvevents.router.decide.load_board.board_top_scores` scores them
        from the board's loads, predictions counted; with the request's keys (an
        ``array("Q")``) and whether predictions chose the best (the best on confirmed
        blocks alone is another holder). None when the Python path must choose.

        For :meth:`Router.route <kvevents.router.decide.router.Router.route>`'s one pass (the loads
        changed since the last request, as a relayed or recorded request changes them)
        of a request keyed with no adapter, salt or extra keys. The match is recorded
        as the index's own."""
        if top > self._module_top:
            return None
        plain = self._plain(tokens)
        if plain is None:
            return None
        module, index, _, keying, predicted = plain
        router = self.router
        board, weights, credits = router.loads, router.weights, index.credits
        # the objects themselves, as for the plans: an equal list of holders may sit in
        # other slots (the index's own list is a new one whenever a slot changes)
        everyone = index.holders()
        kept = self._seats_made_for
        if (
            kept is None
            or kept[0] is not holders
            or kept[1] is not everyone
            or kept[2] is not index
            or kept[3] is not board
            or kept[4] is not weights
            or kept[5] is not credits
        ):
            self._seats = seats_of(holders, index, board, weights, credits)
            self._seats_made_for = (holders, everyone, index, board, weights, credits)
        seats = self._seats
        if seats is None:
            return None
        try:
            keys, longest, by_prediction, best = module.board_choice(
                *keying, board.table(), seats[0], board.scale, seats[1], predicted, top
            )
        except Exception:  # a bug: the Python path chooses, the log says it once
            self._failed("choice")
            return None
        if not best[0][9]:
            return None  # no holder available to route to: the Python path words the error
        index.note_plain_match(keys, longest)
        scores = []
        for position, gpu, cached, prefill, pending, cost, recent, balance, routed, up, p in best:
            holder = holders[position]
            scores.append(
                HolderScore(
                    worker=holder.worker,
                    dp_rank=holder.dp_rank,
                    matched=HolderMatch(gpu, 0, 0),
                    cached_blocks=cached,
                    prefill_blocks=prefill,
                    pending_blocks=pending,
                    cost=cost,
                    routed=int(routed),
                    available=up,
                    recent_blocks=recent,
                    balance_blocks=balance,
                    predicted_blocks=p,
                )
            )
        self.chosen += 1
        return array("Q", keys), scores, by_prediction


def seats_of(
    holders: list[Holder],
    index: PrefixIndex,
    board: LoadBoard,
    weights: ScoringWeights,
    credits: TierCredits,
) -> Seats | None:
    """The native choice's seats of these candidates (see :data:`Seats`), or None when one
    has no slot the native match reads or a weight or credit is not a finite float."""
    figures = (
        weights.load_weight,
        weights.balance_weight,
        weights.foreign_request_blocks,
        credits.gpu,
        credits.cpu,
        credits.disk,
        weights.predicted_credit,
    )
    if not all(type(x) is float and math.isfinite(x) for x in figures):
        return None
    numbers = bytearray()
    for holder, board_slot in zip(holders, board.candidates(holders)[1], strict=True):
        slot = index.slot_of(holder)
        if slot is None or slot >= 64:
            return None
        numbers += _SEAT.pack(board_slot, slot)
    if not numbers:
        return None
    return bytes(numbers), figures


def query_plan_of(holders: list[Holder], index: PrefixIndex, block_size: int) -> QueryPlan | None:
    """The native ``/query``'s plan for these candidates (see :data:`QueryPlan`), or None
    when one has no slot the native match reads."""
    slots = array("q")
    fragments: list[bytes] = []
    for holder in holders:
        slot = index.slot_of(holder)
        if slot is None or slot >= 64:
            return None
        slots.append(slot)
        fragments.append(_holder_head(holder) + b',"matched_blocks":')
    head_tail = b',"block_size":' + _encode(block_size) + b',"matches":['
    return slots.tobytes(), tuple(fragments), head_tail


def plan_of(
    ranking: Ranking, index: PrefixIndex, credits: TierCredits, block_size: int
) -> Plan | None:
    """The native call's plan of ``ranking`` (see :data:`Plan`), or None when a figure
    is not a plain finite float (or int, for ``routed``) the native scoring can use."""
    pcredit = ranking.weights.predicted_credit
    if not all(
        type(c) is float and math.isfinite(c)
        for c in (credits.gpu, credits.cpu, credits.disk, pcredit)
    ):
        return None
    numbers = bytearray()
    fragments: list[bytes] = []
    for unavailable, own, pending, recent, routed, _, holder, balance in sorted(
        ranking.entries(), key=lambda entry: entry[5]
    ):
        slot = index.slot_of(holder)
        figures = (own, pending, recent)
        if slot is None or slot >= 64 or type(routed) is not int or not -(2**63) <= routed < 2**63:
            return None
        if not all(type(x) is float and math.isfinite(x) for x in figures):
            return None
        numbers += _CANDIDATE.pack(own, pending, recent, routed, int(unavailable), slot)
        head = _holder_head(holder)
        fragments += (
            head,
            head + b',"matched":{"gpu":',
            b',"pending_blocks":' + _encode(pending) + b',"cost":',
            b',"routed":'
            + _encode(routed)
            + b',"available":'
            + _encode(not unavailable)
            + b',"recent_blocks":'
            + _encode(recent)
            + b',"balance_blocks":'
            + _encode(balance)
            + b',"predicted_blocks":',
        )
    if not numbers:
        return None
    head_tail = b',"block_size":' + _encode(block_size)
    return (
        bytes(numbers),
        tuple(fragments),
        credits.gpu,
        credits.cpu,
        credits.disk,
        head_tail,
        pcredit,
    )


def _holder_head(holder: Holder) -> bytes:
    """A holder's answer entry up to its ``dp_rank`` value, as msgspec writes it."""
    return b'{"worker":' + _encode(holder.worker) + b',"dp_rank":' + _encode(holder.dp_rank)
