"""What disaggregated serving decided, per pool: counters for ``/workers`` and ``/metrics``.

Recorded by the P/D relay (:mod:`kvevents.router.serve.pd_relay`) as it serves each
request, read at scrape time by :class:`PDCollector` (families prefixed
``kvevents_router_pd_``):

* ``requests_total{pool}``: legs sent to each pool: every request sends one to the
  decode pool, a request with a hand-off one more to the prefill pool;
* ``prefill_skipped_total``: requests the decode instance served alone (its uncached
  part at most ``--max-local-prefill-tokens``, or, with vLLM's legs, a request asking
  for its prompt's logprobs, whose prompt the decode computes itself);
* ``prefill_chosen_total{reason}``: prefill holders chosen by ``cache`` (the holder had
  part of the prompt), ``prediction`` (predictions changed the choice) or ``load``;
* ``legs_failed_total{pool,reason}``: legs that failed: ``unreachable`` (no
  connection, or it broke), ``timeout`` (past the leg's deadline), ``status`` (the
  engine answered an error) or ``cancelled`` (the other leg failed first).

O(1) per request; memory O(label combinations).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, Literal, get_args

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvevents.router.decide.pd import POOLS, PDDecision, Pool

__all__ = ["LEG_FAILURES", "LegFailure", "PDCollector", "PDStats"]

LegFailure = Literal["unreachable", "timeout", "status", "cancelled"]
LEG_FAILURES: tuple[LegFailure, ...] = get_args(LegFailure)

_P = "kvevents_router_pd_"
_REASONS = ("cache", "prediction", "load")


class PDStats:
    """See the module docstring. Single-threaded (the service's event loop)."""

    def __init__(self) -> None:
        self.requests: Counter[Pool] = Counter()
        self.prefill_skipped = 0
        self.prefill_chosen: Counter[str] = Counter()
        self.legs_failed: Counter[tuple[Pool, LegFailure]] = Counter()

    def decided(self, decision: PDDecision) -> None:
        """A request was routed as ``decision`` says, and its legs are about to be sent."""
        self.requests["decode"] += 1
        if decision.prefill is None:
            self.prefill_skipped += 1
            return
        self.requests["prefill"] += 1
        self.prefill_chosen[decision.prefill_reason or "load"] += 1

    def failed(self, pool: Pool, reason: LegFailure) -> None:
        self.legs_failed[(pool, reason)] += 1

    def summary(self) -> dict[str, Any]:
        """Per pool, for ``/workers``."""
        return {
            "prefill": {
                "requests": self.requests["prefill"],
                "chosen_by_cache": self.prefill_chosen["cache"],
                "chosen_by_prediction": self.prefill_chosen["prediction"],
                "chosen_by_load": self.prefill_chosen["load"],
                "legs_failed": self._failed("prefill"),
            },
            "decode": {
                "requests": self.requests["decode"],
                "prefill_skipped": self.prefill_skipped,
                "legs_failed": self._failed("decode"),
            },
        }

    def _failed(self, pool: Pool) -> dict[str, int]:
        return {reason: self.legs_failed[(pool, reason)] for reason in LEG_FAILURES}


class PDCollector(Collector):
    """Reads :class:`PDStats` at scrape time (the module docstring's families)."""

    def __init__(self, stats: PDStats) -> None:
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self.stats
        requests = CounterMetricFamily(
            _P + "requests", "legs sent to each pool of disaggregated serving", labels=["pool"]
        )
        for pool in POOLS:
            requests.add_metric([pool], stats.requests[pool])
        yield requests
        yield CounterMetricFamily(
            _P + "prefill_skipped",
            "requests a decode instance served alone, without a prefill hop",
            value=stats.prefill_skipped,
        )
        chosen = CounterMetricFamily(
            _P + "prefill_chosen", "prefill holders chosen, by reason", labels=["reason"]
        )
        for reason in _REASONS:
            chosen.add_metric([reason], stats.prefill_chosen[reason])
        yield chosen
        failed = CounterMetricFamily(
            _P + "legs_failed", "legs that failed, per pool and reason", labels=["pool", "reason"]
        )
        for pool in POOLS:
            for reason in LEG_FAILURES:
                failed.add_metric([pool, reason], stats.legs_failed[(pool, reason)])
        yield failed
