"""Prometheus metrics of a router, on a registry of its own.

Nothing is counted twice: a collector reads the index's counters, the router's loads
and the subscriber's stream statistics when scraped. Each router gets its own
``CollectorRegistry`` (never the global default), so several routers can live in one
process, as tests do.

Families (all prefixed ``kvevents_router_``):

* ``events_total{type,outcome}``: events applied, by type and outcome ("ok" or the
  silent-miss path met: unknown_parent, unknown_hash, block_size_mismatch,
  unknown_medium, malformed, unsupported_group).
* ``index_misses_total{reason}``: blocks on each silent-miss path, and pruned entries.
* ``index_entries``, ``index_blocks``, ``holder_entries{worker,dp_rank}``.
* ``group_entries{group}``, ``group_blocks{group}``, ``group_stored_blocks_total{group}``,
  ``group_removed_blocks_total{group}``: the same per KV-cache group, ``group="main"``
  for every holder's main group and e.g. ``sliding_window:0:64`` for a hybrid model's
  side group (:mod:`kvevents.index.groups`).
* ``lookups_total``, ``routes_total{worker,dp_rank}``, ``inflight_requests{worker,dp_rank}``.
* ``stream_lag_seconds``, ``stream_age_seconds``, ``stream_last_seq``,
  ``stream_gaps_total``, ``stream_lost_total``, ``stream_resets_total``,
  ``stream_replayed_total``, ``stream_malformed_total``, ``stream_unknown_events_total``,
  ``stream_snapshots_total``, ``stream_snapshot_failures_total`` (all ``{worker,dp_rank}``).
* ``signals_total{kind,worker,dp_rank}``: signals the router acted on.
* ``stalls_total{worker,dp_rank,cause}``: times a holder became stalled, by cause
  (``requests``: its requests stopped completing; ``engine``: its engine's load poll
  stopped answering; :mod:`kvevents.router.decide.stalls`), and
  ``holder_stalled{worker,dp_rank}``: 1 while it is.
* ``predictions_total``: requests whose blocks were predicted on their holder;
  ``predicted_entries_total{fate}``: predicted (block, holder) entries by fate (made,
  confirmed, expired, withdrawn, cleared, dropped; :mod:`kvevents.index.predictions`);
  ``predicted_entries_alive``: those alive;
  ``prediction_confirm_seconds_{max,mean}``: how long confirmations took; ``routes_decided_by_prediction_total`` and
  ``routes_decided_by_prediction_ratio``: routed requests (begun or recorded) whose
  holder a prediction chose, and their share of all routed requests.
* ``block_size_mismatches_total{worker,dp_rank,source,expected,observed}``: block size
  disagreements (:mod:`kvevents.subscribe.block_sizes`); for ``source="events"`` the BlockStored
  events skipped.
* with a :class:`~kvevents.router.serve.request_stats.RequestStats`:
  ``requests_total{endpoint,worker,dp_rank,policy,status}``,
  ``matched_tokens{endpoint}`` (histogram), ``prompt_tokens_total{endpoint}``,
  ``engine_cached_tokens_total{worker,dp_rank}``, ``engine_prompt_tokens_total{worker,dp_rank}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvevents.router.decide.router import Router
from kvevents.router.serve.request_stats import MATCHED_TOKEN_BUCKETS, RequestStats
from kvevents.subscribe.stats import StreamStats
from kvevents.types import Holder

__all__ = ["RouterCollector", "make_registry", "render"]

_P = "kvevents_router_"
_MISSES = (
    "unknown_parent",
    "unknown_hash",
    "block_size_mismatch",
    "unknown_medium",
    "malformed",
    "pruned_entries",
    "unsupported_group",
)
_STREAM_COUNTERS = (
    ("gaps", "stream_gaps", "sequence gaps detected"),
    ("lost", "stream_lost", "batches lost for good"),
    ("resets", "stream_resets", "stream restarts (engine restarted)"),
    ("replayed", "stream_replayed", "batches recovered by replay"),
    ("malformed", "stream_malformed", "malformed frames skipped"),
    ("unknown_events", "stream_unknown_events", "events of a type not known here, left out"),
    ("snapshots", "stream_snapshots", "gaps replay could not fill, filled by a snapshot"),
    ("snapshot_failures", "stream_snapshot_failures", "snapshots asked for that never came whole"),
)

StreamStatsSource = Callable[[], Mapping[Holder, StreamStats]]


class RouterCollector(Collector):
    """Reads a :class:`Router` (and optionally stream statistics) at scrape time."""

    def __init__(
        self,
        router: Router,
        streams: StreamStatsSource | None = None,
        requests: RequestStats | None = None,
    ) -> None:
        self.router = router
        self.streams = streams
        self.requests = requests

    def collect(self) -> Iterable[Metric]:
        router = self.router
        stats = router.index.stats
        events = CounterMetricFamily(
            _P + "events", "KV events applied, by type and outcome", labels=["type", "outcome"]
        )
        for key, n in sorted(stats.events.items()):
            kind, _, outcome = key.partition(":")
            events.add_metric([kind, outcome], n)
        yield events
        misses = CounterMetricFamily(
            _P + "index_misses", "blocks on each silent-miss path of the index", labels=["reason"]
        )
        for reason in _MISSES:
            misses.add_metric([reason], getattr(stats, reason))
        yield misses
        yield GaugeMetricFamily(
            _P + "index_entries", "(block, holder, tier) entries", value=len(router.index)
        )
        yield GaugeMetricFamily(
            _P + "index_blocks", "distinct blocks in the index", value=router.index.num_blocks
        )
        yield CounterMetricFamily(_P + "lookups", "index lookups", value=stats.lookups)
        yield from self._groups()
        labels = ["worker", "dp_rank"]
        entries = GaugeMetricFamily(
            _P + "holder_entries", "index entries per holder", labels=labels
        )
        routes = CounterMetricFamily(_P + "routes", "requests routed per holder", labels=labels)
        inflight = GaugeMetricFamily(
            _P + "inflight_requests", "requests forwarded and not finished", labels=labels
        )
        for h in router.holders():
            lv = [h.worker, str(h.dp_rank)]
            entries.add_metric(lv, router.index.holder_size(h))
            routes.add_metric(lv, router.routes[h])
            load = router.loads.get(h)
            inflight.add_metric(lv, load.inflight_requests if load else 0)
        yield entries
        yield routes
        yield inflight
        yield from self._stalls(router)
        signals = CounterMetricFamily(
            _P + "signals", "subscriber signals handled", labels=["kind", "worker", "dp_rank"]
        )
        for (kind, holder), n in sorted(router.signals.items(), key=str):
            worker, rank = ("", "") if holder is None else (holder.worker, str(holder.dp_rank))
            signals.add_metric([kind, worker, rank], n)
        yield signals
        yield from self._predictions(router)
        sizes = CounterMetricFamily(
            _P + "block_size_mismatches",
            "block size disagreements; for source=events, BlockStored events skipped",
            labels=["worker", "dp_rank", "source", "expected", "observed"],
        )
        for m in router.block_sizes.mismatches.values():
            sizes.add_metric(
                [m.worker, str(m.dp_rank), m.source, str(m.expected), str(m.observed)], m.count
            )
        yield sizes
        if self.requests is not None:
            yield from self._requests(self.requests)
        if self.streams is not None:
            yield from self._streams(self.streams())

    def _stalls(self, router: Router) -> Iterable[Metric]:
        stalls = CounterMetricFamily(
            _P + "stalls",
            "times a holder became stalled, by cause (requests, engine)",
            labels=["worker", "dp_rank", "cause"],
        )
        stalled = GaugeMetricFamily(
            _P + "holder_stalled", "1 while the holder is stalled", labels=["worker", "dp_rank"]
        )
        watch = router.stall_watch
        if watch is not None:
            for (holder, cause), n in sorted(watch.stalls.items()):
                stalls.add_metric([holder.worker, str(holder.dp_rank), cause], n)
            for h in router.holders():
                stalled.add_metric(
                    [h.worker, str(h.dp_rank)], 1 if router.loads.stalled_by(h) else 0
                )
        yield stalls
        yield stalled

    def _predictions(self, router: Router) -> Iterable[Metric]:
        predictions = router.index.predictions
        yield CounterMetricFamily(
            _P + "predictions",
            "requests whose blocks were predicted on their holder",
            value=router.predictions_made,
        )
        fates = CounterMetricFamily(
            _P + "predicted_entries",
            "predicted (block, holder) entries by fate",
            labels=["fate"],
        )
        for fate, n in msgspec.structs.asdict(predictions.stats).items():
            fates.add_metric([fate], n)
        yield fates
        yield GaugeMetricFamily(
            _P + "prediction_confirm_seconds_max",
            "longest time from a prediction to its confirmation by the engine's event",
            value=predictions.confirm_age_max_s,
        )
        confirmed = predictions.stats.confirmed
        yield GaugeMetricFamily(
            _P + "prediction_confirm_seconds_mean",
            "mean time from a prediction to its confirmation",
            value=predictions.confirm_age_sum_s / confirmed if confirmed else 0.0,
        )
        yield GaugeMetricFamily(
            _P + "predicted_entries_alive",
            "predicted (block, holder) entries alive",
            value=predictions.count,
        )
        decided = router.decided_by_prediction
        routed = sum(router.routes.values())
        yield CounterMetricFamily(
            _P + "routes_decided_by_prediction",
            "routed requests whose holder a prediction chose",
            value=decided,
        )
        yield GaugeMetricFamily(
            _P + "routes_decided_by_prediction_ratio",
            "share of routed requests whose holder a prediction chose",
            value=decided / routed if routed else 0.0,
        )

    def _groups(self) -> Iterable[Metric]:
        group = ["group"]
        families: tuple[GaugeMetricFamily | CounterMetricFamily, ...] = (
            GaugeMetricFamily(
                _P + "group_entries", "index entries per KV-cache group", labels=group
            ),
            GaugeMetricFamily(
                _P + "group_blocks", "distinct blocks per KV-cache group", labels=group
            ),
            CounterMetricFamily(
                _P + "group_stored_blocks", "blocks stored per KV-cache group", labels=group
            ),
            CounterMetricFamily(
                _P + "group_removed_blocks", "blocks removed per KV-cache group", labels=group
            ),
        )
        for label, *values in self.router.index.group_counters():
            for family, value in zip(families, values, strict=True):
                family.add_metric([label], value)
        yield from families

    def _requests(self, stats: RequestStats) -> Iterable[Metric]:
        requests = CounterMetricFamily(
            _P + "requests",
            "requests forwarded to engines, by engine status",
            labels=["endpoint", "worker", "dp_rank", "policy", "status"],
        )
        for (endpoint, worker, rank, policy, status), n in sorted(stats.requests.items()):
            requests.add_metric([endpoint, worker, str(rank), policy, status], n)
        yield requests
        matched = HistogramMetricFamily(
            _P + "matched_tokens",
            "tokens of a forwarded request cached on the chosen holder (router's view)",
            labels=["endpoint"],
        )
        prompt = CounterMetricFamily(
            _P + "prompt_tokens", "tokens of forwarded requests", labels=["endpoint"]
        )
        for endpoint, counts in sorted(stats.matched_buckets.items()):
            cumulative, total = [], 0
            for bound, n in zip((*MATCHED_TOKEN_BUCKETS, "+Inf"), counts, strict=True):
                total += n
                cumulative.append((str(bound), float(total)))
            matched.add_metric([endpoint], cumulative, float(stats.matched_sum[endpoint]))
            prompt.add_metric([endpoint], stats.prompt_tokens[endpoint])
        yield matched
        yield prompt
        labels = ["worker", "dp_rank"]
        cached = CounterMetricFamily(
            _P + "engine_cached_tokens", "cached prompt tokens the engines reported", labels=labels
        )
        engine_prompt = CounterMetricFamily(
            _P + "engine_prompt_tokens", "prompt tokens the engines reported", labels=labels
        )
        for holder in sorted(stats.engine_prompt):
            lv = [holder.worker, str(holder.dp_rank)]
            cached.add_metric(lv, stats.engine_cached[holder])
            engine_prompt.add_metric(lv, stats.engine_prompt[holder])
        yield cached
        yield engine_prompt

    def _streams(self, streams: Mapping[Holder, StreamStats]) -> Iterable[Metric]:
        labels = ["worker", "dp_rank"]
        lag = GaugeMetricFamily(
            _P + "stream_lag_seconds", "publish-to-receive lag of the last batch", labels=labels
        )
        age = GaugeMetricFamily(
            _P + "stream_age_seconds", "seconds since the last message", labels=labels
        )
        last = GaugeMetricFamily(_P + "stream_last_seq", "last sequence number", labels=labels)
        counters = [
            (field, CounterMetricFamily(_P + name, help_, labels=labels))
            for field, name, help_ in _STREAM_COUNTERS
        ]
        for holder, s in sorted(streams.items()):
            lv = [holder.worker, str(holder.dp_rank)]
            if s.lag_s is not None:
                lag.add_metric(lv, s.lag_s)
            if s.age_s is not None:
                age.add_metric(lv, s.age_s)
            if s.last_seq is not None:
                last.add_metric(lv, s.last_seq)
            for field, family in counters:
                family.add_metric(lv, getattr(s, field))
        yield lag
        yield age
        yield last
        for _, family in counters:
            yield family


class ProcessCollector(Collector):
    """Which router process answered the scrape (``--workers N``) and its load notes."""

    def __init__(self, process: Callable[[], dict[str, Any]]) -> None:
        self.process = process

    def collect(self) -> Iterable[Metric]:
        info = self.process()
        labels = ["index", "workers", "pid", "kernels"]
        # compiled or off (its reason is in /workers)
        kernels = str(info.get("kernels", "off")).split(":", 1)[0]
        values = [str(info["index"]), str(info["workers"]), str(info["pid"]), kernels]
        family = GaugeMetricFamily(
            _P + "process_info", "the router process that answered this scrape", labels=labels
        )
        family.add_metric(values, 1)
        yield family
        notes = info.get("notes")
        if notes:
            sent = CounterMetricFamily(
                _P + "peer_notes", "load notes to and from peer routers", labels=["direction"]
            )
            for direction in (
                "sent",
                "received",
                "malformed",
                "expired",
                "dropped",
                "duplicates",
                "foreign",
                "superseded",
                "resent",
                "reset",
            ):
                sent.add_metric([direction], notes[direction])
            yield sent
            inflight = GaugeMetricFamily(
                _P + "peer_inflight_requests", "peers' requests counted in flight here"
            )
            inflight.add_metric([], notes["peer_inflight"])
            yield inflight
        sync = info.get("sync")
        if sync:
            connected = GaugeMetricFamily(
                _P + "sync_connected",
                "1 while the NATS load-note sync (--sync) is connected, 0 while this replica "
                "routes alone",
            )
            connected.add_metric([], 1 if sync["connected"] else 0)
            yield connected
            disconnects = CounterMetricFamily(
                _P + "sync_disconnects", "times the NATS load-note sync lost its connection"
            )
            disconnects.add_metric([], sync["disconnects"])
            yield disconnects
            missed = CounterMetricFamily(
                _P + "sync_missed_messages",
                "messages of peers' load notes NATS dropped before this replica read them "
                "(a slow consumer); each burst is followed by a resync",
            )
            missed.add_metric([], sync["missed"])
            yield missed


def make_registry(
    router: Router,
    streams: StreamStatsSource | None = None,
    requests: RequestStats | None = None,
    process: Callable[[], dict[str, Any]] | None = None,
) -> CollectorRegistry:
    """A fresh registry holding only this router's collectors."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(router, streams, requests))
    if process is not None:
        registry.register(ProcessCollector(process))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(registry)
