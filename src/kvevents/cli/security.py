"""The key and TLS options of ``kvevents engine``, ``router`` and ``watch``.

* :func:`add_api_key_arguments`: ``--X`` or ``--X-file`` (one of them), else an
  environment variable; :func:`api_key_of` reads them in that order of precedence.
* :func:`add_tls_arguments`: ``--ssl-certfile`` / ``--ssl-keyfile`` (:func:`tls_of`).
* :func:`add_engine_server_arguments`: ``kvevents engine``'s key and TLS.
* :func:`add_engine_client_arguments`: what a consumer sends engines and trusts them
  with, ``--engine-api-key`` and ``--ssl-ca-certs`` (:func:`engine_credentials`).
* :func:`add_router_arguments` and :func:`router_security`: the router's whole set.
* :func:`add_sync_arguments` and :func:`sync_security`: the credentials and TLS of the
  router's NATS link (``--sync``), secrets from files or the environment only.

The values are checked by :mod:`kvevents.http.auth`; every error is a
:class:`~kvevents.errors.ConfigError` naming the option, and no message holds a key.
docs/security.md says what each option closes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvevents.errors import ConfigError
from kvevents.http.auth import ApiKey, ClientCredentials, ServerTLS, resolve_secret
from kvevents.router.fleet.sync_security import SyncSecurity, read_secret

__all__ = [
    "API_KEY_ENV",
    "ENGINE_API_KEY_ENV",
    "SYNC_OPTIONS",
    "SYNC_PASSWORD_ENV",
    "SYNC_TOKEN_ENV",
    "RouterSecurity",
    "add_api_key_arguments",
    "add_engine_client_arguments",
    "add_engine_server_arguments",
    "add_router_arguments",
    "add_sync_arguments",
    "add_tls_arguments",
    "api_key_of",
    "engine_api_key",
    "engine_credentials",
    "router_security",
    "sync_security",
    "tls_of",
]

API_KEY_ENV = "KVEVENTS_API_KEY"
"""The router's own key when neither ``--api-key`` nor ``--api-key-file`` is given."""
ENGINE_API_KEY_ENV = "KVEVENTS_ENGINE_API_KEY"
"""The engine's key: ``kvevents engine``'s own (``--api-key``), the one ``router`` and
``watch`` send (``--engine-api-key``). One variable, so one environment sets both ends."""


def add_api_key_arguments(
    parser: argparse._ActionsContainer, option: str, env: str, what: str
) -> None:
    """``--OPTION KEY`` or ``--OPTION-file PATH`` (one of them), else ``$ENV``; ``what``
    is the key option's help, to which its default is added.

    Read them with :func:`api_key_of`. The option is visible in ``ps``; the file and
    the variable are not.
    """
    group = parser.add_mutually_exclusive_group()
    dest = option.lstrip("-").replace("-", "_")
    group.add_argument(option, dest=dest, metavar="KEY", help=f"{what} (default: ${env}, if set)")
    group.add_argument(
        f"{option}-file",
        dest=f"{dest}_file",
        metavar="PATH",
        help=f"read {option} from the first line of this file, which ps does not show",
    )


def api_key_of(args: argparse.Namespace, option: str, env: str) -> str | None:
    """The key of :func:`add_api_key_arguments`: the option, else its file, else ``$ENV``."""
    dest = option.lstrip("-").replace("-", "_")
    return resolve_secret(getattr(args, dest), getattr(args, f"{dest}_file"), env, option)


def add_tls_arguments(parser: argparse._ActionsContainer, what: str) -> None:
    """``--ssl-certfile`` and ``--ssl-keyfile``: serve HTTPS (read with :func:`tls_of`)."""
    parser.add_argument(
        "--ssl-certfile", metavar="PEM", help=f"serve {what} over HTTPS with this certificate"
    )
    parser.add_argument("--ssl-keyfile", metavar="PEM", help="the private key of --ssl-certfile")


def tls_of(args: argparse.Namespace) -> ServerTLS | None:
    """The server TLS of :func:`add_tls_arguments` (None: plain HTTP); ConfigError if bad."""
    return ServerTLS.from_options(args.ssl_certfile, args.ssl_keyfile)


def add_engine_client_arguments(
    parser: argparse._ActionsContainer, sent_to: str, verified: str = "https:// engines"
) -> None:
    """``--engine-api-key`` (file, ``$KVEVENTS_ENGINE_API_KEY``), sent ``sent_to``, and
    ``--ssl-ca-certs``, which verifies ``verified``."""
    add_api_key_arguments(
        parser,
        "--engine-api-key",
        ENGINE_API_KEY_ENV,
        f"send this key, as 'Authorization: Bearer KEY', {sent_to}",
    )
    parser.add_argument(
        "--ssl-ca-certs",
        metavar="PEM",
        help=f"verify {verified} against this CA bundle (default: the system's trust store)",
    )


def engine_credentials(args: argparse.Namespace) -> ClientCredentials:
    """What :func:`add_engine_client_arguments` gave, checked."""
    return ClientCredentials(
        api_key=api_key_of(args, "--engine-api-key", ENGINE_API_KEY_ENV),
        ca_certs=args.ssl_ca_certs,
    )


@dataclass(frozen=True)
class RouterSecurity:
    """The router's keys and TLS, from its options (:func:`router_security`)."""

    api_key: ApiKey | None = None
    metrics_auth: bool = False
    tls: ServerTLS | None = None
    engines: ClientCredentials = field(default_factory=ClientCredentials)
    """What every request to an engine (and to ``--tokenize-endpoint``) carries."""
    peers: ClientCredentials = field(default_factory=ClientCredentials)
    """What ``GET /dump`` of a ``--peer`` carries: the router's own key (replicas share it)."""


def add_engine_server_arguments(parser: argparse._ActionsContainer, open_paths: str) -> None:
    """``kvevents engine``'s ``--api-key`` (file, ``$KVEVENTS_ENGINE_API_KEY``) and TLS;
    ``open_paths`` names the endpoints that need no key."""
    add_api_key_arguments(
        parser,
        "--api-key",
        ENGINE_API_KEY_ENV,
        f"require this key, as 'Authorization: Bearer KEY', on every endpoint but {open_paths}",
    )
    add_tls_arguments(parser, "the engine")


def engine_api_key(args: argparse.Namespace) -> str | None:
    """The key of :func:`add_engine_server_arguments` (None: no key required)."""
    return api_key_of(args, "--api-key", ENGINE_API_KEY_ENV)


def add_router_arguments(parser: argparse._ActionsContainer) -> None:
    """Every key and TLS option of ``kvevents router`` (read with :func:`router_security`)."""
    add_api_key_arguments(
        parser,
        "--api-key",
        API_KEY_ENV,
        "require this key of clients, as 'Authorization: Bearer KEY', on every endpoint but "
        "/health, /ready, /docs, /openapi.json and /metrics",
    )
    parser.add_argument(
        "--metrics-auth",
        action="store_true",
        help="require the --api-key on /metrics too (without it, /metrics stays open to scrapers)",
    )
    add_tls_arguments(parser, "the router")
    add_engine_client_arguments(
        parser,
        "to the engines (their --api-key) and --tokenize-endpoint, never the client's own",
        "https:// engines, --tokenize-endpoint and --peer",
    )


def router_security(args: argparse.Namespace) -> RouterSecurity:
    """The router's keys and TLS options read and checked (ConfigError naming the option)."""
    own = api_key_of(args, "--api-key", API_KEY_ENV)
    if args.metrics_auth and own is None:
        raise ConfigError(f"--metrics-auth needs --api-key (or --api-key-file, ${API_KEY_ENV})")
    return RouterSecurity(
        api_key=None if own is None else ApiKey(own),
        metrics_auth=args.metrics_auth,
        tls=tls_of(args),
        engines=engine_credentials(args),
        peers=ClientCredentials(api_key=own, ca_certs=args.ssl_ca_certs),
    )


SYNC_PASSWORD_ENV = "KVEVENTS_SYNC_PASSWORD"
"""The NATS password of ``--sync-user`` when ``--sync-password-file`` is not given."""
SYNC_TOKEN_ENV = "KVEVENTS_SYNC_TOKEN"
"""The NATS token when ``--sync-token-file`` is not given."""
SYNC_OPTIONS = (
    "--sync-user",
    "--sync-password-file",
    "--sync-token-file",
    "--sync-nkey-seed-file",
    "--sync-creds-file",
    "--sync-ca-certs",
    "--sync-certfile",
    "--sync-keyfile",
)
"""The options of :func:`add_sync_arguments` (each needs ``--sync``)."""


def add_sync_arguments(group: argparse._ActionsContainer) -> None:
    """The credentials and TLS of ``--sync`` (read with :func:`sync_security`): one kind
    of credentials; any TLS option makes the link TLS or nothing, as a tls:// URL does."""
    group.add_argument(
        "--sync-user",
        metavar="USER",
        help=f"the NATS user, its password from --sync-password-file or ${SYNC_PASSWORD_ENV}",
    )
    group.add_argument(
        "--sync-password-file", metavar="PATH", help="read --sync-user's password from this file"
    )
    group.add_argument(
        "--sync-token-file",
        metavar="PATH",
        help=f"read a NATS token from this file (default: ${SYNC_TOKEN_ENV}, if set)",
    )
    group.add_argument(
        "--sync-nkey-seed-file",
        metavar="PATH",
        help="sign in with the NATS nkey whose seed (SU...) is in this file",
    )
    group.add_argument(
        "--sync-creds-file",
        metavar="PATH",
        help="sign in with this NATS .creds file (a user JWT and its nkey seed)",
    )
    group.add_argument(
        "--sync-ca-certs",
        metavar="PEM",
        help="verify the NATS server against this CA bundle (default: the system's trust store)",
    )
    group.add_argument("--sync-certfile", metavar="PEM", help="show NATS this client certificate")
    group.add_argument("--sync-keyfile", metavar="PEM", help="the private key of --sync-certfile")


def sync_security(args: argparse.Namespace) -> SyncSecurity:
    """The options of :func:`add_sync_arguments` read and checked (ConfigError naming the
    option; a password or token from its file, else from the environment)."""
    password = None
    if args.sync_user is not None or args.sync_password_file is not None:
        password = read_secret(args.sync_password_file, SYNC_PASSWORD_ENV, "--sync-password-file")
    return SyncSecurity(
        user=args.sync_user,
        password=password,
        token=read_secret(args.sync_token_file, SYNC_TOKEN_ENV, "--sync-token-file"),
        nkey_seed_file=args.sync_nkey_seed_file,
        creds_file=args.sync_creds_file,
        ca_certs=args.sync_ca_certs,
        certfile=args.sync_certfile,
        keyfile=args.sync_keyfile,
    )
