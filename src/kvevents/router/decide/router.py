"""Router: the prefix index, holder loads and the routing decision, usable in-process.

The HTTP service (:mod:`kvevents.cli.router`) is a thin shell around this class; a demo
or a test may drive it directly: feed it the subscriber's items (:meth:`Router.handle`)
and engines' loads (:meth:`Router.update_load`), ask :meth:`Router.query` /
:meth:`Router.route`. Requests it forwards are bracketed by :meth:`Router.begin` and
:meth:`Router.finish`, so its own in-flight work counts as load and the prompt adds to
the holder's recent work; :meth:`Router.route` alone changes nothing.

* Block sizes: every request is keyed with one block size, checked against declared and
  observed ones by :class:`~kvevents.subscribe.block_sizes.BlockSizes`; a size that came
  from the engines follows them, and the index then starts over.
* Reuse: a holder's match of a request counts at most the blocks an engine reuses of
  it, every full block but a block-aligned prompt's last (:mod:`kvevents.index.reusable`),
  in both the Python and the native path; the keys it predicts are every full block,
  as the engine stores them all.
* Policies: ``kv-aware`` (:mod:`kvevents.router.decide.scoring`) or ``round-robin`` (for
  comparisons; scores are still computed and reported).
* Predictions (``prediction_ttl_s``): :meth:`Router.begin` and :meth:`Router.record`
  predict the request's blocks on the chosen holder (:mod:`kvevents.index.predictions`);
  a failed :meth:`Router.finish` withdraws them.
* Signals: a ``reset`` and a ``loss`` both clear the holder's blocks: after a loss the
  index cannot know which removals it missed, and stale blocks would draw requests
  again and again, while dropping them costs at most one prefill per prefix. A loss keeps
  the holder's predictions: they stand for requests this router just sent, which the
  missed events say nothing of (a router joining a busy engine gets a loss while its
  first sibling bursts are being routed).
* Models: ``model`` limits the candidates to the engines serving it, or whose models are
  unknown (:mod:`kvevents.router.decide.models`); an adapter's name also keys the
  request under it. Candidates per model are cached until the catalog or holders change.
* Batches and pools: :meth:`Router.route_batch` puts several prompts on one holder
  (:mod:`kvevents.router.decide.batch`); :meth:`Router.key_request` and
  :meth:`Router.route_keyed` choose among a subset, as P/D's pools need.
* Stalls (``stall_after_s``): a holder whose requests stop completing, or whose engine
  stops answering, ranks after every available one (:mod:`kvevents.router.decide.stalls`).

Feeding, deciding, in-flight bookkeeping and peers' notes all update the same loads, so
they stay on one class. Not thread-safe: call it from one thread (the service's loop).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple, get_args

import msgspec

from kvevents.errors import RouterNotReadyError
from kvevents.index.predictions import DEFAULT_PREDICTION_TTL_S
from kvevents.index.prefix_index import DEFAULT_MAX_ENTRIES, PrefixIndex
from kvevents.index.reusable import reusable_blocks
from kvevents.index.types import DEFAULT_CREDITS, HolderMatch, TierCredits
from kvevents.router.decide.batch import combine_scores
from kvevents.router.decide.load_board import LoadBoard, board_top_scores
from kvevents.router.decide.models import ModelCatalog, UnknownModelError
from kvevents.router.decide.native_route import NativeRoute
from kvevents.router.decide.scoring import (
    HolderLoad,
    HolderScore,
    Ranking,
    ScoringWeights,
    choose,
)
from kvevents.router.decide.stalls import StallWatch
from kvevents.subscribe.block_sizes import BlockSizes
from kvevents.subscribe.items import Delivery, Gap, Loss, Removed, Reset, Signal, Unreachable
from kvevents.types import Holder

log = logging.getLogger("kvevents.router")

__all__ = ["POLICIES", "KeyedRequest", "Policy", "RouteDecision", "Router", "Ticket"]

_ONE_PASS_TOP = 16
"""The most scores a request takes in one pass (each holder is compared with the
``top``-th best so far; past this many, a ranking is built instead)."""

_NEVER = float("inf")

Policy = Literal["kv-aware", "round-robin"]
"""How :meth:`Router.route` chooses (see the module docstring)."""
POLICIES: tuple[Policy, ...] = get_args(Policy)


# gc=False: one per request and free of reference cycles, so the collector never tracks it
class RouteDecision(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The chosen holder for a request, with every holder's score, best first (only the
    best few when :meth:`Router.route` was given ``top``)."""

    worker: str
    dp_rank: int
    n_blocks: int
    """The request's full blocks: its size. A holder's match counts at most the blocks an
    engine reuses of them (every one but a block-aligned prompt's last, recomputed)."""
    block_size: int
    """Tokens per block; 0 while no engine has told it (no block stored yet)."""
    scores: list[HolderScore]
    policy: Policy = "kv-aware"
    keys: Sequence[int] = msgspec.field(default_factory=list)
    """The request's content keys (what :meth:`Router.begin` predicts on the holder): an
    ``array("Q")`` when the compiled kernel keyed them, else a list."""
    by_prediction: bool = False
    """True when the choice differs from what confirmed blocks alone would have chosen."""
    candidates: int = 0
    """How many holders were scored: ``len(scores)`` unless routed with ``top``."""
    decays: bool = True
    """Counting it (:meth:`Router.begin`, :meth:`Router.record`) advances the decay of
    every holder's recent work by one request; False for a second choice made for the
    same request (P/D's prefill leg, whose decode leg advances it), so that recent work
    halves every ``balance_half_life`` requests in both modes."""

    @property
    def holder(self) -> Holder:
        return Holder(self.worker, self.dp_rank)

    @property
    def chosen(self) -> HolderScore:
        return self.scores[0]

    @property
    def matched_tokens(self) -> int:
        """Tokens of the request the chosen holder has cached, in any tier, and will
        reuse (a block-aligned prompt's last block is computed again)."""
        m = self.chosen.matched
        return (m.gpu + m.cpu + m.disk) * self.block_size

    @property
    def predicted_tokens(self) -> int:
        """Tokens of the request predicted (not yet confirmed) on the chosen holder."""
        return self.chosen.predicted_blocks * self.block_size


class KeyedRequest(NamedTuple):
    """A request keyed and matched once (:meth:`Router.key_request`), to be routed among
    any subset of its candidates (:meth:`Router.route_keyed`)."""

    holders: list[Holder]
    """The candidates: the holders serving the request's model (shared: do not change it)."""
    keys: list[Sequence[int]]
    """Per prompt, its content keys."""
    matched: list[tuple[dict[Holder, HolderMatch], dict[Holder, int]]]
    """Per prompt, each holder's confirmed match and the blocks predictions add."""


class Ticket(msgspec.Struct, frozen=True, gc=False):
    """An in-flight request: what :meth:`Router.finish` takes back off the holder's load."""

    holder: Holder
    blocks: float
    id: int = 0
    """Unique within this router: names the request in load notes to peer routers."""
    began: float = 0.0
    """When it began (the router's clock), while stalls are watched; else 0.0."""


NoteKind = Literal["routed", "begin", "finish"]
NoteListener = Callable[[NoteKind, Holder, int, "Ticket | None", bool], None]
"""Called with ``(kind, holder, prompt_blocks, ticket, decays)`` for every ``routed``/
``begin``/``finish`` of this router (see :mod:`kvevents.router.fleet.peers`); ``decays``:
the decision's :attr:`RouteDecision.decays` (True for a ``finish``)."""


class Router:
    """KV-aware routing over a :class:`~kvevents.index.prefix_index.PrefixIndex`; see the module docstring."""

    def __init__(
        self,
        *,
        block_size: int | None = None,
        credits: TierCredits = DEFAULT_CREDITS,
        weights: ScoringWeights | None = None,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        prediction_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        stall_after_s: float | None = None,
    ) -> None:
        self.index = PrefixIndex(
            block_size=block_size,
            max_entries=max_entries,
            credits=credits,
            prediction_ttl_s=(
                DEFAULT_PREDICTION_TTL_S if prediction_ttl_s is None else prediction_ttl_s
            ),
            clock=clock,
        )
        self.predicting = prediction_ttl_s is not None
        self.decided_by_prediction = 0
        """Routed requests (begun or recorded) whose holder a prediction chose."""
        self.predictions_made = 0
        """Requests whose blocks were predicted on their holder."""
        self._predicted_keys: dict[int, tuple[list[int], float]] = {}
        """Per in-flight ticket id: the keys its request predicted and their deadline."""
        self.block_sizes = BlockSizes(shared=True, size=block_size, source="router --block-size")
        self.block_sizes.followed = lambda: self.index.holders()
        self.block_sizes.on_change = self._block_size_changed
        self._turns: dict[str, int] = {}
        """Round-robin's next turn per rotation: one for every holder, one per P/D pool."""
        self.weights = weights or ScoringWeights()
        self.loads = LoadBoard()
        """Per holder, what the router knows of its load: a read-only mapping to
        ``HolderLoad`` copies (:mod:`~kvevents.router.decide.load_board`). It changes only
        through this class's methods (``update_load``, ``begin``, ``remote_inflight``...),
        which also tell the ranking :meth:`route` keeps for ``top`` that it is out of date."""
        self.signals: Counter[tuple[str, Holder | None]] = Counter()
        self.batches_applied = 0
        self.holders_removed = 0
        """Holders taken out (their engine no longer has the rank)."""
        self.apply_failures = 0
        """Batches whose applying raised (a bug): each one's holder was cleared."""
        self.routes: Counter[Holder] = Counter()
        self.note_listeners: list[NoteListener] = []
        self._tickets = itertools.count(1)
        self.models = ModelCatalog()
        """Which engine serves which model (see the module docstring)."""
        self._model_routes: dict[str, tuple[list[Holder], str | None]] = {}
        self._model_routes_key = (-1, -1, -1, -1)
        self._loads_version = 0
        """Counts changes of ``loads`` made through this class's methods (the rankings' key)."""
        self._rankings: dict[int, Ranking] = {}
        """Per candidate list (by identity), its :class:`Ranking` at ``_rankings_version``."""
        self._rankings_version = -1
        self._one_pass_version = -1
        """The loads' version at the last one-pass choice (``route(top=...)`` without a
        ranking): a second request at the same version builds the ranking."""
        self.native = NativeRoute(self)
        """The plain ``/route`` and ``/query`` answered in one native call
        (:mod:`kvevents.router.decide.native_route`)."""
        self.clock = clock
        self.stall_watch = None if stall_after_s is None else StallWatch(self.loads, stall_after_s)
        """Which holders are stalled (see the module docstring); None: stalls are not watched."""

    # --- feeding ----------------------------------------------------------------------

    def add_holder(
        self,
        holder: Holder,
        *,
        block_size: int | None = None,
        source: str = "server_info",
        origin: str | None = None,
    ) -> None:
        """Make a holder routable (known from discovery or configuration before any event).

        ``block_size`` is the size ``source`` ("server_info", "configured") declares for
        it, checked against the router's (``origin`` says where, in words, for the log).
        """
        holder = Holder(*holder)
        if block_size is not None and not self.declare_block_size(
            holder, block_size, source=source, origin=origin
        ):
            block_size = None  # keep the router's size for this holder's events
        self.index.add_holder(holder, block_size=block_size)
        self.loads.slot(holder)
        self._loads_version += 1

    def remove_holder(self, holder: Holder) -> None:
        """``holder`` is gone (its engine no longer has the rank): not routable, and what
        the index held for it dropped. Its first batch, should it come back, adds it again."""
        self.index.remove_holder(holder)
        self.block_sizes.forget(holder)
        if self.stall_watch is not None:
            self.stall_watch.forget(holder)
        self.holders_removed += 1
        self._loads_version += 1

    def _block_size_changed(self, size: int) -> None:
        """Every engine now keys its blocks at ``size`` (:class:`BlockSizes`): what the
        index keyed at the old size can match no request keyed at the new one."""
        index = self.index
        for holder in index.holders():
            index.clear_holder(holder)
            index.add_holder(holder, block_size=size)
        index.block_size = size
        self._loads_version += 1

    def restore_index(self, index: PrefixIndex) -> None:
        """Go on from ``index`` (a peer's snapshot, ``--peer``) instead of the empty one:
        its holders, blocks and applied seqs; this router's memory bound (a snapshot past
        it is pruned at once), credits and block size (when it has one) stay. Call before
        any event is handled.

        ValueError for a snapshot at another block size than this router's: its keys were
        cut at its own, so under this router's they would match nothing."""
        size = self.index.block_size
        if size is not None and index.block_size not in (None, size):
            raise ValueError(
                f"a snapshot at block size {index.block_size} cannot be restored into a "
                f"router at block size {size}"
            )
        index.set_max_entries(self.index.max_entries)  # pruned now if the snapshot is over it
        index.credits = self.index.credits
        if size is not None:
            index.block_size = size
        elif index.block_size is not None:
            # the engines' size as the peer knew it: should they say another now (a
            # rolling change of page size), the router follows them (BlockSizes)
            self.block_sizes.assume(index.block_size, "a peer's snapshot")
        self.index = index
        for holder in index.holders():
            self.loads.slot(holder)
        self._loads_version += 1

    def declare_block_size(
        self, holder: Holder, block_size: int, *, source: str, origin: str | None = None
    ) -> bool:
        """Check a block size declared for ``holder`` (which need not be routable yet).

        The first size known becomes the router's; False on a mismatch (logged, counted).
        """
        holder = Holder(*holder)
        where = origin or f"{source} of {holder.worker}"
        if not (isinstance(block_size, int) and block_size >= 1):
            raise ValueError(f"{where}: block size {block_size!r} is not a positive int")
        ok = self.block_sizes.declare(holder, block_size, source, where)
        if self.index.block_size is None:
            self.index.block_size = self.block_sizes.size
        return ok

    def handle(self, item: Delivery | Signal) -> None:
        """Apply one subscriber item: a batch goes to the index, a reset or loss clears the holder."""
        for _ in self.handle_steps(item, 0):
            pass

    def handle_steps(self, item: Delivery | Signal, step: int) -> Iterator[None]:
        """:meth:`handle`, pausing after each ``step`` blocks of a long chain (see
        :meth:`PrefixIndex.apply_steps <kvevents.index.prefix_index.PrefixIndex.apply_steps>`):
        the service answers requests at the pauses. The batch's seq is recorded once
        it is applied whole; handle nothing else until the generator is exhausted."""
        if isinstance(item, Delivery):
            if item.holder not in self.loads:
                self.loads.slot(item.holder)
                self._loads_version += 1
            try:
                batch = self.block_sizes.check(item.holder, item.batch)
                yield from self.index.apply_steps(item.holder, batch, step)
            except Exception:  # a bug, not the stream's fault: the consumer must go on
                self.apply_failures += 1
                log.exception(
                    "applying batch seq %d of %s rank %d failed; its entries are dropped "
                    "until the engine stores them again",
                    item.seq,
                    item.holder.worker,
                    item.holder.dp_rank,
                )
                # half applied, its entries are not to be trusted: none beats wrong ones
                self.index.clear_holder(item.holder, predictions=False)
            self.index.applied_seqs[item.holder] = item.seq
            self.batches_applied += 1
            return
        holder = item.holder
        self.signals[(item.kind, holder)] += 1
        if isinstance(item, (Reset, Loss)) and holder is not None:
            # a loss keeps the holder's predictions: they stand for requests this router
            # just sent, which the missed events say nothing about
            self.index.clear_holder(holder, predictions=isinstance(item, Reset))
            # cleared as of the loss's last seq; a reset starts the stream over
            if isinstance(item, Loss):
                self.index.applied_seqs[holder] = item.last_seq
            else:
                self.index.applied_seqs.pop(holder, None)
                self.block_sizes.forget(holder)  # restarted: it may come back at another size
        elif isinstance(item, Removed) and holder is not None:
            self.remove_holder(holder)
        elif isinstance(item, (Gap, Unreachable)):
            pass  # informational: the missed batches follow, or discovery retries

    def requests_ended(self, worker: str) -> dict[int, float]:
        """Per rank of ``worker``, the requests in flight there that have ended so far
        (:meth:`LoadBoard.ended <kvevents.router.decide.load_board.LoadBoard.ended>`): what a
        load poll notes as the engine's answer begins to arrive, for
        :meth:`update_load`'s ``ended_before``."""
        loads = self.loads
        return {h.dp_rank: loads.ended(h) for h in loads.holders_of(worker)}

    def update_load(
        self, worker: str, body: dict[str, Any], *, ended_before: dict[int, float] | None = None
    ) -> None:
        """Take an engine's ``/load`` body: ``{"ranks": [{"dp_rank", "running", "waiting", "available"}]}``.

        ``ended_before``: :meth:`requests_ended` as it was when the engine's answer
        began to arrive (the poller notes it as the answer's head is read). The engine
        counted before it answered, so the requests that ended since may be in its
        count, though the board has already taken them out (:meth:`LoadBoard.add_inflight
        <kvevents.router.decide.load_board.LoadBoard.add_inflight>`): they are taken out of the
        count too, so that none lingers as a foreign request until the next poll. One
        that ended before the answer came (its own answer arrived first) is not taken
        out: the engine had let it go when it counted. (Noted when the poll asked, such
        requests were taken out a second time, and the rank's other requests counted
        short by as many until the next poll.) The count never goes below zero.
        """
        ranks = body.get("ranks")
        if not isinstance(ranks, list):
            raise ValueError(
                f"/load of {worker} has no 'ranks' list; expected the kvevents engine's "
                '{"dp_size": N, "ranks": [{"dp_rank", "running", "waiting"}, ...]}'
            )
        for entry in ranks:
            if not isinstance(entry, dict) or not isinstance(entry.get("dp_rank"), int):
                continue
            holder = Holder(worker, entry["dp_rank"])
            if holder not in self.loads:
                self.loads.slot(holder)
                self._loads_version += 1
            if self.index.slot_of(holder) is None:
                self.index.add_holder(holder)
            running = entry.get("running", 0)
            waiting = entry.get("waiting", 0)
            count: int | None = None
            if isinstance(running, int) and isinstance(waiting, int):
                count = running + waiting
                before = None if ended_before is None else ended_before.get(holder.dp_rank)
                if before is not None and count > 0:
                    count = max(0, count - int(self.loads.ended(holder) - before))
            if self.loads.set_engine(holder, bool(entry.get("available", True)), count):
                self._loads_version += 1  # an idle engine's polls change nothing

    def set_worker_available(self, worker: str, available: bool) -> None:
        """Mark every rank of an engine (un)available, e.g. when its ``/load`` stops answering."""
        if self.loads.set_worker_available(worker, available):
            self._loads_version += 1  # a down engine's polls say so again and again

    # --- deciding ---------------------------------------------------------------------

    def _keys(
        self,
        token_ids: Sequence[int],
        lora: str | int | None,
        cache_salt: str | None,
        extra_keys: Sequence[Any] | None = None,
    ) -> Sequence[int]:
        return self.index.request_keys(
            token_ids, lora=lora, cache_salt=cache_salt, extra_keys=extra_keys
        )

    def candidates(self, model: str | None) -> tuple[list[Holder], str | None]:
        """The holders that may take a request for ``model``, and the adapter it keys
        under (None: the base model's namespace); see the module docstring.

        Every holder when ``model`` is None or no engine's models are known.
        :class:`~kvevents.router.decide.models.UnknownModelError` when no engine serves it.
        The list is shared: do not change it.
        """
        if model is None or not self.models.known:
            return self.holders(), None
        # loads gain an entry per new holder; removals take one from the index, and a
        # removed holder that comes back puts it back
        key = (self.models.version, len(self.loads), self.holders_removed, len(self.holders()))
        if key != self._model_routes_key:
            self._model_routes.clear()
            self._model_routes_key = key
        found = self._model_routes.get(model)
        if found is None:
            serves = self.models.serves
            holders = [h for h in self.holders() if serves(h.worker, model)]
            if not holders and model not in self.models.names():
                raise UnknownModelError(model, self.models.names())
            found = (holders, model if self.models.adapter(model) else None)
            if holders:  # only models that route are kept: unknown names never grow it
                self._model_routes[model] = found
        return found

    def query(
        self,
        token_ids: Sequence[int],
        *,
        lora: str | int | None = None,
        cache_salt: str | None = None,
        model: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> dict[Holder, HolderMatch]:
        """Every candidate holder's longest cached prefix of the request, per tier, in blocks,
        at most the blocks an engine reuses of it (:mod:`kvevents.index.reusable`).

        ``extra_keys``: per block, the keys an engine adds to its hash (images; see
        :meth:`PrefixIndex.keys_for`); ValueError when they cannot be keyed.
        """
        return self.query_predicted(
            token_ids, lora=lora, cache_salt=cache_salt, model=model, extra_keys=extra_keys
        )[0]

    def query_predicted(
        self,
        token_ids: Sequence[int],
        *,
        lora: str | int | None = None,
        cache_salt: str | None = None,
        model: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> tuple[dict[Holder, HolderMatch], dict[Holder, int]]:
        """:meth:`query`, and per holder the blocks predictions add (holders with some)."""
        if self.index.block_size is None:
            raise RouterNotReadyError(
                "the block size is not known yet: no engine has advertised one or stored a "
                "block; give the router --block-size, or retry once an engine has; see /workers"
            )
        holders, adapter = self.candidates(model)
        keys = self._keys(token_ids, adapter if lora is None else lora, cache_salt, extra_keys)
        found, predicted = self._matched(keys, len(token_ids))
        return {h: found.get(h, HolderMatch(0, 0, 0)) for h in holders}, predicted

    def _matched(
        self, keys: Sequence[int], n_tokens: int
    ) -> tuple[dict[Holder, HolderMatch], dict[Holder, int]]:
        """Per holder with any, its confirmed match of ``keys`` (the full blocks of a prompt
        of ``n_tokens`` tokens), and the blocks predictions add per holder (one lookup of
        the index for both). Only the blocks an engine reuses are matched, every key but a
        block-aligned prompt's last (:mod:`kvevents.index.reusable`): the answers, the
        headers and the cost promise no block the engine will compute again."""
        size = self.index.block_size
        reusable = None if size is None else reusable_blocks(n_tokens, size)
        result = self.index.match_keys(keys, reusable=reusable)
        return result.by_holder(), self.index.predicted(keys, result)

    def _score(
        self,
        n_blocks: int,
        holders: list[Holder],
        found: dict[Holder, HolderMatch],
        predicted: dict[Holder, int] | None,
    ) -> list[HolderScore]:
        # score() exactly, every holder in order, without a HolderLoad copy per holder
        return board_top_scores(
            self.loads,
            holders,
            n_blocks,
            found,
            len(holders),
            credits=self.index.credits,
            weights=self.weights,
            predicted=predicted,
        )

    def route(
        self,
        token_ids: Sequence[int],
        *,
        lora: str | int | None = None,
        cache_salt: str | None = None,
        policy: Policy = "kv-aware",
        model: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        top: int | None = None,
    ) -> RouteDecision:
        """Choose the holder for a request (see :mod:`kvevents.router.decide.scoring` for the cost).

        ``policy`` is one of :data:`POLICIES` (see the module docstring); ``model``
        limits the candidates to the engines serving it; ``extra_keys`` as in :meth:`query`.
        ``top``: the decision's ``scores`` are only the best ``top`` (at least 1), found
        without scoring every holder (:class:`~kvevents.router.decide.scoring.Ranking`, kept
        until the loads change and built by the second request that finds them
        unchanged; with the loads changed since the last request: the load table,
        :func:`~kvevents.router.decide.load_board.board_top_scores`); None scores them all. The choice
        is the same either way.
        :class:`~kvevents.errors.RouterNotReadyError` while no rank is known or available.
        """
        if top is None or policy != "kv-aware":
            decision = self.route_batch(
                (token_ids,),
                lora=lora,
                cache_salt=cache_salt,
                policy=policy,
                model=model,
                extra_keys=extra_keys,
            )
            if top is not None:
                decision = msgspec.structs.replace(decision, scores=decision.scores[: max(1, top)])
            return decision
        self._watch_stalls()
        try:
            return self._route_top(token_ids, lora, cache_salt, model, extra_keys, top)
        except RouterNotReadyError:
            if not self.loads.any_stalled:
                raise
            with self._stalls_lifted():  # none is routable but some are only stalled
                return self._route_top(token_ids, lora, cache_salt, model, extra_keys, top)

    def _route_top(
        self,
        token_ids: Sequence[int],
        lora: str | int | None,
        cache_salt: str | None,
        model: str | None,
        extra_keys: Sequence[Any] | None,
        top: int,
    ) -> RouteDecision:
        """:meth:`route`'s kv-aware choice with ``top``."""
        holders, adapter = self.candidates(model)
        if not holders:
            raise self._no_rank(model)
        if (
            top <= _ONE_PASS_TOP
            and self._one_pass_version != self._loads_version
            and adapter is None
            and lora is None
            and not cache_salt
            and not extra_keys
            and self._kept_ranking(holders) is None
        ):
            # the one pass below, in one native call (a relayed or recorded request's
            # usual case: each one changes the loads)
            chosen = self.native.choose(token_ids, holders, top)
            if chosen is not None:
                self._one_pass_version = self._loads_version
                native_keys, scores, by_prediction = chosen
                return RouteDecision(
                    worker=scores[0].worker,
                    dp_rank=scores[0].dp_rank,
                    n_blocks=len(native_keys),
                    block_size=self.index.block_size or 0,
                    scores=scores,
                    keys=native_keys,
                    by_prediction=by_prediction,
                    candidates=len(holders),
                )
        keys = (
            self._keys(token_ids, adapter if lora is None else lora, cache_salt, extra_keys)
            if self.index.block_size is not None
            else []  # nothing is stored anywhere yet: by load alone (see route_batch)
        )
        found, predicted = self._matched(keys, len(token_ids))
        credits = self.index.credits
        n_blocks = len(keys)
        ranking = self._kept_ranking(holders)
        if ranking is None and (
            top > _ONE_PASS_TOP or self._one_pass_version == self._loads_version
        ):
            ranking = self._ranking(holders)  # the loads held still since the last request
        if ranking is None:
            # One answer while the loads changed since the last request (a relayed or
            # recorded request changes them each time): one pass, no ranking built for it.
            self._one_pass_version = self._loads_version

            def best_of(
                with_predictions: dict[Holder, int] | None, count: int
            ) -> list[HolderScore]:
                return board_top_scores(
                    self.loads,
                    holders,
                    n_blocks,
                    found,
                    count,
                    credits=credits,
                    weights=self.weights,
                    predicted=with_predictions,
                )

            scores = best_of(predicted, top)
            best = choose(scores)
            first = best_of(None, 1)[0] if best.predicted_blocks else best
        else:
            scores = ranking.top(n_blocks, found, top, credits=credits, predicted=predicted)
            best = choose(scores)
            # the best on confirmed blocks alone: again O(matched), no second lookup
            first = (
                ranking.top(n_blocks, found, 1, credits=credits)[0]
                if best.predicted_blocks
                else best
            )
        by_prediction = first.worker != best.worker or first.dp_rank != best.dp_rank
        return RouteDecision(
            worker=best.worker,
            dp_rank=best.dp_rank,
            n_blocks=n_blocks,
            block_size=self.index.block_size or 0,
            scores=scores,
            keys=keys,
            by_prediction=by_prediction,
            candidates=len(holders),
        )

    def _ranking(self, holders: list[Holder]) -> Ranking:
        """The :class:`Ranking` of a candidate list, as the loads are now."""
        ranking = self._kept_ranking(holders)
        if ranking is None:
            if self._loads_version != self._rankings_version or len(self._rankings) > 64:
                self._rankings.clear()
                self._rankings_version = self._loads_version
            ranking = self._rankings[id(holders)] = Ranking(
                holders, self.loads.snapshot(), self.weights
            )
        return ranking

    def _kept_ranking(self, holders: list[Holder]) -> Ranking | None:
        """The kept :class:`Ranking` of a candidate list when the loads have not changed
        since it was made, else None."""
        if self._loads_version != self._rankings_version:
            return None
        ranking = self._rankings.get(id(holders))
        if ranking is None or ranking.holders is not holders or ranking.weights is not self.weights:
            return None
        return ranking

    @staticmethod
    def _no_rank(model: str | None) -> RouterNotReadyError:
        return RouterNotReadyError(
            "no engine rank is known yet"
            + ("" if model is None else f" for model {model!r}")
            + ": the router is still discovering its engines, or none answers; see /workers"
        )

    def route_batch(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        lora: str | int | None = None,
        cache_salt: str | None = None,
        policy: Policy = "kv-aware",
        model: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> RouteDecision:
        """Choose one holder for every prompt of a batch: the lowest summed cost.

        Each prompt is matched and scored as :meth:`route` scores one request; each
        holder's scores are then summed (:func:`~kvevents.router.decide.batch.combine_scores`),
        and the decision's ``n_blocks`` and ``keys`` cover every prompt. One prompt is
        exactly :meth:`route`.
        """
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r} is not one of {', '.join(POLICIES)}")
        request = self.key_request(
            prompts, lora=lora, cache_salt=cache_salt, model=model, extra_keys=extra_keys
        )
        if not request.holders:
            raise self._no_rank(model)
        return self._decide(request, request.holders, policy)

    def key_request(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        lora: str | int | None = None,
        cache_salt: str | None = None,
        model: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> KeyedRequest:
        """A request's candidates (those serving ``model``), its keys per prompt and their
        matches in the index, looked up once: :meth:`route_keyed` then chooses among any
        subset of the candidates (the pools of disaggregated serving,
        :mod:`kvevents.router.decide.pd`) without keying or matching again."""
        if not prompts:
            raise ValueError("route_batch: give at least one prompt")
        if extra_keys is not None and len(prompts) > 1:
            raise ValueError("extra_keys name the blocks of one prompt: route a batch without them")
        holders, adapter = self.candidates(model)
        if not holders:
            return KeyedRequest(holders, [], [])  # nothing to route to: not keyed
        if lora is None:
            lora = adapter
        # Before any engine has stored a block (and none advertised its block size, as a
        # vLLM found through /kv_event_sources does not), nothing is cached anywhere: the
        # choice is by load alone, and the request counts as no blocks.
        sized = self.index.block_size is not None
        each = [self._keys(t, lora, cache_salt, extra_keys) if sized else [] for t in prompts]
        matched = [self._matched(k, len(t)) for k, t in zip(each, prompts, strict=True)]
        return KeyedRequest(holders, each, matched)

    def route_keyed(
        self,
        request: KeyedRequest,
        holders: list[Holder],
        *,
        policy: Policy = "kv-aware",
        rotation: str = "",
        decays: bool = True,
    ) -> RouteDecision:
        """:meth:`route_batch`'s choice for a :meth:`key_request` among ``holders`` (some
        of its candidates). :class:`~kvevents.errors.RouterNotReadyError` when none is
        given or available. ``rotation``: the round-robin turns this choice takes its
        turn from (each P/D pool keeps its own, so the two never step each other's);
        ``decays``: the decision's :attr:`RouteDecision.decays`."""
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r} is not one of {', '.join(POLICIES)}")
        if not holders:
            raise self._no_rank(None)
        return self._decide(request, holders, policy, rotation, decays)

    def _decide(
        self,
        request: KeyedRequest,
        holders: list[Holder],
        policy: Policy,
        rotation: str = "",
        decays: bool = True,
    ) -> RouteDecision:
        self._watch_stalls()
        try:
            return self._decide_now(request, holders, policy, rotation, decays)
        except RouterNotReadyError:
            if not self.loads.any_stalled:
                raise
            with self._stalls_lifted():  # none is routable but some are only stalled
                return self._decide_now(request, holders, policy, rotation, decays)

    def _decide_now(
        self,
        request: KeyedRequest,
        holders: list[Holder],
        policy: Policy,
        rotation: str,
        decays: bool,
    ) -> RouteDecision:
        each, matched = request.keys, request.matched
        scored = [
            self._score(len(k), holders, found, predicted)
            for k, (found, predicted) in zip(each, matched, strict=True)
        ]
        keys = each[0] if len(each) == 1 else [k for one in each for k in one]
        scores = scored[0] if len(scored) == 1 else combine_scores(scored, holders)
        best = choose(scores)
        by_prediction = False
        if best.predicted_blocks and any(p for _, p in matched):
            # the same matches scored without predictions: no second lookup
            plain = [
                self._score(len(k), holders, found, None)
                for k, (found, _) in zip(each, matched, strict=True)
            ]
            first = plain[0] if len(plain) == 1 else combine_scores(plain, holders)
            by_prediction = first[0].holder != best.holder
        if policy == "round-robin":
            turn = [s for s in sorted(scores, key=lambda s: self._order(s.holder)) if s.available]
            at = self._turns.get(rotation, 0)
            best = turn[at % len(turn)]
            self._turns[rotation] = at + 1
            scores = [best, *(s for s in scores if s is not best)]
            by_prediction = False
        return RouteDecision(
            worker=best.worker,
            dp_rank=best.dp_rank,
            n_blocks=len(keys),
            block_size=self.index.block_size or 0,  # 0: not known yet
            scores=scores,
            policy=policy,
            keys=keys,
            by_prediction=by_prediction,
            candidates=len(holders),
            decays=decays,
        )

    def _order(self, holder: Holder) -> int:
        slot = self.index.slot_of(holder)
        return -1 if slot is None else slot

    # --- stalls (kvevents.router.decide.stalls) ----------------------------------------

    def _watch_stalls(self) -> None:
        """Stall the holders whose time has come: a clock read while requests are in
        flight, nothing more while none is due."""
        watch = self.stall_watch
        if watch is not None and watch.due < _NEVER:
            now = self.clock()
            if now >= watch.due and watch.check(now):
                self._loads_version += 1

    @contextlib.contextmanager
    def _stalls_lifted(self) -> Iterator[None]:
        """Within it the stalled holders count as available (a decision when no candidate
        is otherwise); the loads' version moves on both sides, so nothing made within it
        (a ranking) is kept after it."""
        self._loads_version += 1
        try:
            with self.loads.lifted():
                yield
        finally:
            self._loads_version += 1

    def engine_silent(self, worker: str) -> None:
        """Engine ``worker``'s load poll has had no answer for the watch's
        ``engine_after_s``: its ranks are stalled until it answers (no-op when stalls
        are not watched)."""
        watch = self.stall_watch
        if watch is not None and watch.engine_silent(worker, self.clock()):
            self._loads_version += 1

    def engine_heard(self, worker: str) -> None:
        """Engine ``worker`` answered a load poll: its ranks' engine stall ends."""
        watch = self.stall_watch
        if watch is not None and watch.engine_heard(worker):
            self._loads_version += 1

    def begin(self, decision: RouteDecision) -> Ticket:
        """Count a request forwarded to the chosen holder as in-flight and recent load."""
        holder = decision.holder  # a new Holder per read: read once
        self._record(decision, holder)
        blocks = decision.chosen.prefill_blocks
        self.loads.add_inflight(holder, 1, blocks)
        self._loads_version += 1
        watch = self.stall_watch
        if watch is None:
            ticket = Ticket(holder, blocks, next(self._tickets))
        else:
            now = self.clock()
            watch.began(holder, now)
            ticket = Ticket(holder, blocks, next(self._tickets), now)
        if self.predicting and decision.keys:
            added = self._predict(decision, holder)
            if added[0]:
                self._predicted_keys[ticket.id] = added
        for listener in self.note_listeners:
            listener("begin", holder, decision.n_blocks, ticket, decision.decays)
        return ticket

    def record(self, decision: RouteDecision) -> None:
        """Count a decision someone else acts on (``/route`` with ``record``) in ``recent``
        and ``routed``; no in-flight load, as the router never sees the request end.
        Its blocks are predicted on the holder until confirmed or expired."""
        holder = decision.holder
        self._record(decision, holder)
        if self.predicting and decision.keys:
            self._predict(decision, holder)
        for listener in self.note_listeners:
            listener("routed", holder, decision.n_blocks, None, decision.decays)

    def _predict(self, decision: RouteDecision, holder: Holder) -> tuple[list[int], float]:
        self.predictions_made += 1
        if decision.chosen.matched.blocks >= decision.n_blocks:
            # the holder has every block of the request cached (in some tier): nothing
            # to predict, and no lookup of its blocks needed to find that out again (a
            # block-aligned prompt's match stops before its last block: that one is looked up)
            return [], 0.0
        return self.index.predict(holder, decision.keys)

    def _record(self, decision: RouteDecision, holder: Holder) -> None:
        decay = self.weights.decay if decision.decays else 1.0
        self.loads.note_routed(holder, decision.n_blocks, decay, count=True)
        self._loads_version += 1
        self.routes[holder] += 1
        if decision.by_prediction:
            self.decided_by_prediction += 1

    def finish(self, ticket: Ticket, *, failed: bool = False) -> None:
        """The forwarded request ended (answered or failed): drop it from the load.

        ``failed``: the engine never took it (a forward error, an error status), so the
        blocks it predicted are withdrawn (those no later request predicted again). A
        request that did not fail is the holder's progress: a holder stalled by its
        requests is routable again (:mod:`kvevents.router.decide.stalls`).
        """
        added = self._predicted_keys.pop(ticket.id, None)
        if failed and added is not None:
            self.index.withdraw(ticket.holder, *added)
        for listener in self.note_listeners:
            listener("finish", ticket.holder, 0, ticket, True)
        watch = self.stall_watch
        if watch is not None and watch.ended(ticket.holder, self.clock(), ticket.began, not failed):
            self._loads_version += 1
        self.remote_inflight(ticket.holder, -1, -ticket.blocks)

    # --- peers' requests (kvevents.router.fleet.peers) --------------------------------------

    def remote_routed(self, holder: Holder, n_blocks: int, *, decays: bool = True) -> None:
        """A peer router sent a request of ``n_blocks`` prompt blocks to ``holder``.
        ``decays``: its decision advanced the decay of recent work (its
        :attr:`RouteDecision.decays`), so it does here too, as :meth:`begin` does."""
        decay = self.weights.decay if decays else 1.0
        self.loads.note_routed(holder, n_blocks, decay, count=False)
        self._loads_version += 1

    def remote_inflight(self, holder: Holder, requests: int, blocks: float) -> None:
        """Add (or, negative, remove) in-flight requests and their uncached blocks."""
        if self.loads.add_inflight(holder, requests, blocks):
            self._loads_version += 1

    # --- inspecting -------------------------------------------------------------------

    def holders(self) -> list[Holder]:
        """Routable holders, in registration order."""
        return self.index.holders()

    def holder_summary(self) -> list[dict[str, Any]]:
        """Per holder: entries in the index, the seq of the last batch applied to it, load
        and signal counts, and why it is stalled (``stall``: None when it is not, or
        stalls are not watched) (for /workers)."""
        self._watch_stalls()
        watch, now = self.stall_watch, self.clock()
        out = []
        # signals grouped once: per holder a scan of them all was O(holders x signals),
        # 80 ms a /workers at 1,024 ranks with two signals each
        by_holder: dict[Holder | None, dict[str, int]] = {}
        for (kind, holder), n in self.signals.items():
            by_holder.setdefault(holder, {})[kind] = n
        for h in self.holders():
            load = self.loads.get(h, HolderLoad())
            out.append(
                {
                    "worker": h.worker,
                    "dp_rank": h.dp_rank,
                    "index_entries": self.index.holder_size(h),
                    "applied_seq": self.index.applied_seqs.get(h),
                    "load": msgspec.structs.asdict(load),
                    "routed": self.routes[h],
                    "signals": by_holder.get(h, {}),
                    "block_size": self.block_sizes.for_holder(h),
                    "stall": None if watch is None else watch.describe(h, now),
                }
            )
        return out
