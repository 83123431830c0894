"""``kvevents demo``: the whole plane in one command, and what KV-aware routing buys.

::

    kvevents demo [--requests N] [--dp-size N] [--enable-dp-attention] [--trace FILE]
                  [--routers N [--no-sync]] [--json FILE] [--out DIR | --no-chart]

1. Starts ``kvevents engine`` (``--dp-size`` ranks, pure DP unless
   ``--enable-dp-attention``, a prefix cache of ``--max-blocks`` pages per rank, KV
   events with replay on OS-chosen loopback ports) and ``kvevents router`` following
   it, each in its own process group (:mod:`kvevents.demo.procs`).
2. Replays the first ``--requests`` requests of the trace (default: the bundled Mooncake
   conversation trace), ``--speedup`` times faster than recorded, at most
   ``--concurrency`` in flight (:mod:`kvevents.demo.replay`): once through the router
   (KV-aware), then, after flushing every cache and checking that the router's index
   emptied with it, straight to the engine, which spreads requests round-robin. With
   ``--routers N`` (N >= 2) the trace is also sent round-robin across N router replicas
   synced over NATS and across N routing alone (:mod:`kvevents.demo.replicas`); then,
   unless ``--no-restart``, once more across the synced replicas while one of them is
   SIGKILLed mid-trace and restarted with ``--peer`` (:mod:`kvevents.demo.restart`).
3. After each replay, waits until the router has received every published batch and
   checks that its index holds as many blocks per rank as the engine's caches.
4. Prints the results (:mod:`kvevents.demo.report`), draws the chart
   (:mod:`kvevents.demo.chart`) and writes ``--json``.

Whatever happens (success, error, Ctrl-C, SIGTERM), the router and the engine are
stopped before the command returns. Exit codes: 0 when every request succeeded,
nothing was lost and the index matched the engine; 1 otherwise; 2 for bad options.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvevents.demo.chart import chart_available
from kvevents.demo.plane import EventCounts, Plane, Settled
from kvevents.demo.procs import Child
from kvevents.demo.replay import Outcome, PolicyRun, Workload, pooled_upper_bound, replay
from kvevents.demo.replicas import NatsChild, replica_groups
from kvevents.demo.report import (
    POLICY_LABELS,
    render_table,
    results_document,
    summarize,
)
from kvevents.demo.restart import RestartStep, restart_figures
from kvevents.demo.signals import Interrupts
from kvevents.errors import ConfigError
from kvevents.results import finite_json, write_results
from kvevents.types import NonNegativeInt, PositiveFloat, PositiveInt, bounded

__all__ = [
    "add_arguments",
    "engine_args",
    "run",
    "run_demo",
    "run_routing_bench",
]

DEFAULTS: dict[str, Any] = {
    "requests": 1000,
    "dp_size": 4,
    "page_size": 16,
    "max_blocks": 65536,
    "speedup": 12.0,
    "concurrency": 32,
    "max_new_tokens": 32,
    # Empty: the router runs with its own defaults, which were chosen on this replay and
    # others (see kvevents.router.decide.scoring), so the demo shows what `kvevents router` does.
    "router_args": "",
}


_TUNABLES: tuple[tuple[str, str, Any, str], ...] = (  # flag, DEFAULTS key, type, help
    ("--requests", "requests", bounded(PositiveInt), "requests replayed per policy"),
    ("--dp-size", "dp_size", bounded(PositiveInt), "engine ranks"),
    ("--block-size", "page_size", bounded(PositiveInt), "tokens per KV block"),
    ("--max-blocks", "max_blocks", bounded(PositiveInt), "cache pages per rank"),
    ("--speedup", "speedup", bounded(PositiveFloat), "trace seconds per second of replay"),
    ("--concurrency", "concurrency", bounded(PositiveInt), "requests in flight at most"),
    (
        "--max-new-tokens",
        "max_new_tokens",
        bounded(NonNegativeInt),
        "cap on each request's output tokens",
    ),
    ("--router-args", "router_args", str, "options passed to `kvevents router`"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--trace", type=Path, default=None, help="Mooncake trace (default: the bundled one)")
    add("--enable-dp-attention", action="store_true", help="engine in SGLang's DP-attention mode")
    for flag, key, kind, text in _TUNABLES:
        metavar = "B" if key == "page_size" else None  # not the dest's old name
        add(flag, dest=key, type=kind, default=DEFAULTS[key], metavar=metavar, help=text)
    # the engine's own alias: SGLang calls a KV block a page
    add(
        "--page-size",
        dest="page_size",
        type=bounded(PositiveInt),
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    add("--out", type=Path, default=Path("demo-out"), help="directory for the chart")
    add("--no-chart", action="store_true", help="do not draw the PNG chart")
    add("--json", type=Path, default=None, metavar="FILE", help="write the results as JSON")
    add(
        "--startup-timeout",
        type=bounded(PositiveFloat),
        default=90.0,
        help="seconds for each process to start",
    )
    add(
        "--routers",
        type=bounded(PositiveInt),
        default=1,
        help="also replay across N router replicas (default 1: no)",
    )
    add("--no-sync", action="store_true", help="with --routers: leave out the NATS-synced group")
    add(
        "--no-restart",
        action="store_true",
        help="with --routers: no replay with a synced replica killed and restarted mid-trace",
    )


def run(args: argparse.Namespace) -> int:
    doc = run_demo(args, Console())
    return 0 if doc["ok"] else 1


def run_routing_bench(
    *, quick: bool = False, requests: int | None = None, console: Console | None = None
) -> dict[str, Any]:
    """The demo as a benchmark: default settings, no chart; ``quick`` replays 300 requests.

    Returns the demo's results document (finite numbers only) with ``"benchmark": "routing"``.
    """
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    count = requests if requests is not None else (300 if quick else DEFAULTS["requests"])
    args = parser.parse_args(["--no-chart", "--requests", str(count)])
    doc = run_demo(args, console if console is not None else Console(stderr=True))
    result: dict[str, Any] = finite_json({"benchmark": "routing", **doc})
    return result


def engine_args(args: argparse.Namespace) -> list[str]:
    """``kvevents engine``'s options for the demo's settings (KV events on loopback, OS ports)."""
    kv_config = {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:0",
        "bind": True,
        "replay_endpoint": "tcp://127.0.0.1:0",
    }
    argv = ["--port", "0", "--dp-size", str(args.dp_size), "--block-size", str(args.page_size)]
    argv += ["--max-blocks", str(args.max_blocks), "--kv-events-config", json.dumps(kv_config)]
    if args.enable_dp_attention:
        argv.append("--enable-dp-attention")
    return argv


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the demo stops the pool itself


def _replay(
    name: str,
    workload: Workload,
    url: str | list[str],
    concurrency: int,
    console: Console,
    interrupts: Interrupts,
    answered: Callable[[], None] | None = None,
) -> PolicyRun:
    columns = (
        TextColumn("{task.description:<20}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("hit rate {task.fields[hit]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(POLICY_LABELS.get(name, name), total=len(workload), hit="-")
        totals = [0, 0]

        def on_done(outcome: Outcome) -> None:
            totals[0] += outcome.prompt_tokens
            totals[1] += outcome.cached_tokens
            if answered is not None:
                answered()
            hit = f"{100 * totals[1] / totals[0]:.1f}%" if totals[0] else "-"
            progress.update(task, advance=1, hit=hit)

        return interrupts.run(replay(name, workload, url, concurrency=concurrency, on_done=on_done))


def _run_plane(
    args: argparse.Namespace,
    workload: Workload,
    engine: Child,
    router: Child,
    console: Console,
    interrupts: Interrupts,
    groups: dict[str, list[Child]],
    nats: NatsChild | None,
    restarts: dict[str, RestartStep],
) -> tuple[dict[str, PolicyRun], dict[str, Settled], EventCounts]:
    """Start engine and router, replay each policy, settle; the caller stops the children.

    ``restarts`` gets the restart step, when there is one (see the module docstring)."""
    mode = "DP attention" if args.enable_dp_attention else "pure DP"
    say = console.print
    say(
        f"starting kvevents engine (dp {args.dp_size}, {mode}, {args.max_blocks:,} pages of "
        f"{args.page_size} tokens per rank) and kvevents router",
        soft_wrap=True,
    )
    engine_url = engine.start(args.startup_timeout)
    say(f"engine ready: {engine_url}", soft_wrap=True)
    router.argv += ["--engine", engine_url]
    router_url = router.start(args.startup_timeout)
    say(f"router ready: {router_url}", soft_wrap=True)
    targets: list[tuple[str, list[str]]] = [("kv_aware", [router_url])]
    for name, children in groups.items():
        sync = (
            ["--sync", nats.start(args.startup_timeout)] if name == "replicas_sync" and nats else []
        )
        for child in children:
            child.argv += ["--engine", engine_url, *sync]
        targets.append((name, [child.start(args.startup_timeout) for child in children]))
        say(f"{len(children)} replicas ready ({name}): {', '.join(targets[-1][1])}")
    if "replicas_sync" in groups and not args.no_restart:
        targets.append(("replicas_restart", list(targets[1][1])))
    targets.append(("round_robin", [engine_url]))
    runs: dict[str, PolicyRun] = {}
    consistency: dict[str, Settled] = {}
    plane = Plane(engine_url, router_url)
    replicas = [Plane(engine_url, url) for _, urls in targets[1:-1] for url in urls]
    try:
        engine.adopt(plane.rank_pids())
        for p in (plane, *replicas):
            p.wait_subscribed(args.dp_size, args.startup_timeout)
        say(
            f"replaying {len(workload):,} requests of {workload.trace_name}, "
            f"{args.speedup:g}x faster than recorded, at most {args.concurrency} in flight",
            soft_wrap=True,
        )
        for name, urls in targets:
            if runs:
                plane.flush(timeout=30.0)
                for p in replicas:
                    p.wait_settled(timeout=30.0)
            generate = [f"{url}/generate" for url in urls]
            step = None
            if name == "replicas_restart":
                step = restarts[name] = RestartStep(
                    engine_url,
                    args.dp_size,
                    groups["replicas_sync"],
                    generate,
                    after=len(workload) // 2,
                    startup_timeout=args.startup_timeout,
                )
                step.start()
            try:
                runs[name] = _replay(
                    name,
                    workload,
                    generate,
                    args.concurrency,
                    console,
                    interrupts,
                    None if step is None else step.answered,
                )
            finally:
                if step is not None:
                    step.join(timeout=step.equal_timeout)
            consistency[name] = plane.wait_settled(timeout=30.0)
            if step is not None and step.new_url is not None:
                say(f"replica {step.old_url} killed and restarted as {step.new_url}")
                for p in replicas:
                    if p.router_url == step.old_url:
                        p.close()
                replicas = [p for p in replicas if p.router_url != step.old_url]
                replicas.append(Plane(engine_url, step.new_url))
                consistency["restarted_replica"] = replicas[-1].wait_settled(timeout=30.0)
                step.exact_check()
        return runs, consistency, plane.event_counts()
    finally:
        for p in (plane, *replicas):
            p.close()


def run_demo(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Run the demo as described in the module docstring; returns the results document.

    ``args`` come from :func:`add_arguments`, whose option types check every bound."""
    started = time.monotonic()
    workload = Workload.load(
        args.trace, args.requests, speedup=args.speedup, max_new_tokens=args.max_new_tokens
    )
    try:
        router_extra = shlex.split(args.router_args)
    except ValueError as exc:
        raise ConfigError(f"--router-args {args.router_args!r}: {exc}") from None
    engine = Child("engine", engine_args(args))
    router = Child("router", ["--port", "0", "--workers", "1", *router_extra])
    groups = replica_groups(args.routers, not args.no_sync, router_extra)
    nats = NatsChild() if "replicas_sync" in groups else None
    restarts: dict[str, RestartStep] = {}
    with Interrupts() as interrupts:  # Ctrl-C and SIGTERM: see kvevents.demo.signals
        pool = multiprocessing.get_context("spawn").Pool(1, initializer=_ignore_sigint)
        try:
            bound = pool.apply_async(
                pooled_upper_bound, (workload, args.page_size, args.max_blocks * args.dp_size)
            )
            runs, consistency, events = _run_plane(
                args, workload, engine, router, console, interrupts, groups, nats, restarts
            )
            upper = bound.get(timeout=600.0)
        finally:
            with interrupts.deferred():  # a second signal must not cut the cleanup short
                for child in [c for children in groups.values() for c in children]:
                    child.stop()
                router.stop()
                engine.stop()
                if nats is not None:
                    nats.stop()
                pool.terminate()
                pool.join()
    processes = {"engine": engine.pid, "router": router.pid, "ranks": list(engine.adopted)}
    policies = {name: summarize(r, args.dp_size) for name, r in runs.items()}
    upper_rate = sum(c for _, c in upper) / max(1, sum(p for p, _ in upper))
    chart = None
    if not args.no_chart and not chart_available():
        print(
            "kvevents demo: no chart: matplotlib is not installed"
            " (pip install 'kvevents[demo]'; --no-chart skips it)",
            file=sys.stderr,
        )
    elif not args.no_chart:
        from kvevents.demo.chart import draw_chart

        chart = draw_chart(
            args.out / "kvevents-demo.png",
            list(runs.values()),
            upper,
            POLICY_LABELS,
            {n: p["prompt_tokens_per_rank"] for n, p in policies.items()},
            f"kvevents demo: {len(workload):,} requests of {workload.trace_name}, dp {args.dp_size}",
        )
    settings = {
        "trace": workload.trace_name,
        "requests": len(workload),
        "dp_size": args.dp_size,
        "enable_dp_attention": args.enable_dp_attention,
        "page_size": args.page_size,
        "max_blocks_per_rank": args.max_blocks,
        "speedup": args.speedup,
        "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens,
        "router_args": router_extra,
        "routers": args.routers,
        "sync": args.routers > 1 and not args.no_sync,
        "restart": bool(restarts),
    }
    failed = sum(p["failed"] for p in policies.values())
    ok = (
        failed == 0
        and events.lost == 0
        and all(s.consistent for s in consistency.values())
        and all(step.error is None for step in restarts.values())
        and all(step.exact is None or all(step.exact.values()) for step in restarts.values())
    )
    doc = results_document(
        settings,
        policies,
        upper_rate,
        events,
        consistency,
        {
            "processes": processes,
            "chart": None if chart is None else str(chart),
            "elapsed_s": time.monotonic() - started,
            "restart": {
                name: restart_figures(step, runs[name], args.page_size)
                for name, step in restarts.items()
                if name in runs
            },
            "ok": ok,
        },
    )
    render_table(doc, console)
    if chart is not None:
        console.print(f"chart: {chart}")
    if args.json is not None:
        write_results(args.json, doc)
        console.print(f"results: {args.json}")
    console.print(f"done in {doc['elapsed_s']:.0f} s; engine and router stopped")
    if not ok:
        console.print(
            f"[red]problems: {failed} failed requests, {events.lost} lost sequence numbers, "
            f"index consistent: {[s.consistent for s in consistency.values()]}[/red]"
        )
    return doc
