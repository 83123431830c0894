"""What every ``kvevents`` command shares: help layout, ``--log-level``, bounded numbers.

* :class:`HelpFormatter` shows each option's default in ``--help`` (options without a
  meaningful default, None or a flag's False, show none).
* :func:`add_log_level` gives a long-running command ``--log-level``; ``kvevents``
  applies it with :func:`configure_logging` before the command runs.

Numeric options are parsed with :func:`kvevents.types.bounded`, the bounds declared
once in :mod:`kvevents.types`: a bad value is a usage error where it is parsed
(``kvevents CMD: error: argument --flag: VALUE: must be ...``, exit status 2), and the
command does not check it again.
"""

from __future__ import annotations

import argparse
import logging

__all__ = ["LOG_FORMAT", "LOG_LEVELS", "HelpFormatter", "add_log_level", "configure_logging"]

LOG_LEVELS = ("debug", "info", "warning", "error")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` to an option's help, unless it has no default worth showing
    (None, a flag's False, an empty string) or its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, "", argparse.SUPPRESS) or "default" in text:
            return text
        if not action.option_strings and action.nargs not in ("?", "*"):
            return text
        return text + " (default: %(default)s)"


def add_log_level(parser: argparse.ArgumentParser) -> None:
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
