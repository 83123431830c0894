"""The demo's figures: per-policy summaries, the results document, and the rich table.

Definitions (the same in the table, the JSON and docs/performance.md):

* **hit rate**: cached prompt tokens / prompt tokens, as the engine reported them per
  request (``cached_tokens`` / ``prompt_tokens`` of ``/generate``), summed over requests.
* **load max/min**: the largest over the smallest number of prompt tokens served by
  one rank during the policy's replay (1.0 is perfectly even).
* **upper bound**: the hit rate of one pooled cache with the capacity of all ranks,
  replaying the same requests in the same order (:func:`~kvevents.demo.replay.pooled_upper_bound`).
* events: batches and events the ranks published, batches the router received, events
  its index applied, batches recovered by replay, sequence numbers lost for good.
* restart (``--routers N``): see :mod:`kvevents.demo.restart` for "equal" and for a
  request that "missed its predicted prefix".
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from kvevents.demo.plane import EventCounts, Settled
from kvevents.demo.replay import Outcome, PolicyRun, hit_rate

__all__ = [
    "POLICY_LABELS",
    "UPPER_BOUND_LABEL",
    "percentile",
    "render_table",
    "results_document",
    "summarize",
]

POLICY_LABELS = {
    "kv_aware": "KV-aware (router)",
    "replicas_sync": "KV-aware, replicas synced",
    "replicas_alone": "KV-aware, replicas alone",
    "replicas_restart": "KV-aware, synced, one restarted",
    "round_robin": "round-robin",
}
UPPER_BOUND_LABEL = "pooled cache (bound)"


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; 0.0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(run: PolicyRun, dp_size: int) -> dict[str, Any]:
    """The figures of one policy's replay (see the module docstring)."""
    done = [o for o in run.outcomes if isinstance(o, Outcome) and o.error is None]
    per_rank = [0] * dp_size
    requests = [0] * dp_size
    for o in done:
        if 0 <= o.dp_rank < dp_size:
            per_rank[o.dp_rank] += o.prompt_tokens
            requests[o.dp_rank] += 1
    low = min(per_rank) if per_rank else 0
    latencies = [o.latency_s * 1000.0 for o in done]
    return {
        "hit_rate": hit_rate([(o.prompt_tokens, o.cached_tokens) for o in done]),
        "load_max_over_min": (max(per_rank) / low) if low else float("inf"),
        "prompt_tokens": sum(per_rank),
        "cached_tokens": sum(o.cached_tokens for o in done),
        "prompt_tokens_per_rank": per_rank,
        "requests_per_rank": requests,
        "requests": len(done),
        "failed": len(run.failed),
        "errors": run.failed[:5],
        "wall_s": run.wall_s,
        "requests_per_s": len(done) / run.wall_s if run.wall_s else 0.0,
        "latency_ms_p50": percentile(latencies, 0.50),
        "latency_ms_p99": percentile(latencies, 0.99),
    }


def results_document(
    settings: dict[str, Any],
    policies: dict[str, dict[str, Any]],
    upper_bound: float,
    events: EventCounts,
    consistency: dict[str, Settled],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The ``--json`` document: ``policies``, ``upper_bound_hit_rate``, ``events``, settings."""
    kv = policies.get("kv_aware", {}).get("hit_rate", 0.0)
    rr = policies.get("round_robin", {}).get("hit_rate", 0.0)
    return {
        "settings": settings,
        "policies": policies,
        "upper_bound_hit_rate": upper_bound,
        "kv_aware_over_upper_bound": kv / upper_bound if upper_bound else 0.0,
        "kv_aware_over_round_robin": kv / rr if rr else float("inf"),
        "events": asdict(events),
        "index_consistency": {
            name: {
                "engine_blocks": s.engine_blocks,
                "index_blocks": s.index_blocks,
                "consistent": s.consistent,
            }
            for name, s in consistency.items()
        },
        **extra,
    }


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def render_table(doc: dict[str, Any], console: Console) -> None:
    """Print the results as two rich tables: policies, then the event plane."""
    upper = doc["upper_bound_hit_rate"]
    table = Table(title="Prefix-cache hit rate by routing policy", title_justify="left")
    for column, justify in (
        ("policy", "left"),
        ("hit rate", "right"),
        ("of bound", "right"),
        ("load max/min", "right"),
        ("req/s", "right"),
        ("p50/p99 ms", "right"),
        ("failed", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for name, p in doc["policies"].items():
        table.add_row(
            POLICY_LABELS.get(name, name),
            _pct(p["hit_rate"]),
            _pct(p["hit_rate"] / upper) if upper else "-",
            f"{p['load_max_over_min']:.2f}",
            f"{p['requests_per_s']:.1f}",
            f"{p['latency_ms_p50']:.0f}/{p['latency_ms_p99']:.0f}",
            str(p["failed"]),
        )
    table.add_row(UPPER_BOUND_LABEL, _pct(upper), "100.0%", "-", "-", "-", "-")
    console.print(table)
    ev = doc["events"]
    plane = Table(title="Event plane (whole demo)", title_justify="left")
    for column in ("published", "delivered", "applied", "replayed", "lost", "index=engine"):
        plane.add_column(column, justify="right")
    consistent = all(c["consistent"] for c in doc["index_consistency"].values())
    plane.add_row(
        f"{ev['batches_published']:,} batches, {ev['events_published']:,} events",
        f"{ev['batches_delivered']:,} batches",
        f"{ev['events_applied']:,} events",
        f"{ev['replayed']:,}",
        f"{ev['lost']:,}",
        "yes" if consistent else "NO",
    )
    console.print(plane)
    for name, r in doc.get("restart", {}).items():
        _render_restart(POLICY_LABELS.get(name, name), r, console)


def _render_restart(label: str, r: dict[str, Any], console: Console) -> None:
    if not r.get("done"):
        console.print(f"[red]{label}: the restart step did not run: {r.get('error')}[/red]")
        return
    equal = r["caught_up_after_launch_s"]
    exact = r.get("index_exactly_equal_after_trace")
    warm = r.get("warm_start") or {}
    console.print(
        f"{label}: replica killed (SIGKILL) {r['killed_at_s']:.1f} s into the trace and "
        f"restarted with --peer (from {warm.get('peer')}); ready "
        f"{r['ready_after_launch_s']:.2f} s after launch, its index caught up with every "
        f"rank {'not within the wait' if equal is None else f'{equal:.2f} s after launch'}"
        f" (after the trace, equal to every rank's /kv_blocks: "
        f"{'not checked' if exact is None else 'yes' if exact else 'NO'}). "
        f"Meanwhile {r['meanwhile_requests']} requests, "
        f"{r['meanwhile_missed_predicted_prefix']} on a rank without the prefix the router "
        f"counted on ({r['meanwhile_missed_via_restarted']} of them via the restarted replica); "
        f"hit rate via the restarted replica {_pct(r['meanwhile_hit_rate_via_restarted'])} "
        f"({r['meanwhile_requests_via_restarted']} requests), via the others "
        f"{_pct(r['meanwhile_hit_rate_via_others'])}; {r['retried_requests']} requests "
        "resent after hitting the killed replica.",
        soft_wrap=True,
    )
