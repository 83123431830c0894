"""The demo's replay without processes: the real router over simulated caches and clock.

:func:`offline_replay` makes the routing decisions of ``kvevents demo`` in one process,
in a fraction of the time, so that scoring weights can be compared on many workloads
(``benchmarks/routing_weights.py``) and tested. What is real: the
:class:`~kvevents.router.Router` (index, scoring, in-flight and recent work) and each
rank's :class:`~kvevents.engine.cache.PrefixCache` with its events. What is simulated:

* time: request ``i`` arrives at ``arrival_s``; at most ``concurrency`` are in flight
  (a later one waits for the earliest to finish, as the demo's client does);
* service: a request runs ``overhead_s + uncached tokens / prefill_tokens_per_s +
  new tokens / decode_tokens_per_s`` seconds from its arrival, whatever else its rank
  runs (the engine batches them); it pins its pages until it finishes;
* events: each admission's cache events reach the router at once (the engine publishes
  them within a step, far shorter than the gaps between requests).

``overhead_s`` is calibrated on the demo's latencies, so with the demo's defaults the
hit rates follow ``kvevents demo``'s own, KV-aware and round-robin, and one request at a
time reproduces the collapse onto one rank that the balance term of
:mod:`kvevents.router.decide.scoring` exists for. O(total prompt tokens) hashing plus one
routing decision per request.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvevents.demo.replay import Outcome, PolicyRun, Workload
from kvevents.engine.cache import Admission, PrefixCache
from kvevents.router.decide.router import Policy, Router, Ticket
from kvevents.router.decide.scoring import ScoringWeights
from kvevents.subscribe.items import Delivery
from kvevents.traces import request_tokens
from kvevents.types import Holder
from kvevents.wire.events import KVEventBatch

__all__ = ["OfflineRequest", "ServiceModel", "offline_replay", "workload_requests"]

_WORKER = "offline"


@dataclass(frozen=True, slots=True)
class OfflineRequest:
    """One request to replay: its prompt, arrival time (s) and output tokens."""

    tokens: Sequence[int]
    arrival_s: float
    new_tokens: int


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """How long a request runs (see the module docstring); defaults fit ``kvevents demo``."""

    overhead_s: float = 0.07
    prefill_tokens_per_s: float = 1_000_000.0
    decode_tokens_per_s: float = 1_000.0

    def seconds(self, uncached_tokens: int, new_tokens: int) -> float:
        return (
            self.overhead_s
            + uncached_tokens / self.prefill_tokens_per_s
            + new_tokens / self.decode_tokens_per_s
        )


def workload_requests(workload: Workload) -> list[OfflineRequest]:
    """The demo's requests (tokens, compressed arrivals, capped outputs) of ``workload``."""
    return [
        OfflineRequest(request_tokens(r), workload.arrival_s(i), workload.new_tokens(i))
        for i, r in enumerate(workload.requests)
    ]


@dataclass(order=True, slots=True)
class _Running:
    done_s: float
    order: int
    rank: int
    admission: Admission
    ticket: Ticket


def offline_replay(
    requests: Sequence[OfflineRequest],
    *,
    dp_size: int,
    page_size: int,
    max_blocks: int,
    concurrency: int,
    policy: Policy = "kv-aware",
    weights: ScoringWeights | None = None,
    service: ServiceModel | None = None,
    name: str | None = None,
) -> PolicyRun:
    """Route and serve ``requests`` in order; see the module docstring.

    ``max_blocks`` pages per rank. Returns a :class:`PolicyRun` whose outcomes carry the
    simulated send time and latency, for :func:`kvevents.demo.report.summarize`.
    """
    if concurrency < 1 or dp_size < 1:
        raise ValueError(f"concurrency={concurrency} and dp_size={dp_size} must be >= 1")
    service = service or ServiceModel()
    router = Router(block_size=page_size, weights=weights)
    holders = [Holder(_WORKER, r) for r in range(dp_size)]
    for h in holders:
        router.add_holder(h, block_size=page_size)
    caches = [PrefixCache(page_size, max_blocks) for _ in range(dp_size)]
    seqs = [0] * dp_size
    running: list[_Running] = []
    order = itertools.count()
    run = PolicyRun(name or policy.replace("-", "_"), [None] * len(requests))
    now = 0.0

    def finish_until(t: float) -> None:
        while running and running[0].done_s <= t:
            done = heapq.heappop(running)
            caches[done.rank].release(done.admission)
            router.finish(done.ticket)

    for i, request in enumerate(requests):
        now = max(now, request.arrival_s)
        finish_until(now)
        if len(running) >= concurrency:
            now = max(now, running[0].done_s)
            finish_until(now)
        decision = router.route(request.tokens, policy=policy)
        ticket = router.begin(decision)
        rank = decision.dp_rank
        admission = caches[rank].admit(request.tokens)
        events = caches[rank].take_events()
        if events:
            batch = KVEventBatch(ts=now, events=events, data_parallel_rank=rank)
            router.handle(Delivery(holders[rank], seqs[rank], batch))
            seqs[rank] += 1
        uncached = admission.prompt_tokens - admission.cached_tokens
        latency = service.seconds(uncached, request.new_tokens)
        heapq.heappush(running, _Running(now + latency, next(order), rank, admission, ticket))
        run.outcomes[i] = Outcome(
            rank, admission.prompt_tokens, admission.cached_tokens, now, latency
        )
    finish_until(float("inf"))
    run.wall_s = max((o.sent_s + o.latency_s for o in run.outcomes if o is not None), default=0.0)
    return run
