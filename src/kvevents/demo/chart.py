"""The demo's PNG chart: hit rate over the trace per policy, and prompt tokens per rank.

Left panel: cumulative hit rate (cached prompt tokens so far / prompt tokens so far)
against the request's position in the trace, per policy and for the pooled upper
bound, with a thinner rolling line (a window of ``window`` requests) per policy.
Right panel: prompt tokens served by each rank per policy (the load balance).
Drawn with matplotlib's Agg backend: no display needed. matplotlib is the ``demo``
extra (``pip install 'kvevents[demo]'``), not a dependency of the router:
:func:`chart_available` says whether it is there.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from kvevents.demo.replay import Outcome, PolicyRun

__all__ = ["chart_available", "cumulative", "draw_chart", "rolling"]

_COLORS = {
    "kv_aware": "#1f77b4",
    "replicas_sync": "#9467bd",
    "replicas_alone": "#8c564b",
    "round_robin": "#ff7f0e",
    "upper_bound": "#2ca02c",
}


def chart_available() -> bool:
    """Whether matplotlib can be imported (the ``demo`` extra is installed)."""
    return importlib.util.find_spec("matplotlib") is not None


def cumulative(pairs: Sequence[tuple[int, int]]) -> list[float]:
    """Cumulative hit rate after each ``(prompt, cached)`` pair."""
    out: list[float] = []
    prompt = cached = 0
    for p, c in pairs:
        prompt += p
        cached += c
        out.append(cached / prompt if prompt else 0.0)
    return out


def rolling(pairs: Sequence[tuple[int, int]], window: int) -> list[float]:
    """Hit rate over the last ``window`` pairs, after each pair. O(len(pairs))."""
    out: list[float] = []
    prompt = cached = 0
    for i, (p, c) in enumerate(pairs):
        prompt += p
        cached += c
        if i >= window:
            prompt -= pairs[i - window][0]
            cached -= pairs[i - window][1]
        out.append(cached / prompt if prompt else 0.0)
    return out


def _pairs(run: PolicyRun) -> list[tuple[int, int]]:
    return [
        (o.prompt_tokens, o.cached_tokens)
        for o in run.outcomes
        if isinstance(o, Outcome) and o.error is None
    ]


def draw_chart(
    path: Path,
    runs: Sequence[PolicyRun],
    upper_bound: Sequence[tuple[int, int]],
    labels: dict[str, str],
    per_rank: dict[str, list[int]],
    title: str,
    window: int = 100,
    *,
    x_label: str = "request (trace order)",
    y_label: str = "prefix-cache hit rate",
    bound_label: str = "pooled cache (upper bound)",
    rank_label: str = "dp rank",
) -> Path:
    """Write the chart to ``path`` (a PNG) and return it; the labels name the axes, the
    bound's line and the right panel's bars (the P/D demo plots its prefill pool)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [2.2, 1]}
    )
    try:
        for run in runs:
            pairs = _pairs(run)
            x = range(1, len(pairs) + 1)
            color = _COLORS.get(run.name)
            label = labels.get(run.name, run.name)
            left.plot(x, cumulative(pairs), color=color, linewidth=2.2, label=label)
            left.plot(
                x,
                rolling(pairs, window),
                color=color,
                linewidth=0.8,
                alpha=0.45,
                label=f"{label}, last {window}",
            )
        bound = list(upper_bound)
        left.plot(
            range(1, len(bound) + 1),
            cumulative(bound),
            color=_COLORS["upper_bound"],
            linewidth=2.0,
            linestyle="--",
            label=bound_label,
        )
        left.set_xlabel(x_label)
        left.set_ylabel(y_label)
        left.yaxis.set_major_formatter(lambda v, _pos: f"{100 * v:.0f}%")
        left.set_ylim(bottom=0)
        left.grid(alpha=0.3)
        left.legend(loc="upper left", fontsize=8)
        left.set_title("hit rate over the trace (cumulative; thin: rolling)", fontsize=10)

        names = list(per_rank)
        ranks = max((len(v) for v in per_rank.values()), default=0)
        width = 0.8 / max(1, len(names))
        for j, name in enumerate(names):
            xs = [r + (j - (len(names) - 1) / 2) * width for r in range(ranks)]
            right.bar(
                xs,
                [t / 1e6 for t in per_rank[name]],
                width,
                color=_COLORS.get(name),
                label=labels.get(name, name),
            )
        right.set_xticks(range(ranks))
        right.set_xlabel(rank_label)
        right.set_ylabel("prompt tokens served (millions)")
        right.grid(axis="y", alpha=0.3)
        right.legend(fontsize=8)
        right.set_title("load per rank", fontsize=10)
        fig.suptitle(title, fontsize=11)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
