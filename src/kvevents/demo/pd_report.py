"""The disaggregated demo's output: its tables and its chart.

The figures are :mod:`kvevents.demo.pd_figures`' (definitions there). One table, a
column per policy: the prefill pool's hit rate against its pooled bound (one cache of
the pool's pages) and against one unbounded cache, the tokens computed on each pool,
blocks transferred, prefills skipped, each pool's load max/min and the latencies; then
the targets, each said met or not; then the event plane, as the one-pool demo prints
it. The chart is :func:`kvevents.demo.chart.draw_chart` over the prefill legs: the
placement hit rate per policy, request by request, against the KV-aware run's pooled
bound (the target's), and the prompt tokens each prefill rank admitted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvevents.demo.replay import Outcome, PolicyRun

__all__ = ["PD_LABELS", "draw_pd_chart", "render_pd_table"]

PD_LABELS = {"kv_aware": "KV-aware prefill (router)", "round_robin": "round-robin prefill"}


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _n(x: float) -> str:
    return f"{x:,.0f}"


def render_pd_table(doc: dict[str, Any], console: Console) -> None:
    """Print the policies, the targets and the event plane (see the module docstring)."""
    policies = doc["policies"]
    table = Table(title="Disaggregated serving: the prefill choice", title_justify="left")
    table.add_column("figure")
    for name in policies:
        table.add_column(PD_LABELS.get(name, name), justify="right")
    rows: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
        ("prefill hit rate (prefill engines)", lambda p: _pct(p["prefill_hit_rate"])),
        (
            "pooled bound (one cache of the pool's pages)",
            lambda p: _pct(p["prefill_bound_hit_rate"]),
        ),
        ("of the pooled bound", lambda p: _pct(p["prefill_of_bound"])),
        ("unbounded cache", lambda p: _pct(p["prefill_unbounded_hit_rate"])),
        ("of the unbounded cache", lambda p: _pct(p["prefill_of_unbounded"])),
        ("prefill tokens computed", lambda p: _n(p["prefill_tokens_computed"])),
        ("decode tokens computed", lambda p: _n(p["decode_tokens_computed"])),
        ("blocks transferred", lambda p: _n(p["blocks_transferred"])),
        ("prefills skipped", lambda p: f"{p['prefills_skipped']:,} of {p['requests']:,}"),
        ("load max/min, prefill pool", lambda p: f"{p['load_max_over_min']['prefill']:.2f}"),
        ("load max/min, decode pool", lambda p: f"{p['load_max_over_min']['decode']:.2f}"),
        (
            "latency p50 / p99 ms",
            lambda p: f"{p['latency_ms_p50']:.0f} / {p['latency_ms_p99']:.0f}",
        ),
        ("failed requests", lambda p: str(p["failed"])),
    )
    for label, shown in rows:
        table.add_row(label, *(shown(p) for p in policies.values()))
    console.print(table)
    t = doc["targets"]
    ratio = t["kv_aware_over_round_robin"]
    kv = doc["policies"]["kv_aware"]
    loads = kv["load_max_over_min"]
    console.print(
        f"targets: KV-aware prefill hit rate {_pct(t['kv_aware_prefill_of_bound'])} of its "
        f"pooled bound, one cache of the pool's {kv['prefill_bound_pages']:,} pages (>= 95%: "
        f"{_yes(t['prefill_of_bound_met'])}; {_pct(kv['prefill_of_unbounded'])} of an unbounded "
        f"cache); against round-robin {'-' if ratio is None else f'{ratio:.2f}x'} (beats it: "
        f"{_yes(t['beats_round_robin'])}); load max/min prefill {loads['prefill']:.2f}, decode "
        f"{loads['decode']:.2f} (<= 1.15: {_yes(t['load_met']['prefill'])}, "
        f"{_yes(t['load_met']['decode'])}). Every request of the trace on the pooled bound's "
        f"cache: {_pct(doc['trace_bound_hit_rate'])} hit (unbounded: "
        f"{_pct(doc['trace_unbounded_hit_rate'])}).",
        soft_wrap=True,
    )
    ev = doc["events"]
    consistent = all(c["consistent"] for c in doc["index_consistency"].values())
    console.print(
        f"event plane (every engine): {ev['batches_published']:,} batches published, "
        f"{ev['batches_delivered']:,} delivered, {ev['replayed']:,} replayed, {ev['lost']:,} "
        f"lost; index = engines after each run: {'yes' if consistent else 'NO'}",
        soft_wrap=True,
    )


def _yes(met: bool) -> str:
    return "yes" if met else "[red]no[/red]"


def draw_pd_chart(
    path: Path,
    placements: dict[str, Sequence[tuple[int, int]]],
    bound: Sequence[tuple[int, int]],
    per_rank: dict[str, list[int]],
    title: str,
) -> Path:
    """The chart (see the module docstring); ``placements``: per policy, each handed-off
    request's ``(prompt, cached)``; ``bound``: the same on the pooled bound's cache."""
    from kvevents.demo.chart import draw_chart

    runs = [
        PolicyRun(name, [Outcome(0, p, c, 0.0, 0.0) for p, c in pairs])
        for name, pairs in placements.items()
    ]
    return draw_chart(
        path,
        runs,
        bound,
        PD_LABELS,
        per_rank,
        title,
        x_label="prefill leg (trace order)",
        y_label="prefill-pool hit rate (placement)",
        bound_label="one cache of the prefill pool's pages (bound)",
        rank_label="prefill rank (engines in order)",
    )
