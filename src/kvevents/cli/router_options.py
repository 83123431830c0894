"""``kvevents router``'s command line: its options, in the groups ``--help`` shows them.

The basic options come first, in argparse's default group (serving: ``--host``,
``--port``, the tokenizer, ``--log-level``), then the engines (every option after an
``--engine``, ``--prefill`` or ``--decode``: :mod:`kvevents.cli.engine_args`), then one
group per concern: tuning (routing; timeouts and bounds), security, replicas,
disaggregation. Each option says what it does once: a bound's help is the bounds table's
row of docs/deployment.md (tests/test_cli_help.py holds the two equal), and the usage
line names the three ways of giving engines rather than every option.

What the options build, and the checks between them, are :mod:`kvevents.cli.router`'s.
"""

from __future__ import annotations

import argparse
import os

from kvevents.cli.engine_args import add_engine_arguments
from kvevents.cli.options import add_log_level
from kvevents.cli.security import add_router_arguments, add_sync_arguments
from kvevents.http.inline import DEFAULT_LIMITS
from kvevents.http.upstream import DEFAULT_HEAD_TIMEOUT_S, DEFAULT_MAX_HEAD_BYTES
from kvevents.index.predictions import DEFAULT_PREDICTION_TTL_S
from kvevents.index.prefix_index import DEFAULT_MAX_ENTRIES
from kvevents.router.decide.pd import DEFAULT_MAX_LOCAL_PREFILL_TOKENS
from kvevents.router.decide.router import POLICIES
from kvevents.router.decide.scoring import ScoringWeights
from kvevents.router.decide.stalls import STALL_AFTER_S
from kvevents.router.fleet.warm_start import DEFAULT_TOTAL_TIMEOUT_S
from kvevents.router.serve.hot_path import DEFAULT_MAX_BODY_BYTES
from kvevents.router.serve.pd_legs import PROTOCOLS
from kvevents.router.serve.pd_mode import DEFAULT_PREFILL_TIMEOUT_S
from kvevents.types import (
    NonNegativeFloat,
    NonNegativeInt,
    Port,
    PositiveFiniteFloat,
    PositiveFloat,
    PositiveInt,
    bounded,
)

__all__ = ["add_arguments", "default_workers"]


_USAGE = """\
%(prog)s --engine URL [ENGINE OPTIONS] [--engine URL ...] [OPTIONS]
       %(prog)s --engines-file FILE [OPTIONS]
       %(prog)s --prefill URL [BOOTSTRAP_PORT] [ENGINE OPTIONS] ...
                       --decode URL [ENGINE OPTIONS] ... [OPTIONS]"""
"""``kvevents router``'s usage: its three ways of naming engines, not its 60 options."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options, in the groups ``--help`` shows: the basic ones first (serving, then
    the engines), then tuning, bounds, security, replicas and disaggregation."""
    parser.usage = _USAGE
    parser.add_argument("--host", default="127.0.0.1", help="the address to serve on")
    parser.add_argument(
        "--port",
        type=bounded(Port),
        default=8100,
        help="the port to serve on (0: the OS picks one, which the ready line tells)",
    )
    text = parser.add_mutually_exclusive_group()
    text.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenize text prompts as the engine does, with this model folder's "
        "tokenizer.json (or that file); needs the 'tokenizers' package (default: the "
        "simulated engine's byte tokenizer)",
    )
    text.add_argument(
        "--tokenize-endpoint",
        metavar="URL",
        help="tokenize text prompts and render chats by posting them to this URL, e.g. "
        "http://ENGINE:8000/tokenize (vLLM's /tokenize does both)",
    )
    add_log_level(parser)
    parser.add_argument(  # hidden: any other server is refused, saying uvicorn serves all
        "--http-server", default="uvicorn", metavar="NAME", help=argparse.SUPPRESS
    )
    # the groups in the order --help shows them
    engines = parser.add_argument_group(
        "engines",
        "Repeatable: the options after an --engine, --prefill or --decode describe that one.",
    )
    routing = parser.add_argument_group(
        "tuning: routing", "The cost a rank is chosen by, and its inputs (docs/routing.md)."
    )
    bounds = parser.add_argument_group(
        "tuning: timeouts and bounds",
        "What one request, client, engine answer or the index may cost "
        "(docs/deployment.md#bounds).",
    )
    security = parser.add_argument_group(
        "security", "Keys, TLS and CURVE; what each option closes: docs/security.md."
    )
    replicas = parser.add_argument_group(
        "replicas",
        "Several routers over the same engines: processes on this machine (--workers), an "
        "index to start from (--peer), in-flight load shared across machines (--sync).",
    )
    pd = parser.add_argument_group(
        "disaggregation",
        "Prefill/decode serving, with --prefill and --decode engines (docs/deployment.md).",
    )
    add_router_arguments(security)
    add_engine_arguments(
        parser, global_block_size=True, pools=True, group=engines, security=security
    )
    _add_routing(routing)
    _add_bounds(bounds)
    _add_replicas(replicas)
    add_sync_arguments(replicas)
    pd.add_argument(
        "--pd-protocol",
        choices=PROTOCOLS,
        default=None,
        help="the KV hand-off between a prefill and a decode instance: sglang (both legs at "
        "once, joined by a bootstrap_room) or vllm (prefill first, its kv_transfer_params to "
        "the decode); default: the engines' kind (vllm for vllm engines, else sglang)",
    )
    pd.add_argument(
        "--max-local-prefill-tokens",
        type=bounded(NonNegativeInt),
        default=DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
        metavar="N",
        help="a decode instance that lacks at most N of the prompt's tokens prefills them "
        "itself, with no prefill hop (0: always a prefill hop)",
    )
    pd.add_argument(
        "--prefill-timeout",
        type=bounded(PositiveFloat),
        default=DEFAULT_PREFILL_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds a disaggregated request's prefill leg may take; past it: 504, the "
        "decode leg cancelled",
    )


def _add_routing(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--policy",
        choices=POLICIES,
        default="kv-aware",
        help="how a rank is chosen: kv-aware (the cost below) or round-robin (for comparisons)",
    )
    weights = ScoringWeights()  # the defaults, chosen by measurement (see scoring's docstring)
    group.add_argument(
        "--load-weight",
        type=bounded(NonNegativeFloat),
        default=weights.load_weight,
        metavar="WEIGHT",
        help="blocks of prefill one block of pending (in-flight) work is worth",
    )
    group.add_argument(
        "--foreign-request-blocks",
        type=bounded(NonNegativeFloat),
        default=weights.foreign_request_blocks,
        metavar="BLOCKS",
        help="pending blocks assumed per engine request this router did not send",
    )
    group.add_argument(
        "--balance-weight",
        type=bounded(NonNegativeFloat),
        default=weights.balance_weight,
        metavar="WEIGHT",
        help="blocks of prefill one block of a rank's excess recent work is worth; 0 turns "
        "the balance off",
    )
    group.add_argument(
        "--balance-half-life",
        type=bounded(PositiveFiniteFloat),
        default=weights.balance_half_life,
        metavar="REQUESTS",
        help="requests routed after which a request's share of a rank's recent work halves",
    )
    group.add_argument(
        "--credits",
        default="1.0,0.75,0.25",
        metavar="GPU,CPU,DISK",
        help="the worth of a cached block in each tier",
    )
    group.add_argument(
        "--prediction-ttl",
        type=float,
        default=DEFAULT_PREDICTION_TTL_S,
        metavar="SECONDS",
        help="seconds a request's blocks count as predicted on the rank it was sent to, "
        "until the engine reports them; 0 turns predictions off",
    )
    group.add_argument(
        "--predicted-credit",
        type=float,
        default=weights.predicted_credit,
        metavar="CREDIT",
        help="the worth of a predicted block, as a tier's credit: 0..1",
    )
    group.add_argument(
        "--load-interval",
        type=bounded(PositiveFloat),
        default=0.5,
        metavar="SECONDS",
        help="seconds between two load polls of an engine (/load; /health and a vLLM's /metrics)",
    )
    group.add_argument(
        "--stall-after",
        type=bounded(NonNegativeFloat),
        default=STALL_AFTER_S,
        metavar="SECONDS",
        help="a rank with requests of this router in flight, none answered for this long "
        "(less when requests are fast: 4 times their typical duration, at least 0.1 s), is "
        "stalled: no new request goes there while another rank can take it, until one is "
        "answered; so is every rank of an engine whose load poll has no answer for 1 s "
        "more. 0 turns this off",
    )


def _add_bounds(group: argparse._ActionsContainer) -> None:
    """Each bound described as docs/deployment.md's bounds table describes it, then what
    happens past it (tests/test_cli_help.py holds the two equal)."""
    group.add_argument(
        "--max-body-bytes",
        type=bounded(PositiveInt),
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help="the largest body of any POST, refused from Content-Length before a byte is "
        "read, else counted as it arrives; past it: 413 naming the flag",
    )
    group.add_argument(
        "--request-timeout",
        type=bounded(PositiveFloat),
        default=DEFAULT_LIMITS.request_timeout,
        metavar="SECONDS",
        help="seconds a client's request head and body may take, from its first byte; "
        "past it: 408, connection closed",
    )
    group.add_argument(
        "--max-idle-connections",
        type=bounded(PositiveInt),
        default=DEFAULT_LIMITS.max_idle_connections,
        metavar="N",
        help="idle client connections per process (one that has sent nothing yet is idle, "
        "closed at the keep-alive timeout); past it: the oldest idle one is closed",
    )
    group.add_argument(
        "--forward-timeout",
        type=bounded(PositiveFloat),
        default=600.0,
        metavar="SECONDS",
        help="seconds a forwarded request may take in all, a stream included; past it: 504 "
        "naming the timeout (a stream under way ends)",
    )
    group.add_argument(
        "--engine-head-timeout",
        type=bounded(PositiveFloat),
        default=DEFAULT_HEAD_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds an engine answer's head may take, from its first byte to its end; past "
        "it: 504, connection closed",
    )
    group.add_argument(
        "--engine-max-head-bytes",
        type=bounded(PositiveInt),
        default=DEFAULT_MAX_HEAD_BYTES,
        metavar="BYTES",
        help="the largest engine answer head read; past it: 502, connection closed",
    )
    group.add_argument(
        "--max-entries",
        type=bounded(PositiveInt),
        default=DEFAULT_MAX_ENTRIES,
        metavar="N",
        help="the index's memory, in (block, holder, tier) entries; past it: least recently "
        "used blocks pruned",
    )


def _add_replicas(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--workers",
        type=bounded(PositiveInt),
        default=None,
        metavar="N",
        help="router processes serving the port (SO_REUSEPORT), each following every engine "
        "and sharing its in-flight requests with the others (default: one per usable core, "
        f"here {default_workers()})",
    )
    group.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="URL",
        help="a running router replica (repeatable, tried in order): start from its index "
        "(GET /dump) and follow every stream from where it stood, replaying only the "
        "difference; none reachable: start empty",
    )
    group.add_argument(
        "--peer-max-bytes",
        type=bounded(PositiveInt),
        default=None,
        metavar="BYTES",
        help="the largest --peer snapshot read, claimed or received; a larger one is skipped "
        "(default: what --max-entries entries take)",
    )
    group.add_argument(
        "--peer-timeout",
        type=bounded(PositiveFiniteFloat),
        default=DEFAULT_TOTAL_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds a --peer snapshot's whole download may take; a slower peer is skipped",
    )
    group.add_argument(
        "--sync",
        metavar="NATS_URL",
        help="share in-flight load with router replicas on other machines over NATS, e.g. "
        "nats://10.0.0.9:4222 (needs 'kvevents[sync]'); NATS down: each replica goes on alone",
    )
    group.add_argument(
        "--sync-subject",
        metavar="SUBJECT",
        help="the NATS subject of this router group: each replica publishes on SUBJECT.NAME "
        "and hears SUBJECT.* (default: derived from the engines followed, so replicas of the "
        "same engines meet)",
    )
    group.add_argument(
        "--sync-name",
        metavar="NAME",
        help="this replica's name in the group, the last token of the subject it publishes "
        "on: unique, of letters, digits, _ and -, and reservable to its credentials by NATS "
        "permissions (default: host name, port and boot id)",
    )


def default_workers(cores: int | None = None) -> int:
    """The router processes ``--workers`` starts when not told: one per core (``cores``;
    when None, the cores this process may run on, as ``taskset`` or a container's
    cpuset leave them)."""
    count = _usable_cores() if cores is None else cores
    return max(1, count)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
