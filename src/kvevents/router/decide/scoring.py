"""Routing cost: prefill left to do, work waiting, and each holder's share of recent work.

For a request of ``n`` full blocks and a holder ``h`` whose longest cached prefix is
``gpu`` + ``cpu`` + ``disk`` blocks (nested tiers, see :mod:`kvevents.index.types`):

.. code-block:: text

    cached(h)  = gpu * credit_gpu + cpu * credit_cpu + disk * credit_disk
                 + predicted * predicted_credit
    prefill(h) = max(0, n - cached(h))
    pending(h) = inflight_blocks(h)
                 + foreign_request_blocks * max(0, engine_requests(h) - inflight_requests(h))
    recent(h)  = sum over the requests r this router sent to h:
                     blocks(r) * 0.5 ** (routed_since(r) / balance_half_life)
    balance(h) = max(0, recent(h) - min(recent(a) for every routable holder a))
    cost(h)    = prefill(h) + load_weight * pending(h) + balance_weight * balance(h)

``prefill`` is the blocks the holder must compute; ``predicted`` the blocks predictions
(:mod:`kvevents.index.predictions`) add to its confirmed prefix, so the cost, not a rule,
weighs a sibling's shared prefix against the holder's load. ``pending`` is the work queued
there now: the uncached blocks of this router's requests in flight, plus the requests the
engine reports (``/load``, vLLM's ``/metrics``) that this router did not send, each
``foreign_request_blocks``; requests begun and ended between two polls move
``engine_requests`` with ``inflight_requests`` (:meth:`LoadBoard.add_inflight
<kvevents.router.decide.load_board.LoadBoard.add_inflight>`). ``recent`` is the prompt
blocks this router sent the holder, halved every ``balance_half_life`` requests routed.

Why ``balance``: ``pending`` vanishes between requests, so with one request in flight
every holder looks idle and the holder of a block every request shares (a system prompt)
wins every new conversation, until one rank's cache takes the whole workload. ``recent``
does not vanish: new conversations go to the holder with the least recent work, and a
follow-up stays with its holder unless that holder's excess, times ``balance_weight``,
outweighs its cached prefix. The choices behind the defaults (``benchmarks/routing_weights.py``
replays them over several scenarios):

* ``load_weight`` is small because ``pending`` counts a prompt for as long as its request
  runs, though its prefill ends after the first step: a large weight lets any request in
  flight outweigh a cached conversation; not 0, so queues and other routers' requests
  still break ties.
* ``recent`` counts whole prompts, not their uncached part: a running request holds KV
  memory for its whole prompt and refreshes all of it in the holder's LRU.
* Decay per request routed, not per second: the balance means the same at any
  concurrency and engine speed, and idle time, when no cache changes, does not erase it.
* A continuous term, not a guard that routes by load alone past thresholds (SGLang's
  router): the guard also ends the collapse but gives up more prefix hits, and adds two
  thresholds to tune.

The lowest cost wins; ties go to the lower ``pending``, then the lower ``recent``, then
the holder sent fewer requests so far, then the earlier holder. Holders reported down or
seen stalled (:mod:`kvevents.router.decide.stalls`) rank after every other, whatever
their cost.

:func:`score`, the reference, and :func:`choose` are pure functions, O(holders). While the
loads change under every request (relayed ones), the best few come from one native scan of
the load table (:func:`~kvevents.router.decide.load_board.board_top_scores`); while they
hold still, from a :class:`Ranking`, which sorts once the holders as if none matched (each
costs ``n`` plus a part fixed by its load), then per request scores the matched ones and
adds the ``top`` best others (a match only lowers a cost), O(matched + top). All three
compute the cost through :mod:`kvevents.router.decide.cost`, where it is written once (its
C twin in :mod:`kvevents.kernels`): the two are ``score(...)[:top]`` to the bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from kvevents.errors import RouterNotReadyError
from kvevents.index.predictions import DEFAULT_PREDICTION_CREDIT
from kvevents.index.types import DEFAULT_CREDITS, HolderMatch, TierCredits
from kvevents.router.decide.cost import least_recent, own_part, request_part
from kvevents.types import Holder, NonNegativeFloat, PositiveFiniteFloat, check_bound

__all__ = [
    "HolderLoad",
    "HolderScore",
    "Ranking",
    "ScoringWeights",
    "choose",
    "pending_blocks",
    "score",
]


class ScoringWeights(msgspec.Struct, frozen=True, kw_only=True):
    """Weights of the cost; see the module docstring. All must be >= 0, the half-life > 0."""

    load_weight: NonNegativeFloat = 0.1
    """How many blocks of prefill one block of pending work is worth."""
    foreign_request_blocks: NonNegativeFloat = 8.0
    """Pending work assumed for one request the engine runs that this router did not send."""
    balance_weight: NonNegativeFloat = 0.05
    """How many blocks of prefill one block of excess recent work is worth."""
    balance_half_life: PositiveFiniteFloat = 64.0
    """Requests routed (to any holder) after which a request's share of ``recent`` halves."""
    predicted_credit: float = DEFAULT_PREDICTION_CREDIT
    """Worth of one predicted block, like a tier credit (0..1)."""

    def __post_init__(self) -> None:
        # a constructor call is not decoded, so msgspec does not check the Meta bounds itself
        for name, bound in (
            ("load_weight", NonNegativeFloat),
            ("foreign_request_blocks", NonNegativeFloat),
            ("balance_weight", NonNegativeFloat),
            ("balance_half_life", PositiveFiniteFloat),
        ):
            check_bound(getattr(self, name), bound, f"ScoringWeights: {name}")
        if not 0.0 <= self.predicted_credit <= 1.0:
            raise ValueError(
                f"ScoringWeights: predicted_credit={self.predicted_credit!r} must be between "
                "0 and 1 (the fraction of a block's prefill a predicted copy saves)"
            )

    @property
    def decay(self) -> float:
        """The factor ``recent`` is multiplied by per request routed."""
        return float(0.5 ** (1.0 / self.balance_half_life))


class HolderLoad(msgspec.Struct, kw_only=True):
    """What the router knows of one holder's load."""

    engine_requests: int = 0
    """Running plus waiting requests on the engine: the count its last poll reported
    (``/load``, or vLLM's ``/metrics``), plus the requests this router and its peers
    began there since, less those that ended since (never below 0)."""
    inflight_requests: int = 0
    """Requests this router forwarded to the holder and has not seen finish."""
    inflight_blocks: float = 0.0
    """Uncached (prefill) blocks of those requests."""
    routed: int = 0
    """Requests this router has sent to the holder so far."""
    available: bool = True
    """False when the engine reports the rank unavailable: never chosen."""
    recent_blocks: float = 0.0
    """Prompt blocks this router sent the holder, decayed (``recent`` in the module docstring)."""
    stalled: bool = False
    """True while the router sees the rank stalled (:mod:`kvevents.router.decide.stalls`):
    scored as unavailable, chosen only when no candidate is otherwise available."""

    @property
    def routable(self) -> bool:
        """Available and not stalled: what the ranking puts first."""
        return self.available and not self.stalled


# gc=False: one per request and free of reference cycles, so the collector never tracks it
class HolderScore(msgspec.Struct, frozen=True, kw_only=True, gc=False):
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
    recent_blocks: float = 0.0
    balance_blocks: float = 0.0
    """``recent`` above the least recently loaded available holder's."""
    predicted_blocks: int = 0
    """Blocks predictions add to ``matched`` (counted in ``cached_blocks`` at their credit)."""

    @property
    def holder(self) -> Holder:
        return Holder(self.worker, self.dp_rank)


def pending_blocks(load: HolderLoad, weights: ScoringWeights) -> float:
    """The holder's queued work in blocks (see the module docstring)."""
    recent = load.recent_blocks
    return own_part(
        load.engine_requests,
        load.inflight_requests,
        load.inflight_blocks,
        recent,
        recent,
        weights.load_weight,
        weights.balance_weight,
        weights.foreign_request_blocks,
    )[0]


def score(
    n_blocks: int,
    holders: Sequence[Holder],
    matches: Mapping[Holder, HolderMatch],
    loads: Mapping[Holder, HolderLoad],
    *,
    credits: TierCredits = DEFAULT_CREDITS,
    weights: ScoringWeights | None = None,
    predicted: Mapping[Holder, int] | None = None,
) -> list[HolderScore]:
    """Score every holder for a request of ``n_blocks`` full blocks; best first.

    Holders missing from ``matches`` cache nothing of it; missing from ``loads``, they
    are idle; missing from ``predicted`` (or it None), they have no predicted blocks.
    Unavailable and stalled holders come last, whatever their cost.
    """
    weights = weights or _DEFAULT_WEIGHTS
    get_load = loads.get
    held = [get_load(h, _IDLE) for h in holders]
    least = least_recent([load.recent_blocks for load in held if load.routable])
    gpu, cpu, disk = credits.gpu, credits.cpu, credits.disk
    lw, bw, fb = weights.load_weight, weights.balance_weight, weights.foreign_request_blocks
    pcredit = weights.predicted_credit
    get_match = matches.get
    get_predicted = predicted.get if predicted else None
    ranked: list[tuple[bool, float, float, float, int, int, HolderScore]] = []
    for i, h in enumerate(holders):
        load = held[i]
        recent = load.recent_blocks
        pending, balance, own = own_part(
            load.engine_requests,
            load.inflight_requests,
            load.inflight_blocks,
            recent,
            least,
            lw,
            bw,
            fb,
        )
        m = get_match(h, _ZERO)
        p = 0 if get_predicted is None else get_predicted(h, 0)
        cached, prefill, cost = request_part(n_blocks, m, p, own, gpu, cpu, disk, pcredit)
        available, routed = load.routable, load.routed
        # i is unique, so the ranking never compares the scores themselves
        ranked.append(
            (
                not available,
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
                    routed=routed,
                    available=available,
                    recent_blocks=recent,
                    balance_blocks=balance,
                    predicted_blocks=p,
                ),
            )
        )
    ranked.sort()
    return [entry[-1] for entry in ranked]


class Ranking:
    """The holders ranked by the part of their cost that is the same for every request.

    Built from the candidate ``holders`` (in their order, as :func:`score` takes them),
    the ``loads`` and the ``weights`` as they are now; it does not follow later changes
    (build a new one). :meth:`top` is then ``score(...)[:top]`` for any request, exactly
    (``tests/router/test_router_ranking.py`` checks it against :func:`score`).
    """

    __slots__ = ("_by_holder", "_entries", "_group_ends", "_rest", "holders", "weights")

    def __init__(
        self,
        holders: Sequence[Holder],
        loads: Mapping[Holder, HolderLoad],
        weights: ScoringWeights | None = None,
    ) -> None:
        self.holders = holders
        weights = self.weights = weights or _DEFAULT_WEIGHTS
        get_load = loads.get
        held = [get_load(h, _IDLE) for h in holders]
        least = least_recent([load.recent_blocks for load in held if load.routable])
        lw, bw, fb = weights.load_weight, weights.balance_weight, weights.foreign_request_blocks
        entries: list[_Entry] = []
        for i, h in enumerate(holders):
            load = held[i]
            recent = load.recent_blocks
            pending, balance, own = own_part(
                load.engine_requests,
                load.inflight_requests,
                load.inflight_blocks,
                recent,
                least,
                lw,
                bw,
                fb,
            )
            entries.append((not load.routable, own, pending, recent, load.routed, i, h, balance))
        entries.sort()  # i is unique: the holders and balances are never compared
        self._entries = entries
        # per entry, where its group (the entries with its availability and own part) ends
        ends = [len(entries)] * len(entries)
        for j in range(len(entries) - 2, -1, -1):
            here, after = entries[j], entries[j + 1]
            ends[j] = ends[j + 1] if (here[0], here[1]) == (after[0], after[1]) else j + 1
        self._group_ends = ends
        self._by_holder = {entry[6]: entry for entry in entries}
        self._rest: dict[tuple[int, int, type], list[_Ranked]] = {}
        """Per (blocks, count, type of a zero credit): :meth:`_nothing_cached`'s answer."""

    def entries(self) -> list[_Entry]:
        """The holders' figures, best first (see :data:`_Entry`); shared, do not change it."""
        return self._entries

    def top(
        self,
        n_blocks: int,
        matches: Mapping[Holder, HolderMatch],
        top: int,
        *,
        credits: TierCredits = DEFAULT_CREDITS,
        predicted: Mapping[Holder, int] | None = None,
    ) -> list[HolderScore]:
        """The first ``top`` (at least 1) of :func:`score`'s list for a request of
        ``n_blocks`` blocks with these matches and predictions; O(matched + top).

        The scores of holders that cache nothing of the request are the same objects
        from one request to the next while the ranking lives (see :meth:`_nothing_cached`)."""
        top = max(1, top)
        gpu, cpu, disk = credits.gpu, credits.cpu, credits.disk
        pcredit = self.weights.predicted_credit
        by_holder = self._by_holder
        ranked: list[_Ranked] = []
        touched = set(matches)
        if predicted:
            touched.update(predicted)
        scored: set[int] = set()  # positions of the holders scored here
        for h in touched:
            entry = by_holder.get(h)
            if entry is None:
                continue  # not a candidate: score() ignores it too
            scored.add(entry[5])
            m = matches.get(h, _ZERO)
            p = predicted.get(h, 0) if predicted else 0
            cached, prefill, cost = request_part(n_blocks, m, p, entry[1], gpu, cpu, disk, pcredit)
            score = _score_of(entry, m, cached, prefill, cost, p)
            ranked.append((entry[0], cost, entry[2], entry[3], entry[4], entry[5], score))
        # The others among the best ``top`` were nobody matched are the others among
        # the best ``top`` here: a match only lowers its holder's cost, so it never
        # passes another holder that would not have passed it anyway.
        rest = self._nothing_cached(n_blocks, top, credits)
        if not scored:
            return [item[6] for item in rest[:top]]
        for item in rest:
            if item[5] not in scored:
                ranked.append(item)
        ranked.sort()  # the positions are unique: the scores are never compared
        return [item[6] for item in ranked[:top]]

    def _nothing_cached(self, n_blocks: int, count: int, credits: TierCredits) -> list[_Ranked]:
        """At least the best ``count`` holders (all when fewer) as if none cached anything
        of a request of ``n_blocks`` blocks, with their sort keys, best first; kept per
        arguments while the ranking lives.

        Such holders cost the same prefill plus their own part, so they come in the
        entries' order, group by group of equal own parts. Within a group the order is
        exact, so at most ``count`` of a group can count; once ``count`` are taken, a
        later group counts only if its cost rounds to the cost of the last one taken
        (its later fields may then rank it first)."""
        gpu, cpu, disk = credits.gpu, credits.cpu, credits.disk
        pcredit = self.weights.predicted_credit
        nothing = request_part(n_blocks, _ZERO, 0, 0.0, gpu, cpu, disk, pcredit)[0]  # 0 or 0.0
        key = (n_blocks, count, type(nothing))
        found = self._rest.get(key)
        if found is not None:
            return found
        if len(self._rest) >= _REST_KEPT:
            self._rest.clear()
        entries, group_ends = self._entries, self._group_ends
        size, j, taken = len(entries), 0, 0
        last: tuple[bool, float] | None = None
        out: list[_Ranked] = []
        while j < size:
            head = entries[j]
            _, prefill, cost = request_part(n_blocks, _ZERO, 0, head[1], gpu, cpu, disk, pcredit)
            if taken >= count and (head[0], cost) != last:
                break
            end = min(group_ends[j], j + count)
            for entry in entries[j:end]:
                score = _score_of(entry, _ZERO, nothing, prefill, cost, 0)
                out.append((entry[0], cost, entry[2], entry[3], entry[4], entry[5], score))
            taken += end - j
            last = (head[0], cost)
            j = group_ends[j]
        out.sort()  # groups whose costs round to a tie rank by their later fields
        self._rest[key] = out
        return out


_Entry = tuple[bool, float, float, float, int, int, Holder, float]
"""(unavailable, own cost, pending, recent, routed, position, holder, balance)."""
_Ranked = tuple[bool, float, float, float, int, int, HolderScore]
"""A holder's score behind the fields it is ranked by (see :func:`score`)."""
_REST_KEPT = 256
"""Answers of :meth:`Ranking._nothing_cached` a ranking keeps (a bound: a few per request size,
one per ``top`` asked)."""


def _score_of(
    entry: _Entry, matched: HolderMatch, cached: float, prefill: float, cost: float, p: int
) -> HolderScore:
    """The score of a ranked holder (``entry``) for one request."""
    h = entry[6]
    return HolderScore(
        worker=h.worker,
        dp_rank=h.dp_rank,
        matched=matched,
        cached_blocks=cached,
        prefill_blocks=prefill,
        pending_blocks=entry[2],
        cost=cost,
        routed=entry[4],
        available=not entry[0],
        recent_blocks=entry[3],
        balance_blocks=entry[7],
        predicted_blocks=p,
    )


_DEFAULT_WEIGHTS = ScoringWeights()
_ZERO = HolderMatch(0, 0, 0)
_IDLE = HolderLoad()
"""The load of a holder missing from ``loads`` (read only: never handed out)."""


def choose(scores: Sequence[HolderScore]) -> HolderScore:
    """The winner of :func:`score`'s ranking; RouterNotReadyError when no holder is available."""
    if not scores or not scores[0].available:
        raise RouterNotReadyError(
            "no available holder to route to: every engine rank is down or unknown; "
            "check the engines' /health and the router's /workers"
        )
    return scores[0]
