"""The disaggregated demo's figures, per prefill policy, and the targets they are held to.

Definitions (the same in the table and the JSON):

* **prefill hit rate**: on the prefill pool, tokens found cached / prompt tokens
  admitted, as the prefill engines count them (each rank's ``/load`` counters, the
  difference over the replay): the requests handed off, not those the decode served
  alone.
* **pooled bound** (``prefill_bound_hit_rate``; the target's ``prefill_of_bound`` is the
  hit rate over it): the hit rate of one pooled cache with the prefill pool's capacity
  (ranks x ``--max-blocks`` pages) fed the same prefill legs in the same order, evicting
  as an engine's cache does (:func:`pooled_bound_hits`, the one-pool demo's
  :func:`~kvevents.demo.replay.pooled_upper_bound` on those legs): the one-pool demo's
  bound, for the prefill pool. While nothing is evicted no placement of the legs on the
  pool's separate caches beats it (up to the order concurrent requests are admitted
  in); once LRU evicts, a placement may pass it a little, where a rank keeps a
  conversation that the pooled cache evicts for another's. ``trace_bound_hit_rate`` is
  the same cache fed every request of the trace.
* **unbounded cache** (``prefill_unbounded_hit_rate``, ``prefill_of_unbounded``): the
  same legs on one cache that never evicts (:func:`unbounded_hits`); where the pooled
  bound stays under it (``bound_of_unbounded``), caches of the pool's size cannot hold
  what the trace reuses, whatever the placement. ``trace_unbounded_hit_rate``: every
  request of the trace on it.
* **prefill tokens computed**: prompt tokens the prefill pool computed (not cached);
  **decode tokens computed**: those each decode computed itself, its answer's prompt
  tokens less its cached ones, received blocks counting as cached (all it lacked of a
  prompt whose prefill was skipped; the last block of one handed off, partial or, on
  a block boundary, computed again).
* **blocks transferred**: the full blocks of every handed-off prompt (the simulated
  prefill sends them all).
* **load max/min**, per pool: the largest over the smallest prompt tokens admitted by one
  rank of the pool (1.0 is even).
* **placement hit rate**: the prefill legs replayed on one unbounded cache per rank they
  went to, per request: the chart's curve, since the engines count per rank, not per
  request; it equals the engines' figure when no cache evicts and the admission order
  is the sending order.

Keys are each request's chained block keys (:func:`kvevents.wire.hashing.content_keys`),
computed once per workload; an unbounded cache is then a set of keys, and a request's hit
the run of its leading keys in it, at most the blocks an engine reuses
(:func:`~kvevents.index.reusable.reusable_blocks`: a block-aligned prompt's last is computed
again): equal to the engine's prefix cache without eviction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

from kvevents.demo.pd_fleet import Counts
from kvevents.demo.replay import Outcome, PolicyRun, Workload, pooled_upper_bound
from kvevents.demo.report import percentile
from kvevents.index.reusable import reusable_blocks
from kvevents.traces import request_tokens
from kvevents.wire.hashing import content_key_array

__all__ = [
    "PD_TARGETS",
    "counts_over",
    "pooled_bound_hits",
    "request_keys",
    "summarize_pd",
    "targets_met",
    "trace_bounds",
    "unbounded_hits",
]

PD_TARGETS = {"prefill_of_bound": 0.95, "load_max_over_min": 1.15}
"""The targets: the KV-aware prefill's hit rate against its pooled bound (one cache of the
prefill pool's pages), and each pool's load max/min with it."""


def request_keys(workload: Workload, page_size: int) -> list[Sequence[int]]:
    """Every request's chained block keys, in trace order."""
    return [content_key_array(request_tokens(r), page_size) for r in workload.requests]


def unbounded_hits(
    keys: Sequence[Sequence[int]],
    lengths: Sequence[int],
    places: Sequence[Hashable | None],
    page_size: int,
) -> list[int | None]:
    """Per request, its cached tokens on one unbounded cache per place (None: the request
    is not sent to any, and gets None); in request order. ``lengths``: each request's
    prompt tokens, whose reusable blocks cap its hit (module docstring); every full block
    is stored. O(blocks)."""
    caches: dict[Hashable, set[int]] = {}
    out: list[int | None] = []
    for chain, n_tokens, place in zip(keys, lengths, places, strict=True):
        if place is None:
            out.append(None)
            continue
        cache = caches.setdefault(place, set())
        hit = 0
        for key in chain[: reusable_blocks(n_tokens, page_size)]:
            if key not in cache:
                break
            hit += 1
        cache.update(chain)
        out.append(hit * page_size)
    return out


def pooled_bound_hits(
    workload: Workload, sent: Sequence[bool], page_size: int, pages: int
) -> list[int | None]:
    """Per request, its cached tokens on one cache of ``pages`` pages fed the requests
    ``sent`` says were, in request order (None for the others): the pooled bound's cache,
    :func:`~kvevents.demo.replay.pooled_upper_bound` on those requests. O(tokens)."""
    chosen = tuple(r for r, was_sent in zip(workload.requests, sent, strict=True) if was_sent)
    pairs = iter(
        pooled_upper_bound(dataclasses.replace(workload, requests=chosen), page_size, pages)
        if chosen
        else ()
    )
    return [next(pairs)[1] if was_sent else None for was_sent in sent]


def _rate(hits: Sequence[int | None], prompts: Sequence[int]) -> float:
    """Cached tokens over prompt tokens, of the requests sent somewhere."""
    total = sum(p for p, hit in zip(prompts, hits, strict=True) if hit is not None)
    cached = sum(hit for hit in hits if hit is not None)
    return cached / total if total else 0.0


def _max_over_min(values: Sequence[int]) -> float:
    low = min(values, default=0)
    return max(values) / low if low else float("inf")


def _prefill_holder(o: Outcome) -> tuple[str, int] | None:
    prefill = (o.routed or {}).get("prefill")
    if not isinstance(prefill, dict):
        return None
    return str(prefill["worker"]), int(prefill["dp_rank"])


def summarize_pd(
    run: PolicyRun,
    workload: Workload,
    keys: Sequence[Sequence[int]],
    counts: dict[str, Counts],
    *,
    page_size: int,
    pages: int,
) -> tuple[dict[str, Any], dict[str, list[tuple[int, int]]]]:
    """One policy's figures (module docstring) and the chart's curves: per handed-off
    request in trace order, its ``(prompt, cached)`` pair by ``placement`` and on the
    ``pooled`` bound's cache.

    ``keys``: :func:`request_keys` of ``workload``; ``counts``: per pool, each rank's
    counters over the replay (after less before); ``pages``: the prefill pool's pages
    (the pooled bound's capacity).
    """
    done = [o if isinstance(o, Outcome) and o.error is None else None for o in run.outcomes]
    ok = [o for o in done if o is not None]
    holders = [None if o is None else _prefill_holder(o) for o in done]
    prompts = [0 if o is None else o.prompt_tokens for o in done]
    handed = [h is not None for h in holders]
    pooled = pooled_bound_hits(workload, handed, page_size, pages)
    lengths = [r.input_length for r in workload.requests]
    unbounded = unbounded_hits(keys, lengths, ["pool" if h else None for h in handed], page_size)
    placed = unbounded_hits(keys, lengths, holders, page_size)
    prefill, decode = counts["prefill"], counts["decode"]
    prefill_prompt = sum(p for p, _ in prefill.values())
    prefill_cached = sum(c for _, c in prefill.values())
    hit = prefill_cached / prefill_prompt if prefill_prompt else 0.0
    bound = _rate(pooled, prompts)
    without_eviction = _rate(unbounded, prompts)
    decode_computed = sum(o.prompt_tokens - o.cached_tokens for o in ok)
    latencies = [o.latency_s * 1000.0 for o in ok]
    figures: dict[str, Any] = {
        "requests": len(ok),
        "failed": len(run.failed),
        "errors": run.failed[:5],
        "handed_off": sum(handed),
        "prefills_skipped": sum(1 for o in ok if (o.routed or {}).get("prefill_skipped") is True),
        "prefill_hit_rate": hit,
        "prefill_bound_pages": pages,
        "prefill_bound_hit_rate": bound,
        "prefill_of_bound": hit / bound if bound else 0.0,
        "prefill_unbounded_hit_rate": without_eviction,
        "prefill_of_unbounded": hit / without_eviction if without_eviction else 0.0,
        "bound_of_unbounded": bound / without_eviction if without_eviction else 0.0,
        "placement_hit_rate": _rate(placed, prompts),
        "prefill_prompt_tokens": prefill_prompt,
        "prefill_tokens_computed": prefill_prompt - prefill_cached,
        "decode_tokens_computed": decode_computed,
        "tokens_computed": prefill_prompt - prefill_cached + decode_computed,
        "prompt_tokens": sum(prompts),
        "blocks_transferred": sum(
            p // page_size for p, h in zip(prompts, handed, strict=True) if h
        ),
        "prompt_tokens_per_rank": {
            "prefill": [p for p, _ in prefill.values()],
            "decode": [p for p, _ in decode.values()],
        },
        "load_max_over_min": {
            "prefill": _max_over_min([p for p, _ in prefill.values()]),
            "decode": _max_over_min([p for p, _ in decode.values()]),
        },
        "wall_s": run.wall_s,
        "requests_per_s": len(ok) / run.wall_s if run.wall_s else 0.0,
        "latency_ms_p50": percentile(latencies, 0.50),
        "latency_ms_p99": percentile(latencies, 0.99),
    }
    curves = {
        name: [(p, hit) for p, hit in zip(prompts, hits, strict=True) if hit is not None]
        for name, hits in (("placement", placed), ("pooled", pooled))
    }
    return figures, curves


def trace_bounds(
    workload: Workload, keys: Sequence[Sequence[int]], page_size: int, pages: int
) -> dict[str, float]:
    """Every request of the trace, in order, on the pooled bound's cache of ``pages``
    pages (``trace_bound_hit_rate``) and on one unbounded cache (``trace_unbounded_hit_rate``)."""
    every = [True] * len(workload)
    prompts = [r.input_length for r in workload.requests]
    return {
        "trace_bound_hit_rate": _rate(
            pooled_bound_hits(workload, every, page_size, pages), prompts
        ),
        "trace_unbounded_hit_rate": _rate(
            unbounded_hits(keys, prompts, ["all"] * len(keys), page_size), prompts
        ),
    }


def counts_over(after: dict[str, Counts], before: dict[str, Counts]) -> dict[str, Counts]:
    """Per pool and rank, the counters ``after`` less ``before`` (a replay's share)."""
    return {
        pool: {
            holder: (
                p - before[pool].get(holder, (0, 0))[0],
                c - before[pool].get(holder, (0, 0))[1],
            )
            for holder, (p, c) in ranks.items()
        }
        for pool, ranks in after.items()
    }


def targets_met(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The targets (:data:`PD_TARGETS`) against the KV-aware run, and by how much."""
    kv, rr = policies["kv_aware"], policies["round_robin"]
    loads = kv["load_max_over_min"]
    return {
        "kv_aware_prefill_of_bound": kv["prefill_of_bound"],
        "prefill_of_bound_met": kv["prefill_of_bound"] >= PD_TARGETS["prefill_of_bound"],
        "kv_aware_over_round_robin": (
            kv["prefill_hit_rate"] / rr["prefill_hit_rate"] if rr["prefill_hit_rate"] else None
        ),
        "beats_round_robin": kv["prefill_hit_rate"] > rr["prefill_hit_rate"],
        "load_met": {
            pool: value <= PD_TARGETS["load_max_over_min"] for pool, value in loads.items()
        },
    }
