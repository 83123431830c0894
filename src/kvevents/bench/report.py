"""Headline figures of ``kvevents bench`` results: the rich table and the performance page.

Each benchmark's JSON is large; :func:`headlines` picks, per benchmark, the figures that
have targets, as :class:`Figure` rows (what, measured, target, met). The same rows feed
the terminal table (:func:`render_table`) and the table of ``docs/performance.md``
(:func:`render_markdown`), so the two never disagree, and the targets live here only. A
benchmark missing from the results, or one whose JSON lacks a figure, yields fewer rows.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from rich.console import Console
from rich.table import Table

from kvevents.bench.placement import spans

__all__ = [
    "MARKER_END",
    "MARKER_START",
    "Figure",
    "headlines",
    "render_markdown",
    "render_table",
    "splice_readme",
]

MARKER_START = "<!-- performance:start -->"
MARKER_END = "<!-- performance:end -->"

TITLES = {
    "routing": "Routing quality (`kvevents demo`, conversation trace, dp 4)",
    "publisher": "Publisher (`ZmqEventPublisher` vs a bare pyzmq PUB, tcp loopback; both with an unlimited send queue)",
    "subscriber": "Subscriber (decode and deliver, per CPU second)",
    "index": "Prefix index (conversation trace, lower-level API)",
    "engine": "Simulated engine (events and blocks emitted per rank)",
    "ingest": "Ingest capacity (M engines at 3,000 block ops/s each, /route at 200 req/s)",
    "router": "Router under load (wrk, 32 connections, dp 4, prompts stored on the engine)",
    "instructions": "Work per request in instructions (callgrind, in process, 2,048-token prompts; HTTP not counted)",
    "burst": "Sibling bursts (groups sharing a new 2,048-token prefix, dp 4, 100 ms prefills)",
    "warm_start": "Warm restart from a peer (`--peer`, dp 4, prompts stored on the engine)",
}


class Figure(NamedTuple):
    """One headline row: ``met`` is None when the figure has no target."""

    benchmark: str
    what: str
    measured: str
    target: str
    met: bool | None


def _n(x: float) -> str:
    return f"{x:,.0f}"


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _routing(r: dict[str, Any]) -> Iterator[Figure]:
    kv, rr = r["policies"]["kv_aware"], r["policies"]["round_robin"]
    bound = r["upper_bound_hit_rate"]
    s = r["settings"]
    yield Figure(
        "routing",
        "requests per policy; cache per rank",
        f"{s['requests']:,}; {s['max_blocks_per_rank']:,} pages x {s['page_size']} tokens",
        "",
        None,
    )
    if s.get("router_args"):
        yield Figure("routing", "router options", f"`{' '.join(s['router_args'])}`", "", None)
    yield Figure("routing", "hit rate, KV-aware", _pct(kv["hit_rate"]), "", None)
    yield Figure("routing", "hit rate, round-robin", _pct(rr["hit_rate"]), "", None)
    yield Figure("routing", "hit rate, pooled cache (upper bound)", _pct(bound), "", None)
    ratio = kv["hit_rate"] / bound if bound else 0.0
    yield Figure("routing", "KV-aware / upper bound", _pct(ratio), ">= 90%", ratio >= 0.9)
    better = kv["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
    yield Figure("routing", "KV-aware / round-robin", f"{better:.2f}x", "> 1", better > 1)
    bal = kv["load_max_over_min"]
    yield Figure("routing", "load max/min, KV-aware", f"{bal:.2f}", "<= 1.3", bal <= 1.3)
    yield Figure("routing", "load max/min, round-robin", f"{rr['load_max_over_min']:.2f}", "", None)
    ev = r["events"]
    yield Figure(
        "routing",
        "batches published / delivered / lost",
        f"{ev['batches_published']:,} / {ev['batches_delivered']:,} / {ev['lost']}",
        "0 lost",
        ev["lost"] == 0 and ev["batches_published"] == ev["batches_delivered"],
    )
    secs = r["elapsed_s"]
    yield Figure("routing", "demo wall time", f"{secs:.0f} s", "< 180 s", secs < 180)


def _publisher(r: dict[str, Any]) -> Iterator[Figure]:
    for c in r["cases"]:
        b = c["blocks_per_batch"]
        share = c["share_of_ceiling"]
        raw = c.get("share_of_raw_ceiling")
        yield Figure(
            "publisher",
            f"{b}-block batches: blocks/s delivered (share of a bare PUB"
            + ("; of pyzmq's C-level send)" if raw is not None else ")"),
            f"{_n(c['publisher_blocks_per_s'])} ({_pct(share)}"
            + (f"; {_pct(raw)})" if raw is not None else ")"),
            ">= 90%",
            share >= 0.9,
        )
        p99 = c["publish_p99_us_median"]
        yield Figure(
            "publisher", f"{b}-block batches: publish() p99", f"{p99:.2f} us", "<= 5 us", p99 <= 5
        )
        worst = c["publish_max_us_worst"] / 1000.0
        yield Figure(
            "publisher",
            f"{b}-block batches: publish() max",
            f"{worst:.1f} ms",
            "<= 5 ms",
            worst <= 5,
        )
        if "raw_ceiling_calls_over_5ms" in c:
            yield Figure(
                "publisher",
                f"{b}-block batches: calls over 5 ms in {c['publish_calls']:,}: publish() / "
                "bare send_multipart / C-level sends (worst of each)",
                f"{c['publish_calls_over_5ms']} / {c['ceiling_calls_over_5ms']} / "
                f"{c['raw_ceiling_calls_over_5ms']} ({worst:.1f} / "
                f"{c['ceiling_call_max_us_worst'] / 1000.0:.1f} / "
                f"{c['raw_ceiling_call_max_us_worst'] / 1000.0:.1f} ms)",
                "",
                None,
            )
        lost = c["lost_in_all_rounds"]
        yield Figure("publisher", f"{b}-block batches: lost", str(lost), "0", lost == 0)


def _subscriber(r: dict[str, Any]) -> Iterator[Figure]:
    target = r.get("target_blocks_per_cpu_s_32", 1_000_000)
    for c in r["cases"]:
        b = c["blocks_per_batch"]
        per_cpu = c["blocks_per_cpu_s"]
        yield Figure(
            "subscriber",
            f"{c['mode']}, {c['streams']} stream{'s' if c['streams'] != 1 else ''}, "
            f"{b}-block batches: blocks per CPU s",
            _n(per_cpu),
            f">= {_n(target)}" if b == 32 else "",
            per_cpu >= target if b == 32 else None,
        )


def _index(r: dict[str, Any]) -> Iterator[Figure]:
    targets = r.get("targets", {})
    p99_targets = targets.get("match_p99_us", {"8": 15.0, "64": 20.0})
    for w, f in r["results"].items():
        t = p99_targets.get(w)
        yield Figure(
            "index",
            f"W={w}: match p50 / p99",
            f"{f['match_p50_us']:.1f} / {f['match_p99_us']:.1f} us",
            "" if t is None else f"p99 <= {t:g} us",
            None if t is None else f["match_p99_us"] <= t,
        )
        ingest = f["ingest_block_ops_per_s"]
        yield Figure(
            "index", f"W={w}: ingest block-ops/s", _n(ingest), ">= 800,000", ingest >= 800_000
        )
        full = f["full_path_block_ops_per_s"]
        yield Figure(
            "index",
            f"W={w}: decode + apply block-ops/s, one core",
            _n(full),
            ">= 300,000",
            full >= 300_000,
        )
        if "bytes_per_holder_block" in f:
            per = f["bytes_per_holder_block"]
            yield Figure(
                "index", f"W={w}: bytes per (block, holder)", f"{per:.0f}", "<= 100", per <= 100
            )


def _engine(r: dict[str, Any]) -> Iterator[Figure]:
    t, s = r["total"], r["settings"]
    yield Figure(
        "engine",
        f"{s['requests']:,} requests on {s['dp_size']} ranks: blocks per CPU s per rank",
        _n(t["blocks_per_cpu_s_mean"]),
        "",
        None,
    )
    yield Figure(
        "engine",
        "events / blocks per s per rank",
        f"{t['events_per_s_per_rank_mean']:,.0f} / {_n(t['blocks_per_s_per_rank_mean'])}",
        "",
        None,
    )
    dropped = t["publisher_dropped"]
    yield Figure("engine", "batches dropped by the publisher", str(dropped), "0", dropped == 0)


def _router(r: dict[str, Any]) -> Iterator[Figure]:
    runs = r["runs"]

    def rate(key: str) -> str:
        run = runs[key]
        return f"{_n(run['requests_per_s'])} req/s, p50 {run['p50_ms']:.1f} / p99 {run['p99_ms']:.1f} ms"

    for tokens in ("2048", "8192"):
        bare = runs.get(f"bare_{tokens}")
        if bare is not None:
            yield Figure(
                "router",
                f"bare server (parse only), {tokens}-token prompts",
                rate(f"bare_{tokens}"),
                "",
                None,
            )
        for path in ("route", "query"):
            prefix = f"{path}_{tokens}_workers"
            keys = [k for k in runs if k.startswith(prefix) and k[len(prefix) :].isdigit()]
            for key in sorted(keys):
                workers = key[len(prefix) :]
                run = runs[key]
                target, met = "", None
                if path == "route" and tokens == "2048":
                    need = 4000 if workers == "1" else 7000
                    target = f">= {need:,} req/s, p99 <= 10 ms"
                    met = run["requests_per_s"] >= need and run["p99_ms"] <= 10
                    if workers == "1" and bare is not None:  # the ceiling: one process too
                        target += ", >= 75% of bare"
                        met = met and run["requests_per_s"] >= 0.75 * bare["requests_per_s"]
                elif path == "route" and tokens == "8192" and workers == "1":
                    target, met = ">= 2,000 req/s", run["requests_per_s"] >= 2000
                share = ""
                if bare is not None:
                    share = f" ({run['requests_per_s'] / bare['requests_per_s']:.0%} of bare)"
                yield Figure(
                    "router",
                    f"/{path}, {tokens}-token prompts, --workers {workers}",
                    rate(key) + share,
                    target,
                    met,
                )
    direct, via = runs.get("completions_direct"), runs.get("completions_via_router")
    if direct and via:
        added = via["p50_ms"] - direct["p50_ms"]
        yield Figure(
            "router",
            "/v1/completions p50: engine direct / through the router",
            f"{direct['p50_ms']:.1f} / {via['p50_ms']:.1f} ms ({added:+.1f} ms)",
            "<= +2 ms",
            added <= 2.0,
        )
    compared = r.get("completions")
    if compared is not None and len(compared["rounds"]) > 1:
        rounds = ", ".join(f"{a:+.1f}" for a in compared["added_p50_ms"])
        median = compared["added_p50_ms_median"]
        yield Figure(
            "router",
            f"/v1/completions added p50, median of {len(compared['rounds'])} alternating rounds",
            f"{median:+.1f} ms (rounds: {rounds})",
            "<= +2 ms",
            median <= 2.0,
        )
    if compared is not None and "bare_added_p50_ms_median" in compared:
        rounds = ", ".join(f"{a:+.1f}" for a in compared["bare_added_p50_ms"])
        bare = compared["bare_added_p50_ms_median"]
        cpu = [
            (
                pair["bare"].get("bare_relay_cpu_us_per_request"),
                pair["via"].get("router_cpu_us_per_request"),
            )
            for pair in compared["rounds"]
        ]
        known = [(b, v) for b, v in cpu if b is not None and v is not None]
        per = ""
        if known:
            b_cpu = statistics.median(b for b, _ in known)
            v_cpu = statistics.median(v for _, v in known)
            per = f"; CPU per request {b_cpu:.0f} vs the router's {v_cpu:.0f} us"
        yield Figure(
            "router",
            "/v1/completions added p50 by a bare relay on the same stack (no routing), median",
            f"{bare:+.1f} ms (rounds: {rounds}){per}",
            "",
            None,
        )
    yield from _router_pd(r.get("pd"))
    cost = r.get("note_cost")
    if cost is not None:
        ratios = cost["round_ratios_on_over_off"]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        yield Figure(
            "router",
            f"/route recording, --sync off / on (median of {cost['rounds']} interleaved rounds)",
            f"{_n(cost['median_requests_per_s_off'])} / {_n(cost['median_requests_per_s_on'])} "
            f"req/s: a note costs {cost['cost']:.1%} (on/off per round {spread})",
            "<= 5%",
            cost["cost"] <= 0.05,
        )
        if cost.get("cpu_cost") is not None:
            yield Figure(
                "router",
                "router CPU per /route request, --sync off / on (median)",
                f"{cost['median_cpu_us_per_request_off']:.0f} / "
                f"{cost['median_cpu_us_per_request_on']:.0f} us: {cost['cpu_cost']:+.1%}",
                "",
                None,
            )
        inner = cost.get("in_process")
        if inner is not None and "share_of_route_cpu" in inner:
            yield Figure(
                "router",
                "one note in process (encode, queue, publish to NATS)",
                f"{inner['note_us']:.1f} us = {inner['share_of_route_cpu']:.1%} of a /route's CPU",
                "",
                None,
            )


def _router_pd(pd: dict[str, Any] | None) -> Iterator[Figure]:
    """The disaggregated comparison (:mod:`kvevents.bench.pd_router`), when it ran: the
    median of the rounds' added p50s against the target, their spread, each round, the
    placement it was measured with, and the router's CPU per request."""
    if pd is None:
        return
    rounds = pd["rounds"]
    setup = pd["setup"]
    added = pd["added_p50_ms"]
    each = ", ".join(f"{a:+.1f}" for a in added)
    median = pd["added_p50_ms_median"]
    bar = pd.get("target", {}).get("added_p50_ms_at_most", 2.0)
    direct = statistics.median(r["direct"]["p50_ms"] for r in rounds)
    cpu = [r["via"].get("router_cpu_us_per_request") for r in rounds]
    known = [c for c in cpu if c is not None]
    per = ""
    if known:
        per = f"; router CPU {statistics.median(known):.0f} us per request"
        per += f" ({min(known):.0f}-{max(known):.0f})" if len(known) > 1 else ""
    placement = setup.get("placement")
    if placement is not None:
        # what the added p50 follows while the closed loop saturates the busiest CPUs:
        # the CPU per request spent on them (pinned: off the router's)
        pinned = bool(placement.get("pinned"))
        keys = (
            ("client", "prefill", "decode") if pinned else ("client", "prefill", "decode", "router")
        )
        spent = {side: _cpu_sum(rounds, side, keys) for side in ("direct", "via")}
        if None not in spent.values():
            whose = "client and engines" if pinned else "all processes"
            per += (
                f"; {whose}' CPU per request {spent['direct']:.0f} direct, {spent['via']:.0f} via"
            )
    protocol = {"sglang": "SGLang legs at once", "vllm": "vLLM legs in turn"}.get(
        setup.get("protocol", "sglang"), setup.get("protocol")
    )
    yield Figure(
        "router",
        f"P/D /v1/completions added p50 ({protocol}, {setup['connections']} in flight, "
        f"{_decoded(setup)} decoded each, "
        f"{'both clients at once, ' if setup.get('together') else ''}"
        f"{_placed(setup.get('placement'))}), median of {len(rounds)} alternating rounds' "
        "differences",
        f"{median:+.1f} ms over both legs sent directly (rounds {min(added):+.1f} to "
        f"{max(added):+.1f}: {each}; direct p50 {direct:.1f} ms){per}",
        f"<= +{bar:g} ms",
        median <= bar,
    )


def _decoded(setup: dict[str, Any]) -> str:
    """What each P/D request decoded: ``356 ± 44 tokens``, ``1 token``."""
    tokens, spread = setup.get("max_tokens", 1), setup.get("max_tokens_spread", 0)
    within = f" ± {spread}" if spread else ""
    return f"{tokens}{within} token{'' if tokens == 1 and not spread else 's'}"


def _cpu_sum(rounds: list[dict[str, Any]], side: str, keys: tuple[str, ...]) -> float | None:
    """The median over ``rounds`` of ``side``'s CPU per request summed over ``keys``'
    processes (None when a round lacks one)."""
    sums = [
        sum(r[side][f"{k}_cpu_us_per_request"] for k in keys)
        for r in rounds
        if all(r[side].get(f"{k}_cpu_us_per_request") is not None for k in keys)
    ]
    return statistics.median(sums) if len(sums) == len(rounds) else None


def _placed(placement: dict[str, Any] | None) -> str:
    """Where the P/D comparison's processes ran, as the report says it."""
    if placement is None:
        return "placement not recorded"
    if not placement.get("pinned"):
        return "unpinned: router, engines and client share every CPU"
    router, others = placement["router_cpus"], placement["client_and_engine_cpus"]
    return f"router pinned to {spans(router)}, client and engines to {spans(others)}"


def _instructions(r: dict[str, Any]) -> Iterator[Figure]:
    per, adds = r["instructions_per_request"], r["router_adds"]
    labels = {
        "bare": "bare server /route (the body decoded)",
        "route": "router /route",
        "query": "router /query",
        "bare_relay": "bare relay /v1/completions (engine answers in process)",
        "relay": "router /v1/completions (engine answers in process)",
    }
    for case, label in labels.items():
        if case not in per:
            continue
        added = adds.get(case)
        base = per.get("bare_relay" if case == "relay" else "bare")
        extra = (
            ""
            if added is None or not base
            else f" (+{_n(added)}; bare {_pct(base / per[case])} of it)"
        )
        yield Figure("instructions", label, f"{_n(per[case])}{extra}", "", None)


def _ingest(r: dict[str, Any]) -> Iterator[Figure]:
    for run in r["rounds"]:
        yield Figure(
            "ingest",
            f"{run['engines']} engines, --workers {run['router_processes']}: "
            "backlog / /route p50 / p99",
            f"{run['backlog_s']:.2f} s / {run['route_p50_ms']:.1f} / {run['route_p99_ms']:.1f} ms",
            "< 1 s, p99 <= 10 ms",
            bool(run["keeps_up"]),
        )
    for workers, m in r["engines_kept_up"].items():
        yield Figure("ingest", f"engines followed, --workers {workers}", str(m), "", None)


def _burst(r: dict[str, Any]) -> Iterator[Figure]:
    modes = r["modes"]
    for name, m in modes.items():
        on = name == "predictions_on"
        yield Figure(
            "burst",
            f"{name}: engine hit rate, share of ideal",
            _pct(m["hit_rate_of_ideal"]),
            ">= 85%" if on else "",
            m["hit_rate_of_ideal"] >= 0.85 if on else None,
        )
        yield Figure(
            "burst",
            f"{name}: groups on <= 2 ranks (mean ranks per group)",
            f"{_pct(m['groups_on_at_most_2_ranks'])} ({m['mean_ranks_per_group']:.2f})",
            ">= 90%" if on else "",
            m["groups_on_at_most_2_ranks"] >= 0.9 if on else None,
        )
        yield Figure(
            "burst", f"{name}: requests per rank max/min", f"{m['load_max_min']:.2f}", "", None
        )


def _warm_start(r: dict[str, Any]) -> Iterator[Figure]:
    yield Figure(
        "warm_start",
        "index blocks; snapshot size",
        f"{r['index_blocks']:,}; {r['snapshot_bytes'] / 1e6:.1f} MB",
        "",
        None,
    )
    yield Figure(
        "warm_start",
        "snapshot encode / decode and load",
        f"{r['encode_s']:.2f} / {r['decode_load_s']:.2f} s",
        "",
        None,
    )
    yield Figure("warm_start", "launch to ready", f"{r['ready_after_launch_s']:.2f} s", "", None)
    equal = r["equal_after_launch_s"]
    yield Figure(
        "warm_start",
        "launch to index equal to the engine's (exact after the run)",
        "never" if equal is None else f"{equal:.2f} s" + ("" if r["all_exact"] else " (not exact)"),
        "<= 2 s",
        equal is not None and equal <= 2.0 and bool(r["all_exact"]),
    )
    yield Figure(
        "warm_start",
        "peer's slowest /route while serving the snapshot (idle)",
        f"{r['peer_route_max_ms']:.0f} ms ({r['peer_route_idle_max_ms']:.0f} ms)",
        "",
        None,
    )


_EXTRACTORS: dict[str, Callable[[dict[str, Any]], Iterator[Figure]]] = {
    "routing": _routing,
    "publisher": _publisher,
    "subscriber": _subscriber,
    "index": _index,
    "engine": _engine,
    "router": _router,
    "instructions": _instructions,
    "ingest": _ingest,
    "burst": _burst,
    "warm_start": _warm_start,
}


def headlines(results: dict[str, Any]) -> list[Figure]:
    """The headline rows of every benchmark in ``results`` (``{name: its JSON}``), in order."""
    rows: list[Figure] = []
    for name, extract in _EXTRACTORS.items():
        result = results.get(name)
        if isinstance(result, dict):
            try:
                rows.extend(extract(result))
            except (KeyError, TypeError, ZeroDivisionError) as exc:
                rows.append(Figure(name, "results unreadable", f"missing {exc}", "", False))
    return rows


def _met(met: bool | None) -> str:
    return "" if met is None else ("yes" if met else "no")


def render_table(doc: dict[str, Any], console: Console) -> None:
    """The headline rows as a rich table (plus any benchmark that failed)."""
    table = Table(title=f"kvevents bench ({doc.get('command', '')})", title_justify="left")
    for column, justify in (
        ("benchmark", "left"),
        ("figure", "left"),
        ("measured", "right"),
        ("target", "right"),
        ("met", "center"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for f in headlines(doc.get("results", {})):
        met = _met(f.met)
        table.add_row(f.benchmark, f.what, f.measured, f.target, met if met != "no" else "[red]no")
    for name, error in doc.get("errors", {}).items():
        table.add_row(name, "[red]failed", error, "", "")
    console.print(table)


def render_markdown(doc: dict[str, Any]) -> str:
    """The performance page's table (without the markers), from a bench JSON document."""
    machine = doc.get("machine", {})
    lines = [
        f"Measured with `{doc.get('command', 'kvevents bench all')}` on {doc.get('date', '?')}, "
        f"on a {machine.get('cpus', '?')}-core {machine.get('machine', '')} machine, "
        f"Python {machine.get('python', '?')}"
        + (" (quick settings: smoke figures only)" if doc.get("quick") else "")
        + ". Regenerate this section with `scripts/update-readme-performance`.",
        "",
    ]
    rows = headlines(doc.get("results", {}))
    for name, title in TITLES.items():
        mine = [f for f in rows if f.benchmark == name]
        if not mine:
            continue
        lines += [
            f"**{title}**",
            "",
            "| figure | measured | target | met |",
            "| --- | ---: | ---: | :---: |",
        ]
        lines += [f"| {f.what} | {f.measured} | {f.target} | {_met(f.met)} |" for f in mine]
        lines.append("")
    for name, error in doc.get("errors", {}).items():
        lines.append(f"- `{name}` did not run: {error}")
    return "\n".join(lines).rstrip() + "\n"


def splice_readme(readme: str, section: str) -> str:
    """``readme`` (a markdown page: ``docs/performance.md``) with the text between the
    performance markers replaced by ``section``.

    Adds a ``## Performance`` heading with the markers at the end when they are missing.
    """
    start, end = readme.find(MARKER_START), readme.find(MARKER_END)
    if start == -1 or end == -1 or end < start:
        if start != -1 or end != -1:
            raise ValueError(
                f"README has only one of {MARKER_START} and {MARKER_END}, or in the wrong "
                "order: fix the markers by hand"
            )
        readme = readme.rstrip("\n") + f"\n\n## Performance\n\n{MARKER_START}\n{MARKER_END}\n"
        start, end = readme.find(MARKER_START), readme.find(MARKER_END)
    head = readme[: start + len(MARKER_START)]
    return f"{head}\n{section.rstrip()}\n{readme[end:]}"
