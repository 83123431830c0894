"""``kvevents demo --prefill-engines N --decode-engines M``: what KV-aware prefill choice buys.

::

    kvevents demo --prefill-engines 2 --decode-engines 2 [--dp-size 4] [--requests N]
                  [--router-args "--max-local-prefill-tokens 256"] [--json FILE] [--out DIR]

1. Starts N engines with ``--disaggregation-mode prefill`` and M with
   ``--disaggregation-mode decode`` (``--dp-size`` ranks each, the one-pool demo's
   cache and KV-event settings) and one ``kvevents router --prefill URL ... --decode
   URL ...`` (:mod:`kvevents.demo.pd_fleet`).
2. Replays the trace twice through the P/D hand-off (SGLang's protocol), as the
   one-pool demo replays it (arrival times, ``--concurrency`` in flight): through the
   router, which chooses the decode holder, skips the prefill hop when the decode holds
   all but ``--max-local-prefill-tokens`` of the prompt, else chooses the prefill holder
   KV-aware; then, after flushing every cache, with the same decode choice but the
   prefill ranks taken in turn (:mod:`kvevents.demo.pd_baseline`, and why the router
   cannot do that itself).
3. After each replay, waits until the router has applied every batch of every engine,
   checks its index against each engine's caches, and reads each rank's counters.
4. Prints per policy the prefill pool's hit rate against its pooled bound (one cache of
   the pool's pages fed the same prefill legs, as the one-pool demo's bound) and against
   one unbounded cache, the tokens computed per pool, blocks transferred, prefills
   skipped and each pool's load max/min (:mod:`kvevents.demo.pd_figures`,
   :mod:`kvevents.demo.pd_report`), draws the chart and writes ``--json``.

Everything it started is stopped before it returns, whatever happens. Exit codes as
the one-pool demo's: 0 when every request succeeded, nothing was lost and every index
matched its engine; 1 otherwise; 2 for bad options (``--routers`` is the one-pool
demo's; the demo gives the router its engines, so ``--router-args`` must not).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvevents.demo.chart import chart_available
from kvevents.demo.pd_baseline import RoundRobinPrefill
from kvevents.demo.pd_figures import (
    counts_over,
    request_keys,
    summarize_pd,
    targets_met,
    trace_bounds,
)
from kvevents.demo.pd_fleet import PDFleet
from kvevents.demo.pd_report import PD_LABELS, draw_pd_chart, render_pd_table
from kvevents.demo.plane import Settled
from kvevents.demo.replay import Outcome, PolicyRun, Sender, Workload, replay
from kvevents.demo.signals import Interrupts
from kvevents.errors import ConfigError
from kvevents.results import write_results
from kvevents.types import PositiveInt, bounded

__all__ = ["add_pd_arguments", "check_pd_options", "pd_requested", "run_pd", "run_pd_demo"]

_GIVEN_BY_THE_DEMO = ("--engine", "--engines-file", "--prefill", "--decode")


def add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--prefill-engines",
        type=bounded(PositiveInt),
        default=None,
        metavar="N",
        help="disaggregated: N prefill engines (with --decode-engines; see the module docs)",
    )
    add(
        "--decode-engines",
        type=bounded(PositiveInt),
        default=None,
        metavar="M",
        help="disaggregated: M decode engines (with --prefill-engines)",
    )


def pd_requested(args: argparse.Namespace) -> bool:
    return args.prefill_engines is not None or args.decode_engines is not None


def check_pd_options(args: argparse.Namespace) -> list[str]:
    """The router's extra options; ConfigError naming the option for a bad combination."""
    for given, missing in (
        ("--prefill-engines", "decode_engines"),
        ("--decode-engines", "prefill_engines"),
    ):
        if getattr(args, missing) is None:
            flag = "--" + missing.replace("_", "-")
            raise ConfigError(
                f"{given} needs {flag}: a disaggregated fleet has both pools; give "
                "--prefill-engines N --decode-engines M"
            )
    if args.routers != 1:
        raise ConfigError(
            f"--routers {args.routers} cannot be combined with --prefill-engines and "
            "--decode-engines: the disaggregated demo runs one router; drop --routers"
        )
    try:
        extra = shlex.split(args.router_args)
    except ValueError as exc:
        raise ConfigError(f"--router-args {args.router_args!r}: {exc}") from None
    for token in extra:
        if token.split("=", 1)[0] in _GIVEN_BY_THE_DEMO:
            raise ConfigError(
                f"--router-args gives {token.split('=', 1)[0]}: the disaggregated demo gives "
                "the router its --prefill and --decode engines itself; leave it out"
            )
    return extra


def run_pd(args: argparse.Namespace) -> int:
    doc = run_pd_demo(args, Console())
    return 0 if doc["ok"] else 1


def _replay(
    name: str,
    workload: Workload,
    router_url: str,
    args: argparse.Namespace,
    console: Console,
    interrupts: Interrupts,
    send: Sender | None,
) -> PolicyRun:
    columns = (
        TextColumn("{task.description:<26}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("prefills skipped {task.fields[skipped]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(PD_LABELS[name], total=len(workload), skipped=0)
        skipped = [0]

        def on_done(outcome: Outcome) -> None:
            skipped[0] += (outcome.routed or {}).get("prefill_skipped") is True
            progress.update(task, advance=1, skipped=skipped[0])

        return interrupts.run(
            replay(
                name,
                workload,
                f"{router_url}/generate",
                concurrency=args.concurrency,
                on_done=on_done,
                send=send,
            )
        )


def run_pd_demo(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Run the disaggregated demo (see the module docstring); returns its results document."""
    started = time.monotonic()
    router_extra = check_pd_options(args)
    workload = Workload.load(
        args.trace, args.requests, speedup=args.speedup, max_new_tokens=args.max_new_tokens
    )
    say = console.print
    fleet = PDFleet(args, router_extra)
    runs: dict[str, PolicyRun] = {}
    counts: dict[str, Any] = {}
    consistency: dict[str, Settled] = {}
    with Interrupts() as interrupts:  # Ctrl-C and SIGTERM: see kvevents.demo.signals
        try:
            say(
                f"starting {args.prefill_engines} prefill and {args.decode_engines} decode "
                f"engines (dp {args.dp_size} each) and kvevents router",
                soft_wrap=True,
            )
            fleet.start(lambda line: say(line, soft_wrap=True))
            baseline = RoundRobinPrefill(fleet.router_url, fleet.prefill_ranks(), fleet.bootstrap())
            say(
                f"replaying {len(workload):,} requests of {workload.trace_name}, "
                f"{args.speedup:g}x faster than recorded, at most {args.concurrency} in flight",
                soft_wrap=True,
            )
            for name, send in (("kv_aware", None), ("round_robin", baseline)):
                if runs:
                    fleet.flush()
                before = fleet.counters()
                runs[name] = _replay(
                    name, workload, fleet.router_url, args, console, interrupts, send
                )
                for url, settled in fleet.settle().items():
                    consistency[f"{name} {url}"] = settled
                counts[name] = counts_over(fleet.counters(), before)
            events = fleet.event_counts()
        finally:
            with interrupts.deferred():  # a second signal must not cut the cleanup short
                fleet.stop()
    keys = request_keys(workload, args.page_size)
    policies: dict[str, dict[str, Any]] = {}
    curves: dict[str, dict[str, list[tuple[int, int]]]] = {}
    pages = args.prefill_engines * args.dp_size * args.max_blocks
    for name, run in runs.items():
        policies[name], curves[name] = summarize_pd(
            run, workload, keys, counts[name], page_size=args.page_size, pages=pages
        )
    chart = None
    if not args.no_chart and not chart_available():
        say("no chart: matplotlib is not installed (pip install 'kvevents[demo]')")
    elif not args.no_chart:
        chart = draw_pd_chart(
            args.out / "kvevents-demo-pd.png",
            {name: c["placement"] for name, c in curves.items()},
            curves["kv_aware"]["pooled"],
            {name: p["prompt_tokens_per_rank"]["prefill"] for name, p in policies.items()},
            f"kvevents demo: {len(workload):,} requests of {workload.trace_name}, "
            f"{args.prefill_engines} prefill + {args.decode_engines} decode engines, "
            f"dp {args.dp_size}",
        )
    failed = sum(p["failed"] for p in policies.values())
    ok = failed == 0 and events.lost == 0 and all(s.consistent for s in consistency.values())
    doc: dict[str, Any] = {
        "mode": "disaggregated",
        "settings": {
            "trace": workload.trace_name,
            "requests": len(workload),
            "prefill_engines": args.prefill_engines,
            "decode_engines": args.decode_engines,
            "dp_size": args.dp_size,
            "enable_dp_attention": args.enable_dp_attention,
            "page_size": args.page_size,
            "max_blocks_per_rank": args.max_blocks,
            "speedup": args.speedup,
            "concurrency": args.concurrency,
            "max_new_tokens": args.max_new_tokens,
            "router_args": router_extra,
            "protocol": "sglang",
        },
        "policies": policies,
        **trace_bounds(workload, keys, args.page_size, pages),
        "targets": targets_met(policies),
        "events": dataclasses.asdict(events),
        "index_consistency": {
            name: {
                "engine_blocks": s.engine_blocks,
                "index_blocks": s.index_blocks,
                "consistent": s.consistent,
            }
            for name, s in consistency.items()
        },
        "processes": fleet.pids(),
        "chart": None if chart is None else str(chart),
        "elapsed_s": time.monotonic() - started,
        "ok": ok,
    }
    render_pd_table(doc, console)
    if chart is not None:
        say(f"chart: {chart}")
    if args.json is not None:
        write_results(args.json, doc)
        say(f"results: {args.json}")
    say(f"done in {doc['elapsed_s']:.0f} s; engines and router stopped")
    if not ok:
        say(
            f"[red]problems: {failed} failed requests, {events.lost} lost sequence numbers, "
            f"index consistent: {[s.consistent for s in consistency.values()]}[/red]"
        )
    return doc
