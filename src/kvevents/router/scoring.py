"""Routing cost: prefill left to do plus the work already waiting, per holder.

For a request of ``n`` full blocks and a holder ``h`` whose longest cached prefix is
``gpu`` + ``cpu`` + ``disk`` blocks (nested tiers, see :mod:`kvevents.index_types`):

.. code-block:: text

    prefill(h) = n - (gpu * credit_gpu + cpu * credit_cpu + disk * credit_disk)
    pending(h) = inflight_blocks(h)
                 + foreign_request_blocks * max(0, engine_requests(h) - inflight_requests(h))
    cost(h)    = prefill(h) + load_weight * pending(h)

``prefill`` is the blocks the holder must compute for this request (a block served
from CPU still costs a quarter of its prefill by default). ``pending`` is the work
queued on the holder, in blocks: the uncached blocks of requests this router sent and
has not seen finish, plus the requests the engine reports running or waiting
(``/load``) that this router did not send, each counted as ``foreign_request_blocks``.
The lowest cost wins; ties go to the lower ``pending``, then to the holder this router
has sent fewer requests so far, then to the earlier holder (so a cold start spreads
requests round-robin instead of piling them on holder 0).

Everything here is a pure function of its arguments: O(holders) per decision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from kvevents.index_types import DEFAULT_CREDITS, HolderMatch, TierCredits
from kvevents.signals import Holder

__all__ = ["HolderLoad", "HolderScore", "ScoringWeights", "choose", "pending_blocks", "score"]


class ScoringWeights(msgspec.Struct, frozen=True, kw_only=True):
    """Weights of the cost; see the module docstring. Both must be >= 0."""

    load_weight: float = 1.0
    """How many blocks of prefill one block of pending work is worth."""
    foreign_request_blocks: float = 8.0
    """Pending work assumed for one request the engine runs that this router did not send."""

    def __post_init__(self) -> None:
        for name in ("load_weight", "foreign_request_blocks"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"ScoringWeights: {name}={value!r} must be a number >= 0")


class HolderLoad(msgspec.Struct, kw_only=True):
    """What the router knows of one holder's load."""

    engine_requests: int = 0
    """Running plus waiting requests, as the engine's ``/load`` last reported."""
    inflight_requests: int = 0
    """Requests this router forwarded to the holder and has not seen finish."""
    inflight_blocks: float = 0.0
    """Uncached (prefill) blocks of those requests."""
    routed: int = 0
    """Requests this router has sent to the holder so far (the balance tie-breaker)."""
    available: bool = True
    """False when the engine reports the rank unavailable: never chosen."""


class HolderScore(msgspec.Struct, frozen=True, kw_only=True):
    """One holder's figures for one request."""

    worker: str
    dp_rank: int
    matched: HolderMatch
    cached_blocks: float
    """Credit-weighted cached blocks: gpu*credit_gpu + cpu*credit_cpu + disk*credit_disk."""
    prefill_blocks: float
    pending_blocks: float
    cost: float
    routed: int
    available: bool

    @property
    def holder(self) -> Holder:
        return Holder(self.worker, self.dp_rank)


def pending_blocks(load: HolderLoad, weights: ScoringWeights) -> float:
    """The holder's queued work in blocks (see the module docstring)."""
    foreign = max(0, load.engine_requests - load.inflight_requests)
    return load.inflight_blocks + weights.foreign_request_blocks * foreign


def score(
    n_blocks: int,
    holders: Sequence[Holder],
    matches: Mapping[Holder, HolderMatch],
    loads: Mapping[Holder, HolderLoad],
    *,
    credits: TierCredits = DEFAULT_CREDITS,
    weights: ScoringWeights | None = None,
) -> list[HolderScore]:
    """Score every holder for a request of ``n_blocks`` full blocks; best first.

    Holders missing from ``matches`` cache nothing of it; missing from ``loads``, they
    are idle. Unavailable holders come last, whatever their cost.
    """
    weights = weights or ScoringWeights()
    zero = HolderMatch(0, 0, 0)
    idle = HolderLoad()
    out = []
    for h in holders:
        m = matches.get(h, zero)
        load = loads.get(h, idle)
        cached = m.gpu * credits.gpu + m.cpu * credits.cpu + m.disk * credits.disk
        prefill = max(0.0, n_blocks - cached)
        pending = pending_blocks(load, weights)
        out.append(
            HolderScore(
                worker=h.worker,
                dp_rank=h.dp_rank,
                matched=m,
                cached_blocks=cached,
                prefill_blocks=prefill,
                pending_blocks=pending,
                cost=prefill + weights.load_weight * pending,
                routed=load.routed,
                available=load.available,
            )
        )
    order = {h: i for i, h in enumerate(holders)}
    out.sort(
        key=lambda s: (
            not s.available,
            s.cost,
            s.pending_blocks,
            s.routed,
            order[Holder(s.worker, s.dp_rank)],
        )
    )
    return out


def choose(scores: Sequence[HolderScore]) -> HolderScore:
    """The winner of :func:`score`'s ranking; ValueError when no holder is available."""
    if not scores or not scores[0].available:
        raise ValueError(
            "no available holder to route to: every engine rank is down or unknown; "
            "check the engines' /health and the router's /workers"
        )
    return scores[0]
