"""The routing cost in code, written once: its parts as functions of plain numbers.

What the cost means, and why it has each term, is :mod:`kvevents.router.decide.scoring`'s
docstring; this module is its arithmetic. Every Python place that scores a holder
computes through it: :func:`~kvevents.router.decide.scoring.score` (the plain reference),
:class:`~kvevents.router.decide.scoring.Ranking` (the load's part once per ranking, the
request's per matched holder) and :func:`~kvevents.router.decide.load_board.board_top_scores`
(over the load board's rows). A change of the formula is a change here and in its C
twin: ``route_answer`` and ``board_choice`` in ``kernels/_native.c``, ``best_unmatched``
in ``kernels/load_scan.h`` (and that one's statement, :mod:`kvevents.kernels.spec`).

Invariants:

* the float operations and their order are part of the definition: the C twin does the
  same ones in the same order, and the tests compare every path's figures with
  ``score()``'s exactly, so a rewrite equal in real numbers is not equal here;
* ``cost = prefill + own``, the own part added last: it does not depend on the request,
  so the holders that cache nothing of a request rank among themselves by it alone;
* a match or a prediction only lowers a cost (credits are at least 0).

One function for the load's part and one for the request's, not one per term: the hot
paths call them per holder scored, and that split is the one a ranking needs. The
parameters are plain numbers, as the C's are: no weight or credit attribute is read per
holder, and the board's rows and a ``HolderLoad``'s fields go in alike.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvevents.index.types import HolderMatch

__all__ = ["least_recent", "own_part", "request_part"]


def least_recent(recents: Iterable[float]) -> float:
    """The least of the routable holders' recent work (``recents``), 0.0 when there is
    none: the level each holder's balance is measured from."""
    return min(recents, default=0.0)


def own_part(
    engine_requests: float,
    inflight_requests: float,
    inflight_blocks: float,
    recent: float,
    least: float,
    load_weight: float,
    balance_weight: float,
    foreign_request_blocks: float,
) -> tuple[float, float, float]:
    """A holder's ``(pending, balance, own)``, the part of its cost no request changes.

    ``pending`` is the blocks in flight plus ``foreign_request_blocks`` per engine
    request beyond this router's own (none when the engine counts fewer); ``balance``
    is the holder's ``recent`` work above ``least`` (:func:`least_recent`), never
    below 0; ``own`` weighs the two."""
    foreign = engine_requests - inflight_requests
    pending = inflight_blocks + (foreign_request_blocks * foreign if foreign > 0 else 0.0)
    balance = recent - least if recent > least else 0.0
    return pending, balance, load_weight * pending + balance_weight * balance


def request_part(
    n_blocks: float,
    matched: HolderMatch,
    predicted: int,
    own: float,
    gpu: float,
    cpu: float,
    disk: float,
    predicted_credit: float,
) -> tuple[float, float, float]:
    """A holder's ``(cached, prefill, cost)`` for a request of ``n_blocks`` blocks.

    ``cached`` is its ``matched`` blocks at their tiers' credits plus its ``predicted``
    blocks at ``predicted_credit``; ``prefill`` the blocks left to compute, never below
    0; ``cost`` adds its ``own`` part (:func:`own_part`). With nothing matched or
    predicted, ``cached`` is ``0`` times the credits: 0.0 for float credits."""
    on_gpu, on_cpu, on_disk = matched
    cached = on_gpu * gpu + on_cpu * cpu + on_disk * disk
    if predicted:
        cached += predicted * predicted_credit
    prefill = n_blocks - cached if n_blocks > cached else 0.0
    return cached, prefill, prefill + own
