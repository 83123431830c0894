"""What every ``kvevents`` command shares: its parser, help layout, ``--log-level``, bounded numbers.

* :class:`CommandParser` is each command's parser: it reports an option it does not
  know itself (its own usage, ``kvevents CMD: error: unrecognized arguments: --engin
  (did you mean --engine?)``, exit status 2), and takes no abbreviations: ``--sync-n``
  for ``--sync-name`` would turn ambiguous, or mean another option, as options are
  added, in scripts written against today's list.
* :class:`HelpFormatter` shows each option's default in ``--help`` (options without a
  meaningful default, None, a flag's False or an empty list, show none), and an option
  of one value and an optional second (``nargs="+"`` with two metavars) as
  ``--prefill URL [BOOTSTRAP_PORT]``; the command checks there are at most two.
* :func:`add_log_level` gives a long-running command ``--log-level``; ``kvevents``
  applies it with :func:`configure_logging` before the command runs.

Numeric options are parsed with :func:`kvevents.types.bounded`, the bounds declared
once in :mod:`kvevents.types`: a bad value is a usage error where it is parsed
(``kvevents CMD: error: argument --flag: VALUE: must be ...``, exit status 2), and the
command does not check it again.
"""

from __future__ import annotations

import argparse
import difflib
import logging
from collections.abc import Sequence
from typing import Any

__all__ = [
    "LOG_FORMAT",
    "LOG_LEVELS",
    "CommandParser",
    "HelpFormatter",
    "add_log_level",
    "configure_logging",
    "unrecognized",
]

LOG_LEVELS = ("debug", "info", "warning", "error")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` to an option's help, unless it has no default worth showing
    (None, a flag's False, an empty string or list) or its help already says what the
    default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default in ("", [], argparse.SUPPRESS):
            return text
        if "default" in text:
            return text
        if not action.option_strings and action.nargs not in ("?", "*"):
            return text
        return text + " (default: %(default)s)"

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        metavar = action.metavar
        if action.nargs == "+" and isinstance(metavar, tuple) and len(metavar) == 2:
            return f"{metavar[0]} [{metavar[1]}]"
        return super()._format_args(action, default_metavar)


def unrecognized(words: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """The error for ``words`` that ``parser`` did not recognize, each unknown option
    followed by the closest option it has, if one is close: ``unrecognized arguments:
    --engin (did you mean --engine?)``. The values right after an unknown option are
    taken as its own and not repeated; a value after none is listed as it is."""
    known = sorted(
        option
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
        if option.startswith("--")
    )
    shown: list[str] = []
    after_option = False
    for word in words:
        if not (word.startswith("-") and len(word) > 1) or _is_number(word):
            if not after_option:
                shown.append(word)
            continue
        after_option = True
        option = word.partition("=")[0]
        close = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
        shown.append(f"{option} (did you mean {close[0]}?)" if close else option)
    return "unrecognized arguments: " + " ".join(shown)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


class CommandParser(argparse.ArgumentParser):
    """A ``kvevents`` command's parser (see the module docstring): no abbreviations, and
    arguments it does not recognize are its own usage error, with a suggestion."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:
        """As argparse's, but nothing is left unknown: an unknown argument exits 2 here,
        naming this command, rather than in ``kvevents``'s own parser above it."""
        namespace, extras = super().parse_known_args(*args, **kwargs)
        if extras:
            self.error(unrecognized(extras, self))
        return namespace, extras


def add_log_level(parser: argparse._ActionsContainer) -> None:
    """``--log-level``: the least severe log messages printed on stderr."""
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="least severe log messages shown on stderr",
    )


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [pid %(process)d]: %(message)s"
"""One line per message, naming the process: the same for one router process or several."""


def configure_logging(level: str) -> None:
    """Log to stderr at ``level`` (one of :data:`LOG_LEVELS`), one line per message."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
