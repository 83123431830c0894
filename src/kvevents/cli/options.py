"""What every ``kvevents`` command shares: help layout, ``--log-level``, bounded numbers,
API keys and TLS.

* :class:`HelpFormatter` shows each option's default in ``--help`` (options without a
  meaningful default, None or a flag's False, show none).
* :func:`add_log_level` gives a long-running command ``--log-level``; ``kvevents``
  applies it with :func:`configure_logging` before the command runs.

* :func:`add_api_key_arguments` gives ``--X-api-key`` / ``--X-api-key-file`` (else an
  environment variable), :func:`add_tls_arguments` ``--ssl-certfile`` / ``--ssl-keyfile``
  (:mod:`kvevents.http_auth` checks them).

Numeric options are parsed with :func:`kvevents.types.bounded`, the bounds declared
once in :mod:`kvevents.types`: a bad value is a usage error where it is parsed
(``kvevents CMD: error: argument --flag: VALUE: must be ...``, exit status 2), and the
command does not check it again.
"""

from __future__ import annotations

import argparse
import logging

from kvevents.http_auth import ServerTLS, resolve_secret

__all__ = [
    "API_KEY_ENV",
    "ENGINE_API_KEY_ENV",
    "LOG_LEVELS",
    "HelpFormatter",
    "add_api_key_arguments",
    "add_log_level",
    "add_tls_arguments",
    "api_key_of",
    "configure_logging",
    "tls_of",
]

LOG_LEVELS = ("debug", "info", "warning", "error")

API_KEY_ENV = "KVEVENTS_API_KEY"
"""The router's own key when neither ``--api-key`` nor ``--api-key-file`` is given."""
ENGINE_API_KEY_ENV = "KVEVENTS_ENGINE_API_KEY"
"""The engine's key: ``kvevents engine``'s own (``--api-key``), the one ``router`` and
``watch`` send (``--engine-api-key``). One variable, so one environment sets both ends."""


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


def configure_logging(level: str) -> None:
    """Log to stderr at ``level`` (one of :data:`LOG_LEVELS`), one line per message."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def add_api_key_arguments(
    parser: argparse.ArgumentParser, option: str, env: str, what: str
) -> None:
    """``--OPTION KEY`` or ``--OPTION-file PATH`` (one of them), else ``$ENV``.

    Read them with :func:`api_key_of`. The option is visible in ``ps``; the file and
    the variable are not.
    """
    group = parser.add_mutually_exclusive_group()
    dest = option.lstrip("-").replace("-", "_")
    group.add_argument(
        option,
        dest=dest,
        metavar="KEY",
        help=f"{what}, as 'Authorization: Bearer KEY'. Default: ${env}, else none; an "
        f"option shows in ps, so prefer {option}-file or ${env}",
    )
    group.add_argument(
        f"{option}-file",
        dest=f"{dest}_file",
        metavar="PATH",
        help=f"read {option} from the first line of this file",
    )


def api_key_of(args: argparse.Namespace, option: str, env: str) -> str | None:
    """The key of :func:`add_api_key_arguments`: the option, else its file, else ``$ENV``."""
    dest = option.lstrip("-").replace("-", "_")
    return resolve_secret(getattr(args, dest), getattr(args, f"{dest}_file"), env, option)


def add_tls_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--ssl-certfile`` and ``--ssl-keyfile``: serve HTTPS (read with :func:`tls_of`)."""
    parser.add_argument(
        "--ssl-certfile", metavar="PEM", help=f"serve {what} over HTTPS with this certificate"
    )
    parser.add_argument("--ssl-keyfile", metavar="PEM", help="the private key of --ssl-certfile")


def tls_of(args: argparse.Namespace) -> ServerTLS | None:
    """The server TLS of :func:`add_tls_arguments` (None: plain HTTP); ConfigError if bad."""
    return ServerTLS.from_options(args.ssl_certfile, args.ssl_keyfile)
