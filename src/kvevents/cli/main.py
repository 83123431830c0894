"""The ``kvevents`` command: a thin entry point over the library.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``. Exit codes: 0 success, 1 runtime failure, 2 usage or
configuration error (argparse's own convention). Errors print as ``Type: message``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvevents.errors import KVEventsError

# subcommand -> (module, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("kvevents.cli.engine", "run the simulated data-parallel engine"),
    "watch": ("kvevents.cli.watch", "follow every KV-event stream of engines or endpoints"),
    "router": ("kvevents.cli.router", "run the KV-aware router service"),
    "demo": ("kvevents.cli.demo", "the whole plane in one command: engine, router, trace"),
    "bench": ("kvevents.cli.bench", "run the benchmarks and write their results as JSON"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; only ``command``'s module is imported (the others stay unloaded)."""
    parser = argparse.ArgumentParser(
        prog="kvevents", description="The KV-cache event plane for data-parallel LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in _COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        return int(args._run(args))
    except KVEventsError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
