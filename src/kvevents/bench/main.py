"""``kvevents bench``: every benchmark from one entry point, results in one JSON file.

::

    kvevents bench [publisher|subscriber|index|engine|routing|router|instructions|
                    ingest|burst|warm_start|all]
                   [--json OUT] [--quick]
    kvevents bench router --completions-only [--rounds N]  # the relay's added latency
    kvevents bench router --pd-only [--rounds N] [--pd-protocol sglang|vllm] [--pin-router]
                                    [--pd-max-tokens N] [--[no-]pd-together]
                                                # what the router adds to a P/D request
    kvevents bench --markdown [--json FILE]     # docs/performance.md's table, from a results file

Each benchmark is the library function its own script under ``benchmarks/`` calls
(``run_publisher_bench``, ``run_subscriber_bench``, ``run_index_bench``,
``run_engine_bench``, ``run_instructions_bench`` (the router's work per request in
instructions, under callgrind), ``run_burst_bench`` (sibling bursts, predictions off and on),
``run_warm_start_bench`` (a replica restarted from a peer at 250,000+ blocks), and
for routing the demo itself, :func:`kvevents.demo.main.run_routing_bench`),
with the settings the script uses by default, or much smaller ones with ``--quick``
(a smoke run of a few seconds each; its figures are not comparable to the targets).

The JSON document: ``{"command", "quick", "date", "machine", "results": {name: the
benchmark's own JSON}, "errors": {name: message}}``; then a rich table of the headline
figures (:mod:`kvevents.bench.report`). A benchmark that fails is recorded in
``errors`` and the others still run; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from kvevents.bench.pd_router import TYPICAL_ANSWER_TOKENS
from kvevents.bench.report import render_markdown, render_table
from kvevents.errors import ConfigError, KVEventsError
from kvevents.results import write_results
from kvevents.router.serve.pd_legs import PROTOCOLS, PDProtocol

__all__ = ["BENCHMARKS", "add_arguments", "run", "run_benchmarks"]

DEFAULT_JSON = Path("benchmarks") / "results" / "bench.json"


def _publisher(quick: bool) -> dict[str, Any]:
    from kvevents.bench.publisher import run_publisher_bench

    if quick:
        return run_publisher_bench(messages=20_000, block_counts=(32,), repeats=1)
    return run_publisher_bench()


def _subscriber(quick: bool) -> dict[str, Any]:
    from kvevents.bench.subscriber import run_subscriber_bench

    if quick:
        return run_subscriber_bench(
            stream_counts=(1,), block_counts=(32,), modes=("backlog",), blocks_target=200_000
        )
    return run_subscriber_bench()


def _index(quick: bool) -> dict[str, Any]:
    from kvevents.bench.index import run_index_bench

    if quick:
        return run_index_bench(holders=(8,), limit=1000, memory=False)
    return run_index_bench()


def _engine(quick: bool) -> dict[str, Any]:
    from kvevents.bench.engine import run_engine_bench

    if quick:
        return run_engine_bench(requests=200, dp_size=2)
    return run_engine_bench()


def _routing(quick: bool) -> dict[str, Any]:
    from kvevents.demo.main import run_routing_bench

    return run_routing_bench(quick=quick, console=Console(stderr=True))


def _router(quick: bool) -> dict[str, Any]:
    from kvevents.bench.router import run_router_bench

    if quick:
        return run_router_bench(
            prompts=32,
            long_prompts=8,
            duration=2.0,
            workers=(1,),
            completions=False,
            sync_rounds=1,
            pd=False,
        )
    return run_router_bench()


def _router_completions(quick: bool, rounds: int) -> dict[str, Any]:
    """Only the router's ``/v1/completions`` comparison, ``rounds`` alternating rounds."""
    from kvevents.bench.router import run_router_bench

    if quick:
        return run_router_bench(prompts=32, duration=2.0, completions_only=True)
    return run_router_bench(completions_only=True, completions_rounds=rounds)


def _router_pd(
    quick: bool, rounds: int, protocol: PDProtocol, pin: bool, max_tokens: int, together: bool
) -> dict[str, Any]:
    """Only the router's disaggregated (P/D) comparison, ``rounds`` alternating rounds,
    with ``protocol``'s legs, the router on CPUs of its own when ``pin``, each request
    decoding ``max_tokens``, the two clients at once when ``together``."""
    from kvevents.bench.router import run_router_bench

    options: dict[str, Any] = {
        "pd_only": True,
        "pd_protocol": protocol,
        "pin_router": pin,
        "pd_max_tokens": max_tokens,
        "pd_together": together,
    }
    if quick:
        return run_router_bench(prompts=16, duration=2.0, pd_rounds=1, **options)
    return run_router_bench(pd_rounds=rounds, **options)


def _instructions(quick: bool) -> dict[str, Any]:
    from kvevents.bench.instructions import run_instructions_bench

    if quick:
        return run_instructions_bench(requests=50, cases=("bare", "route"))
    return run_instructions_bench()


def _ingest(quick: bool) -> dict[str, Any]:
    from kvevents.bench.ingest import run_ingest_bench

    if quick:
        return run_ingest_bench(engine_counts=(2,), seconds=2.0, workers=(1,))
    return run_ingest_bench()


def _burst(quick: bool) -> dict[str, Any]:
    from kvevents.bench.burst import run_burst_bench

    if quick:
        return run_burst_bench(groups=4, siblings=4, prefix_tokens=512)
    return run_burst_bench()


def _warm_start(quick: bool) -> dict[str, Any]:
    from kvevents.bench.warm_start import run_warm_start_bench

    if quick:
        return run_warm_start_bench(prompts=100, repeat=1, restarts=1)
    return run_warm_start_bench()


BENCHMARKS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "publisher": _publisher,
    "subscriber": _subscriber,
    "index": _index,
    "engine": _engine,
    "routing": _routing,
    "router": _router,
    "instructions": _instructions,
    "ingest": _ingest,
    "burst": _burst,
    "warm_start": _warm_start,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "which",
        nargs="?",
        default="all",
        choices=[*BENCHMARKS, "all"],
        help="the benchmark to run (default: all)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="OUT",
        help=f"results file (default {DEFAULT_JSON}); with --markdown, the file to read",
    )
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke run")
    parser.add_argument(
        "--completions-only",
        action="store_true",
        help="with router: only /v1/completions, engine direct against through the router",
    )
    parser.add_argument(
        "--pd-only",
        action="store_true",
        help="with router: only disaggregated serving, both legs sent directly against "
        "through the router (no wrk needed)",
    )
    parser.add_argument(
        "--pd-protocol",
        choices=PROTOCOLS,
        default=None,
        help="with --pd-only: the hand-off the legs use, sglang (both at once) or vllm "
        "(prefill, then decode; the router run with --pd-protocol vllm) (default sglang)",
    )
    parser.add_argument(
        "--pin-router",
        action="store_true",
        help="with --pd-only: run the router on a CPU of its own and the client and the "
        "engines on the others, in both paths alike (Linux), as a deployment gives a "
        "router its own cores; without it all of them share every CPU",
    )
    parser.add_argument(
        "--pd-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="with --pd-only: tokens each request decodes, each prompt within N/8 of N "
        f"(default {TYPICAL_ANSWER_TOKENS}, the conversation trace's median answer, which "
        "leaves the CPUs idle enough that the added p50 is the relay's own; 1: the "
        "shortest requests, which saturate the CPUs and measure the router's CPU per request)",
    )
    parser.add_argument(
        "--pd-together",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --pd-only: run each round's two clients at once, each in a process of "
        "its own with its requests in flight, so the engines' drift between runs falls on "
        "both alike (the default), or one after the other (--no-pd-together)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        metavar="N",
        help="with --completions-only or --pd-only: alternating rounds of the comparison "
        "(default 5)",
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the performance table (docs/performance.md) from the results file; run nothing",
    )


def _machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "system": platform.system(),
    }


def run_benchmarks(
    names: list[str],
    *,
    quick: bool,
    command: str,
    console: Console,
    runners: dict[str, Callable[[bool], dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Run the named benchmarks in order; returns the JSON document (see the module docstring).

    ``runners``: functions to run instead of :data:`BENCHMARKS`' for some names."""
    chosen = {**BENCHMARKS, **(runners or {})}
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name in names:
        console.print(f"[bold]bench {name}[/bold]{' (quick)' if quick else ''} ...")
        t0 = time.monotonic()
        try:
            results[name] = chosen[name](quick)
        except (KVEventsError, RuntimeError, OSError, ValueError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            console.print(f"[red]bench {name} failed: {errors[name]}[/red]")
            continue
        console.print(f"bench {name}: {time.monotonic() - t0:.0f} s")
    return {
        "command": command,
        "quick": quick,
        "date": datetime.date.today().isoformat(),
        "machine": _machine(),
        "results": results,
        "errors": errors,
    }


def run(args: argparse.Namespace) -> int:
    path: Path = args.json if args.json is not None else DEFAULT_JSON
    console = Console()
    if args.markdown:
        try:
            doc = json.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(
                f"--json {path}: cannot read it ({exc.strerror}); run `kvevents bench all` first"
            ) from None
        except ValueError as exc:
            raise ConfigError(f"--json {path}: not a bench results file ({exc})") from None
        print(render_markdown(doc), end="")
        return 0
    names = list(BENCHMARKS) if args.which == "all" else [args.which]
    command = f"kvevents bench {args.which}" + (" --quick" if args.quick else "")
    runners: dict[str, Callable[[bool], dict[str, Any]]] = {}
    if args.completions_only and args.pd_only:
        raise ConfigError(
            "--completions-only and --pd-only each run one comparison alone: give one of them"
        )
    for given, flag in (
        (args.pd_protocol is not None, "--pd-protocol"),
        (args.pin_router, "--pin-router"),
        (args.pd_max_tokens is not None, "--pd-max-tokens"),
        (args.pd_together is not None, "--pd-together"),
    ):
        if given and not args.pd_only:
            raise ConfigError(
                f"{flag} is an option of `kvevents bench router --pd-only`: add --pd-only"
            )
    for only, flag in ((args.completions_only, "--completions-only"), (args.pd_only, "--pd-only")):
        if not only:
            continue
        if args.which != "router":
            raise ConfigError(
                f"{flag} is an option of `kvevents bench router`, not of "
                f"{args.which!r}: run `kvevents bench router {flag}`"
            )
        if args.rounds < 1:
            raise ConfigError(f"--rounds {args.rounds}: give at least 1")
        command += f" {flag} --rounds {args.rounds}"
        if args.pd_only:
            protocol: PDProtocol = "sglang" if args.pd_protocol is None else args.pd_protocol
            max_tokens = TYPICAL_ANSWER_TOKENS if args.pd_max_tokens is None else args.pd_max_tokens
            together = args.pd_together is not False
            if max_tokens < 1:
                raise ConfigError(f"--pd-max-tokens {max_tokens}: give at least 1")
            runners["router"] = functools.partial(
                _router_pd,
                rounds=args.rounds,
                protocol=protocol,
                pin=args.pin_router,
                max_tokens=max_tokens,
                together=together,
            )
            command += f" --pd-protocol {protocol}" + (" --pin-router" if args.pin_router else "")
            command += f" --pd-max-tokens {max_tokens}"
            command += " --pd-together" if together else " --no-pd-together"
        else:
            runners["router"] = functools.partial(_router_completions, rounds=args.rounds)
    if args.json is not None:
        command += f" --json {args.json}"
    doc = run_benchmarks(names, quick=args.quick, command=command, console=console, runners=runners)
    write_results(path, doc)
    render_table(doc, console)
    console.print(f"results: {path}")
    return 1 if doc["errors"] else 0
