"""Command-line options naming engines and streams, shared by ``kvevents router`` and ``watch``.

::

    --engine URL [--kv-endpoint ADDR [--replay-endpoint ADDR] [--dp-size N] [--topic T]]
                 [--block-size B] [--engine-kind vllm|sglang|kvevents] [--name NAME]
                 [--model NAME[,NAME]]
    --engines-file FILE            (JSON, or TOML on Python 3.11+; see kvevents.subscribe.engine_spec)
    --endpoint ADDR [--replay-endpoint ADDR] [--topic T] [--name NAME] [--dp-rank R]
                                   (watch only: one explicit stream)
    --curve-server-key=KEY         after an --engine/--endpoint: its publishers' CURVE
                                   public key; before any: the default for every stream
                                   that has none (an engine's advertised key wins)
    --curve-secret-key-file FILE   this subscriber's CURVE key pair (kvevents keygen)
    --prefill URL [BOOTSTRAP_PORT], --decode URL
                                   (router only: disaggregated serving's two pools;
                                   each takes the options an --engine takes)

Each ``--engine`` (or ``--endpoint``) opens an entry; the options after it, up to the
next opener, amend that entry, so any number of engines can be given. An amending
option given before any opener is an error naming the opener it needs, except where a
command gives it a meaning of its own (the router's ``--block-size`` before any
``--engine`` is its global block size; ``--curve-server-key`` before any opener is the
default server key). Entries are parsed into
:class:`~kvevents.subscribe.engine_spec.EngineSpec` / :class:`~kvevents.subscribe.discovery.StreamSpec` by
:func:`engine_specs` and :func:`endpoint_specs`, which raise
:class:`~kvevents.errors.ConfigError` naming the engine and the option.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, Literal

from kvevents.errors import ConfigError
from kvevents.subscribe.discovery import StreamSpec
from kvevents.subscribe.engine_spec import ENGINE_KINDS, EngineSpec, load_engines_file
from kvevents.transport.curve_keys import CurveKeyPair, parse_public_key
from kvevents.types import NonNegativeInt, PositiveInt, bounded

__all__ = ["add_engine_arguments", "curve_options", "endpoint_specs", "engine_specs", "pool_specs"]

PoolName = Literal["prefill", "decode"]
"""Disaggregated serving's pools (``--prefill``, ``--decode``)."""
_OPENERS = ("engine", "endpoint", "prefill", "decode")
_ENGINES = ("engine", "prefill", "decode")
"""Openers of an engine: one-pool, or a pool of disaggregated serving."""
# option dest -> the openers it may amend
_AMENDS: dict[str, tuple[str, ...]] = {
    "kv_endpoint": _ENGINES,
    "replay_endpoint": (*_ENGINES, "endpoint"),
    "dp_size": _ENGINES,
    "topic": (*_ENGINES, "endpoint"),
    "block_size": (*_ENGINES, "endpoint"),
    "kind": _ENGINES,
    "name": (*_ENGINES, "endpoint"),
    "model": _ENGINES,
    "dp_rank": ("endpoint",),
    "curve_server_key": (*_ENGINES, "endpoint"),
}


class _EntryAction(argparse.Action):
    """``--engine``/``--endpoint`` open an entry in ``namespace.entries``; the others amend it."""

    global_dests: tuple[
        str, ...
    ] = ()  # set per parser: amenders that, before any opener, are global

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        entries: list[dict[str, Any]] = list(getattr(namespace, "entries", None) or [])
        if self.dest in _OPENERS:
            entry = {"opener": self.dest, self.dest: values, "flag": option_string}
            if self.dest == "prefill":  # URL [BOOTSTRAP_PORT], as SGLang's router takes it
                entry["prefill"], entry["bootstrap_port"] = _prefill_values(parser, values)
            entries.append(entry)
            namespace.entries = entries
            return
        if not entries:
            if self.dest in self.global_dests:
                setattr(namespace, f"global_{self.dest}", values)
                return
            openers = " or ".join(f"--{o}" for o in _AMENDS[self.dest] if o in self.openers)
            parser.error(f"{option_string} belongs to an {openers}: give {openers} first")
        last = entries[-1]
        opener = last["opener"]
        if opener not in _AMENDS[self.dest]:
            openers = " or ".join(f"--{o}" for o in _AMENDS[self.dest] if o in self.openers)
            parser.error(
                f"{option_string} does not apply to {last['flag']} {last[opener]}; it belongs "
                f"to an {openers}"
            )
        if self.dest in last:
            parser.error(f"{option_string} given twice for {last['flag']} {last[opener]}")
        last[self.dest] = values
        namespace.entries = entries

    openers: tuple[str, ...] = _OPENERS


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    *,
    endpoints: bool = False,
    global_block_size: bool = False,
    pools: bool = False,
    group: argparse._ActionsContainer | None = None,
    security: argparse._ActionsContainer | None = None,
) -> None:
    """Add the options of the module docstring; ``endpoints`` adds ``--endpoint`` streams,
    ``pools`` the ``--prefill`` and ``--decode`` engines of disaggregated serving.

    ``global_block_size``: ``--block-size`` before any ``--engine`` sets ``global_block_size``.
    ``group``: the help group the options are listed in (default: a new "engines" one);
    ``security``: the one the CURVE options are listed in (default: ``group``).
    """

    class Action(_EntryAction):
        global_dests = ("curve_server_key",) + (("block_size",) if global_block_size else ())
        openers = (
            ("engine",)
            + (("endpoint",) if endpoints else ())
            + (("prefill", "decode") if pools else ())
        )

    if group is None:
        opener = "--engine or --endpoint" if endpoints else "--engine"
        group = parser.add_argument_group(
            "engines", f"Repeatable: the options after an {opener} describe that one."
        )
    group.add_argument(
        "--engine",
        action=Action,
        metavar="URL",
        help="an engine's HTTP URL; alone, its streams are read from its /server_info "
        "(a vLLM's from /kv_event_sources)",
    )
    group.add_argument(
        "--engines-file",
        dest="engines_file",
        metavar="FILE",
        help="engines listed in a JSON or TOML file (its format: kvevents.subscribe.engine_spec)",
    )
    if pools:
        group.add_argument(
            "--prefill",
            action=Action,
            nargs="+",
            metavar=("URL", "BOOTSTRAP_PORT"),
            help="a prefill engine of disaggregated serving; BOOTSTRAP_PORT: its KV hand-off "
            "port (default: its /server_info's disaggregation_bootstrap_port, else SGLang's 8998)",
        )
        group.add_argument(
            "--decode",
            action=Action,
            metavar="URL",
            help="a decode engine of disaggregated serving (needs a --prefill too)",
        )
    if endpoints:
        group.add_argument(
            "--endpoint",
            action=Action,
            metavar="ADDR",
            help="one explicit stream, e.g. tcp://HOST:5557",
        )
        group.add_argument(
            "--dp-rank",
            dest="dp_rank",
            action=Action,
            type=bounded(NonNegativeInt),
            metavar="R",
            help="the rank of the --endpoint before it (default 0)",
        )
    group.add_argument(
        "--kv-endpoint",
        dest="kv_endpoint",
        action=Action,
        metavar="ADDR",
        help="rank 0's event endpoint, e.g. tcp://HOST:5557 (rank r: port + r), for an "
        "engine that advertises none",
    )
    group.add_argument(
        "--replay-endpoint",
        dest="replay_endpoint",
        action=Action,
        metavar="ADDR",
        help="rank 0's replay endpoint (rank r: port + r)",
    )
    group.add_argument(
        "--dp-size",
        dest="dp_size",
        action=Action,
        type=bounded(PositiveInt),
        metavar="N",
        help="the engine's data-parallel ranks (default 1)",
    )
    group.add_argument("--topic", action=Action, help="the topic the engine publishes under")
    group.add_argument(
        "--block-size",
        "--page-size",
        dest="block_size",
        action=Action,
        type=bounded(PositiveInt),
        metavar="B",
        help="tokens per block, checked against the events"
        + ("; before any --engine, the router's own block size" if global_block_size else "")
        + " (--page-size: SGLang's name for it)",
    )
    group.add_argument(
        "--engine-kind",
        dest="kind",
        action=Action,
        choices=ENGINE_KINDS,
        help="how a request names its rank: vllm (X-data-parallel-rank header; default when "
        "--kv-endpoint is given), sglang or kvevents (routed_dp_rank in the body)",
    )
    group.add_argument(
        "--name", action=Action, help="the worker's name (default: the engine URL or the endpoint)"
    )
    group.add_argument(
        "--model",
        action=Action,
        metavar="NAME[,NAME]",
        help="the models the engine serves (default: read from its /v1/models or "
        "/server_info); a request naming one is routed only among the engines serving it",
    )
    keys = group if security is None else security
    keys.add_argument(
        "--curve-server-key",
        dest="curve_server_key",
        action=Action,
        metavar="KEY",
        help="the publishers' CURVE public key (Z85, the public-key line of their NAME.key): "
        "after an engine or endpoint, that one's; before any, every stream's that has none "
        "(an engine's advertised key wins). Write --curve-server-key=KEY: a key may begin "
        "with '-'",
    )
    keys.add_argument(
        "--curve-secret-key-file",
        dest="curve_secret_key_file",
        metavar="FILE",
        help="this subscriber's CURVE key pair (a NAME.key_secret file from kvevents keygen); "
        "its public key must be among the engines' allowed keys",
    )
    parser.set_defaults(
        entries=[], engines_file=None, global_curve_server_key=None, curve_secret_key_file=None
    )
    if global_block_size:
        parser.set_defaults(global_block_size=None)


def engine_specs(args: argparse.Namespace, urls: Sequence[str] = ()) -> list[EngineSpec]:
    """The engines of ``--engine`` entries, bare ``urls`` and ``--engines-file``, in that order."""
    specs = []
    for entry in args.entries:
        if entry["opener"] != "engine":
            continue
        fields = {k: v for k, v in entry.items() if k not in ("opener", "engine", "flag")}
        specs.append(EngineSpec.create(entry["engine"], **fields))
    specs += [EngineSpec.create(url) for url in urls]
    if args.engines_file is not None:
        specs += load_engines_file(args.engines_file)
    seen: dict[str, str] = {}
    for spec in specs:
        if spec.worker in seen:
            raise ConfigError(
                f"engine {spec.worker} is given twice; give each engine once (or distinct --name)"
            )
        seen[spec.worker] = spec.url
    return specs


def pool_specs(args: argparse.Namespace) -> list[tuple[PoolName, EngineSpec, int | None]]:
    """The engines of ``--prefill`` and ``--decode`` entries, in order: each one's pool
    (``"prefill"`` or ``"decode"``), spec and bootstrap port as given (None: not given)."""
    pooled: list[tuple[PoolName, EngineSpec, int | None]] = []
    for entry in args.entries:
        pool = entry["opener"]
        if pool != "prefill" and pool != "decode":
            continue
        skip = ("opener", "flag", "prefill", "decode", "bootstrap_port")
        fields = {k: v for k, v in entry.items() if k not in skip}
        pooled.append((pool, EngineSpec.create(entry[pool], **fields), entry.get("bootstrap_port")))
    return pooled


def _prefill_values(parser: argparse.ArgumentParser, values: list[str]) -> tuple[str, int | None]:
    """``--prefill URL [BOOTSTRAP_PORT]``'s URL and port."""
    if len(values) > 2:
        parser.error(
            f"--prefill takes a URL and, optionally, its bootstrap port: {' '.join(values)!r} "
            "is more (one --prefill per engine)"
        )
    if len(values) == 1:
        return values[0], None
    port = values[1]
    if not port.isdigit() or not 0 < int(port) < 65536:
        parser.error(
            f"--prefill {values[0]} {port}: the bootstrap port must be a number in 1..65535"
        )
    return values[0], int(port)


def curve_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Subscriber keywords of ``--curve-secret-key-file`` and a global ``--curve-server-key``."""
    path = args.curve_secret_key_file
    return {
        "curve_key_pair": None
        if path is None
        else CurveKeyPair.load(path, "--curve-secret-key-file"),
        "curve_server_key": None
        if args.global_curve_server_key is None
        else parse_public_key(args.global_curve_server_key, "--curve-server-key"),
    }


def endpoint_specs(args: argparse.Namespace) -> list[StreamSpec]:
    """The explicit streams of ``--endpoint`` entries."""
    return [
        StreamSpec.from_endpoint(
            entry["endpoint"],
            replay_endpoint=entry.get("replay_endpoint"),
            topic=entry.get("topic") or "",
            worker=entry.get("name"),
            dp_rank=entry.get("dp_rank", 0),
            block_size=entry.get("block_size"),
            curve_server_key=entry.get("curve_server_key"),
        )
        for entry in args.entries
        if entry["opener"] == "endpoint"
    ]
