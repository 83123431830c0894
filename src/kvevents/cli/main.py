"""The ``kvevents`` command: a thin entry point over the library.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``. Exit codes: 0 success, 1 runtime failure, 2 usage or
configuration error (argparse's own convention), 130 on Ctrl-C. Every error prints one
line on stderr in argparse's format, ``kvevents CMD: error: message``, whether argparse
or the command found it; an option a command does not know is reported by that
command's parser, with the closest option it has (:class:`~kvevents.cli.options.CommandParser`).
Every ``--help`` shows the defaults (:class:`~kvevents.cli.options.HelpFormatter`);
``kvevents --version`` prints the installed version; long-running commands take
``--log-level``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence

from kvevents.cli.options import CommandParser, HelpFormatter, configure_logging
from kvevents.errors import KVEventsError

# subcommand -> (module, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("kvevents.cli.engine", "run the simulated data-parallel engine"),
    "watch": ("kvevents.cli.watch", "follow every KV-event stream of engines or endpoints"),
    "router": ("kvevents.cli.router", "run the KV-aware router service"),
    "demo": ("kvevents.cli.demo", "the whole plane in one command: engine, router, trace"),
    "bench": ("kvevents.cli.bench", "run the benchmarks and write their results as JSON"),
    "keygen": ("kvevents.cli.keygen", "write a CURVE key pair for encrypted event streams"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; only ``command``'s module is imported (the others stay unloaded)."""
    parser = argparse.ArgumentParser(
        prog="kvevents",
        description="The KV-cache event plane for data-parallel LLM serving.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {importlib.metadata.version('kvevents')}",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    for name, (module_name, help_text) in _COMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in _COMMANDS else None)
    args = parser.parse_args(argv)  # a usage error exits 2 here, printed by argparse
    if getattr(args, "log_level", None) is not None:
        configure_logging(args.log_level)
    try:
        return int(args._run(args))
    except KVEventsError as exc:
        # bad input (a ValueError: config, endpoint, option) is a usage error; the rest
        # (an engine unreachable, a rank that died) a runtime failure
        print(f"kvevents {args.command}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
