"""``kvevents engine``'s command line: its options, in the groups ``--help`` shows them.

The basic options come first, in argparse's default group (the topology, serving,
publishing, the models served, ``--log-level``), then one group per concern: the
simulation, timeouts and bounds, security, disaggregation. A bound's help is the bounds
table's row of docs/deployment.md (tests/test_cli_help.py holds the two equal).

What the options build (:class:`~kvevents.cli.engine.EngineSettings`, which checks them
together) and the serving loop are :mod:`kvevents.cli.engine`'s.
"""

from __future__ import annotations

import argparse

from kvevents.cli.options import add_log_level
from kvevents.cli.security import add_engine_server_arguments
from kvevents.engine.disaggregation import DisaggregationMode
from kvevents.engine.models import DEFAULT_MODEL_NAME
from kvevents.http.auth import OPEN_PATHS
from kvevents.types import NonNegativeFloat, Port, PositiveFloat, PositiveInt, bounded
from kvevents.wire.hashing import HASH_SCHEMES

__all__ = ["add_arguments"]


_USAGE = "%(prog)s [--dp-size N] [--host HOST] [--port PORT] [OPTIONS]"
"""``kvevents engine``'s usage: every option is optional, its 35 listed by ``--help``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options, in the groups ``--help`` shows: the basic ones first (the topology,
    serving, publishing, models), then the simulation, bounds, security, disaggregation."""
    parser.usage = _USAGE
    add = parser.add_argument
    # the topology's sizes are checked together by plan_topology, which explains the mix
    add(
        "--dp-size",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel ranks: one KV cache, process and event stream each",
    )
    add("--enable-dp-attention", action="store_true", help="SGLang's DP-attention mode")
    add(
        "--tp-size",
        type=int,
        default=None,
        metavar="N",
        help="tensor-parallel size, as SGLang's (default: 1, with DP attention --dp-size)",
    )
    add(
        "--block-size",
        "--page-size",
        dest="page_size",
        type=bounded(PositiveInt),
        default=16,
        metavar="B",
        help="tokens per KV block (--page-size: SGLang's name for it)",
    )
    add("--host", default="127.0.0.1", help="the address to serve HTTP on")
    add(
        "--port",
        type=bounded(Port),
        default=30000,
        help="the HTTP port (0: the OS picks one, which the ready line tells)",
    )
    add(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="SGLang's KV-events config (default: publish with replay on ports the OS picks, "
        'advertised in /server_info; \'{"publisher": "null"}\' turns publishing off)',
    )
    add(
        "--kv-events-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address publishers bind in place of a wildcard (tcp://*:PORT) in "
        "--kv-events-config; '*' binds every interface as SGLang and vLLM do",
    )
    add(
        "--served-model-name",
        action="append",
        metavar="NAME[,NAME]",
        help="model name(s) requests give as 'model' (repeatable or a comma list, as vLLM's; "
        f"default {DEFAULT_MODEL_NAME}); the first is reported in answers",
    )
    add(
        "--lora-modules",
        nargs="+",
        action="extend",
        metavar="NAME=PATH",
        help="LoRA adapters served on top of the model, as vLLM's flag (the path may be a "
        "dummy); a request naming one as 'model' keeps its own prefix-cache namespace",
    )
    add_log_level(parser)
    simulation = parser.add_argument_group(
        "simulation", "What the simulated ranks hold and how fast they run."
    )
    bounds = parser.add_argument_group(
        "tuning: timeouts and bounds",
        "What one request or rank may cost (docs/deployment.md#bounds).",
    )
    security = parser.add_argument_group(
        "security", "A key and TLS; what each option closes: docs/security.md."
    )
    pd = parser.add_argument_group(
        "disaggregation", "One half of a prefill/decode pair (docs/deployment.md)."
    )
    _add_simulation(simulation)
    _add_bounds(bounds)
    *first, last = sorted(OPEN_PATHS)
    add_engine_server_arguments(security, f"{', '.join(first)} and {last}")
    pd.add_argument(
        "--disaggregation-mode",
        choices=[str(m) for m in DisaggregationMode],
        default="null",
        help="SGLang's flag: prefill (serve prefill legs, the KV handed over by the "
        "bootstrap server) or decode (take the KV, then decode); null: neither",
    )
    pd.add_argument(
        "--disaggregation-bootstrap-port",
        type=bounded(Port),
        default=8998,
        metavar="PORT",
        help="a prefill's bootstrap server port, on --host (0: the OS picks one, which "
        "/server_info tells as disaggregation_bootstrap_port)",
    )
    pd.add_argument(
        "--transfer-us-per-block",
        type=bounded(NonNegativeFloat),
        default=10.0,
        metavar="US",
        help="simulated microseconds a decode spends receiving one KV block",
    )
    pd.add_argument(
        "--disaggregation-timeout",
        type=bounded(PositiveFloat),
        default=30.0,
        metavar="SECONDS",
        help="seconds a decode waits for its room; a prefill drops a registration nobody "
        "took after as long",
    )


def _add_simulation(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--max-blocks",
        type=bounded(PositiveInt),
        default=8192,
        metavar="N",
        help="KV blocks per rank",
    )
    group.add_argument(
        "--sliding-window",
        type=bounded(PositiveInt),
        default=None,
        metavar="TOKENS",
        help="simulate a hybrid model: a sliding-window KV-cache group (group 0, this "
        "window) beside the full-attention one (group 1), with vLLM's events",
    )
    group.add_argument(
        "--hash-scheme",
        choices=HASH_SCHEMES,
        default="sglang",
        help="whose block hashes the events carry",
    )
    group.add_argument(
        "--hash-seed", default="0", metavar="SEED", help="the vllm scheme's PYTHONHASHSEED"
    )
    group.add_argument(
        "--prefill-tokens-per-s",
        type=bounded(PositiveFloat),
        default=1_000_000.0,
        metavar="N",
        help="simulated prefill speed, tokens per second (inf: no delay)",
    )
    group.add_argument(
        "--decode-steps-per-s",
        type=bounded(PositiveFloat),
        default=1_000.0,
        metavar="N",
        help="simulated decode speed, steps per second (inf: no delay)",
    )
    group.add_argument(
        "--max-running",
        type=bounded(PositiveInt),
        default=64,
        metavar="N",
        help="requests a rank runs at once",
    )


def _add_bounds(group: argparse._ActionsContainer) -> None:
    """Each bound described as docs/deployment.md's bounds table describes it, then what
    happens past it (tests/test_cli_help.py holds the two equal)."""
    group.add_argument(
        "--request-timeout",
        type=bounded(PositiveFloat),
        default=60.0,
        metavar="SECONDS",
        help="seconds a request may wait for its rank; past it: 504 naming the rank",
    )
    group.add_argument(
        "--max-new-tokens-limit",
        type=bounded(PositiveInt),
        default=32_768,
        metavar="N",
        help="the largest max_new_tokens / max_tokens a request may ask for; past it: 400 "
        "naming the limit",
    )
    group.add_argument(
        "--max-body-bytes",
        type=bounded(PositiveInt),
        default=8 << 20,
        metavar="BYTES",
        help="the largest request body, refused from Content-Length before it is read, else "
        "counted as it arrives; past it: 413",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=bounded(NonNegativeFloat),
        default=10.0,
        metavar="SECONDS",
        help="seconds SIGTERM waits for requests in flight; past it: they are cancelled, the "
        "engine exits",
    )
    group.add_argument(
        "--startup-timeout",
        type=bounded(NonNegativeFloat),
        default=30.0,
        metavar="SECONDS",
        help="seconds the ranks may take to start; past it: the engine exits 1",
    )
    group.add_argument(
        "--dead-rank-grace",
        type=bounded(NonNegativeFloat),
        default=1.0,
        metavar="SECONDS",
        help="seconds /health shows a rank that died (503); past it: the engine exits 1",
    )
