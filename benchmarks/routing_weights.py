"""Routing weights compared offline: hit rate and balance per scenario, per set of weights.

    python benchmarks/routing_weights.py [--grid small|full] [--workers 2] [--json PATH]

What the router's default weights are chosen on (see :mod:`kvevents.router.decide.scoring`).
Each candidate (a policy and its :class:`~kvevents.router.decide.scoring.ScoringWeights`)
is replayed with :func:`kvevents.demo.offline.offline_replay` (the real router and caches,
a simulated clock) on every scenario:

* ``demo``: ``kvevents demo``'s defaults: 1,000 requests of the bundled conversation
  trace, 12x faster than recorded, at most 32 in flight, dp 4, 65,536 pages of 16 tokens;
* ``demo_seq``, ``seq_1000``: 300 and 1,000 requests, one at a time;
* ``demo_dp8``: as ``demo`` with 8 ranks of half the pages;
* ``synthetic``: 1,000 requests of Mooncake's synthetic trace (``--synthetic-trace``,
  skipped when the file is absent);
* ``vllm2_seq``, ``vllm2_c8``: the workload of ``scripts/real_vllm/route_trace.py`` (a
  32-token block per trace hash id, at most 16 per request, dp 2, 1,500 blocks per rank,
  back to back, one or 8 in flight), on which KV-aware routing without a balance term
  collapses onto one rank.

Per scenario it prints the hit rate as a fraction of the pooled upper bound (one cache
of the same total capacity, same order) and the load max/min (prompt tokens per rank),
and whether the routing targets (``TARGET_OF_BOUND``, ``TARGET_MAX_OVER_MIN``: the
demo's) hold everywhere. Writes
every figure as JSON (default ``benchmarks/results/routing_weights.json``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvevents.demo.offline import OfflineRequest, ServiceModel, offline_replay, workload_requests
from kvevents.demo.replay import Workload
from kvevents.demo.report import summarize
from kvevents.engine.cache import PrefixCache
from kvevents.results import write_results
from kvevents.router.decide.scoring import ScoringWeights
from kvevents.traces import BLOCK_TOKENS, hash_id_tokens, load_trace

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "routing_weights.json"
SYNTHETIC = HERE.parent.parent / "shared" / "traces" / "synthetic_trace.jsonl"
TARGET_OF_BOUND, TARGET_MAX_OVER_MIN = 0.9, 1.3


@dataclass(frozen=True)
class Scenario:
    name: str
    dp_size: int
    page_size: int
    max_blocks: int
    concurrency: int
    source: str  # "demo" (a bundled-style trace at the demo's settings) or "vllm"
    requests: int
    trace: str | None = None
    service: ServiceModel = field(default_factory=ServiceModel)

    def load(self) -> list[OfflineRequest]:
        if self.source == "vllm":
            return vllm_requests(self.requests)
        workload = Workload.load(self.trace, self.requests, speedup=12.0, max_new_tokens=32)
        return workload_requests(workload)


def vllm_requests(count: int, block: int = 32, max_blocks: int = 16) -> list[OfflineRequest]:
    """``route_trace.py``'s prompts: one ``block``-token block per hash id, back to back."""
    out = []
    for req in load_trace(limit=count):
        tokens: list[int] = []
        for hash_id in req.hash_ids[:max_blocks]:
            tokens.extend(hash_id_tokens(hash_id, block_tokens=block))
        scaled = -(-req.input_length * block // BLOCK_TOKENS)
        out.append(OfflineRequest(tokens[: max(1, min(len(tokens), scaled))], 0.0, 1))
    return out


def scenarios(synthetic: Path) -> list[Scenario]:
    vllm = ServiceModel(overhead_s=0.03, decode_tokens_per_s=float("inf"))
    out = [
        Scenario("demo", 4, 16, 65536, 32, "demo", 1000),
        Scenario("demo_seq", 4, 16, 65536, 1, "demo", 300),
        Scenario("seq_1000", 4, 16, 65536, 1, "demo", 1000),
        Scenario("demo_dp8", 8, 16, 32768, 32, "demo", 1000),
        Scenario("vllm2_seq", 2, 32, 1500, 1, "vllm", 1000, service=vllm),
        Scenario("vllm2_c8", 2, 32, 1500, 8, "vllm", 1000, service=vllm),
    ]
    if synthetic.is_file():
        out.insert(4, Scenario("synthetic", 4, 16, 65536, 32, "demo", 1000, str(synthetic)))
    else:
        print(f"no {synthetic}: the synthetic-trace scenario is skipped", file=sys.stderr)
    return out


def upper_bound(requests: Sequence[OfflineRequest], page_size: int, capacity: int) -> float:
    """Hit rate of one pooled cache of ``capacity`` pages over the same requests."""
    cache = PrefixCache(page_size, capacity)
    for r in requests:
        cache.release(cache.admit(r.tokens))
        cache.take_events()
    return cache.stats.hit_rate


def candidates(grid: str) -> list[tuple[str, dict[str, float]]]:
    """(policy, weights) to compare; the first kv-aware entries are the reference points."""
    out: list[tuple[str, dict[str, float]]] = [
        ("round-robin", {}),
        ("kv-aware", {"load_weight": 1.0, "balance_weight": 0.0}),  # the router before
        ("kv-aware", {"load_weight": 0.25, "balance_weight": 0.0}),  # the demo before
        ("kv-aware", {}),  # today's defaults
    ]
    if grid == "small":
        out += [
            ("kv-aware", {"load_weight": 0.25}),
            ("kv-aware", {"balance_weight": 0.02}),
            ("kv-aware", {"balance_weight": 0.1}),
            ("kv-aware", {"balance_half_life": 32.0}),
            ("kv-aware", {"balance_half_life": 128.0}),
        ]
    else:
        for lw in (0.0, 0.1, 0.25, 0.5):
            for bw in (0.02, 0.05, 0.1):
                for hl in (32.0, 64.0, 128.0):
                    w = {"load_weight": lw, "balance_weight": bw, "balance_half_life": hl}
                    if w != {k: default_weights()[k] for k in w}:  # the defaults come first
                        out.append(("kv-aware", w))
    return out


def _one(job: tuple[Scenario, str, dict[str, float]]) -> dict[str, Any]:
    scenario, policy, weights = job
    requests = _cached_requests(scenario)
    started = time.perf_counter()
    run = offline_replay(
        requests,
        dp_size=scenario.dp_size,
        page_size=scenario.page_size,
        max_blocks=scenario.max_blocks,
        concurrency=scenario.concurrency,
        policy=policy,
        weights=ScoringWeights(**weights),
        service=scenario.service,
    )
    s = summarize(run, scenario.dp_size)
    return {
        "hit_rate": s["hit_rate"],
        "load_max_over_min": s["load_max_over_min"],
        "seconds": time.perf_counter() - started,
    }


_REQUESTS: dict[str, list[OfflineRequest]] = {}


def _cached_requests(scenario: Scenario) -> list[OfflineRequest]:
    if scenario.name not in _REQUESTS:
        _REQUESTS[scenario.name] = scenario.load()
    return _REQUESTS[scenario.name]


def _bound(scenario: Scenario) -> float:
    requests = _cached_requests(scenario)
    return upper_bound(requests, scenario.page_size, scenario.max_blocks * scenario.dp_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=("small", "full"), default="small")
    parser.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--synthetic-trace", type=Path, default=SYNTHETIC)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    scens = scenarios(args.synthetic_trace)
    cands = candidates(args.grid)
    jobs = [(s, p, w) for p, w in cands for s in scens]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        bounds = dict(zip((s.name for s in scens), pool.map(_bound, scens), strict=True))
        figures = list(pool.map(_one, jobs))
    results = []
    for k, (policy, weights) in enumerate(cands):
        per = {}
        for j, s in enumerate(scens):
            f = figures[k * len(scens) + j]
            per[s.name] = {**f, "of_bound": f["hit_rate"] / bounds[s.name] if bounds[s.name] else 0}
        meets = all(
            v["of_bound"] >= TARGET_OF_BOUND and v["load_max_over_min"] <= TARGET_MAX_OVER_MIN
            for v in per.values()
        )
        full = {**default_weights(), **weights} if policy == "kv-aware" else {}
        results.append(
            {"policy": policy, "weights": full, "scenarios": per, "meets_targets": meets}
        )
    _print_table(scens, results)
    doc = {
        "benchmark": "routing_weights",
        "targets": {"of_bound": TARGET_OF_BOUND, "load_max_over_min": TARGET_MAX_OVER_MIN},
        "scenarios": {
            s.name: {
                "dp_size": s.dp_size,
                "page_size": s.page_size,
                "max_blocks_per_rank": s.max_blocks,
                "concurrency": s.concurrency,
                "requests": s.requests,
                "workload": s.source if s.trace is None else Path(s.trace).name,
                "upper_bound_hit_rate": bounds[s.name],
            }
            for s in scens
        },
        "results": results,
        "elapsed_s": time.perf_counter() - started,
    }
    write_results(args.json, doc)
    print(f"wrote {args.json} in {doc['elapsed_s']:.0f} s")
    return 0


def default_weights() -> dict[str, float]:
    """Today's ScoringWeights defaults, as a dict."""
    d = ScoringWeights()
    return {
        "load_weight": d.load_weight,
        "foreign_request_blocks": d.foreign_request_blocks,
        "balance_weight": d.balance_weight,
        "balance_half_life": d.balance_half_life,
    }


def _label(policy: str, weights: dict[str, float]) -> str:
    if policy != "kv-aware":
        return policy
    if not weights:
        return "defaults"
    short = {"load_weight": "lw", "balance_weight": "bw", "balance_half_life": "hl"}
    return " ".join(f"{short.get(k, k)}={v:g}" for k, v in weights.items())


def _print_table(scens: list[Scenario], results: list[dict[str, Any]]) -> None:
    """One row per candidate: % of the bound / load max-min per scenario, and the verdict."""
    names = [s.name for s in scens]
    head = f"{'candidate':<28}" + "".join(f"{n:>15}" for n in names) + "  targets"
    print("hit rate as % of the pooled bound / load max/min, per scenario")
    print(head)
    for r in results:
        weights = {k: v for k, v in r["weights"].items() if v != default_weights().get(k)}
        label = _label(r["policy"], weights) if r["policy"] == "kv-aware" else r["policy"]
        cells = "".join(
            f"{100 * r['scenarios'][n]['of_bound']:>8.1f}/{r['scenarios'][n]['load_max_over_min']:<6.2f}"
            for n in names
        )
        print(f"{label:<28}{cells}  {'met' if r['meets_targets'] else '-'}")


if __name__ == "__main__":
    sys.exit(main())
