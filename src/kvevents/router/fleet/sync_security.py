"""How a router replica proves itself to the NATS server of ``--sync``, and how it
trusts it: :class:`SyncSecurity`, checked when built (every error a
:class:`~kvevents.errors.ConfigError` naming the option, no message holding a secret).

Credentials, at most one kind: a user and password, a token, an nkey seed file, or a
``.creds`` file (a user JWT and its seed, for NATS's decentralised auth); the secrets
come from files or the environment (:func:`read_secret`), never from the command line,
where ``ps`` shows them. TLS: a CA bundle the server is verified against, and a client
certificate and key for servers that require one. :meth:`SyncSecurity.tls_context` is
built once, when the object is.

Whether TLS is *required* is the transport's business (a ``tls://`` URL or any TLS
option here: :mod:`kvevents.router.fleet.nats_sync`). This module does not import
nats-py, so the command line is checked even where the optional package is missing.
"""

from __future__ import annotations

import importlib.util
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvevents.errors import ConfigError

__all__ = ["AuthKind", "SyncSecurity", "read_secret"]

AuthKind = Literal["user", "token", "nkey", "creds"]


def read_secret(file: str | None, env: str, option: str) -> str | None:
    """A secret from ``option``'s file (its first line), else ``$env``; None when neither
    is given. ConfigError for an unreadable file or an empty secret."""
    if file is not None:
        where = f"{option} {file}"
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"{where} cannot be read ({reason})") from None
        secret = text.strip().split("\n", 1)[0].strip()
    else:
        found = os.environ.get(env)
        if found is None:
            return None
        where, secret = f"${env}", found.strip()
    if not secret:
        raise ConfigError(f"{where}: empty; give the secret, or leave the option out")
    return secret


def _readable(option: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{option} {path} cannot be read ({exc.strerror})") from None


@dataclass(frozen=True, repr=False)
class SyncSecurity:
    """The credentials and TLS of a router's NATS connection; see the module docstring.

    ``password`` goes with ``user``; ``nkey_seed_file`` and ``creds_file`` are paths
    (nats-py reads them at each connection, signing the server's nonce); ``ca_certs``,
    ``certfile`` and ``keyfile`` are PEM files. The ``repr`` shows no secret.
    """

    user: str | None = None
    password: str | None = None
    token: str | None = None
    nkey_seed_file: str | None = None
    creds_file: str | None = None
    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    _tls: ssl.SSLContext | None = field(default=None, init=False, compare=False)

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise ConfigError(
                "--sync-user needs a password (--sync-password-file or $KVEVENTS_SYNC_PASSWORD)"
                if self.user is not None
                else "a NATS password needs --sync-user"
            )
        given = [
            option
            for option, value in (
                ("--sync-user", self.user),
                ("--sync-token-file (or $KVEVENTS_SYNC_TOKEN)", self.token),
                ("--sync-nkey-seed-file", self.nkey_seed_file),
                ("--sync-creds-file", self.creds_file),
            )
            if value is not None
        ]
        if len(given) > 1:
            raise ConfigError(
                f"{' and '.join(given)}: give one kind of NATS credentials, the one the "
                "server's authorization block expects"
            )
        for option, path in (
            ("--sync-nkey-seed-file", self.nkey_seed_file),
            ("--sync-creds-file", self.creds_file),
        ):
            if path is not None:
                _readable(option, path)
                if importlib.util.find_spec("nkeys") is None:
                    raise ConfigError(
                        f"{option} needs the nkeys package: pip install 'kvevents[sync]'"
                    )
        if (self.certfile is None) != (self.keyfile is None):
            given_one, missing = (
                ("--sync-certfile", "--sync-keyfile")
                if self.keyfile is None
                else ("--sync-keyfile", "--sync-certfile")
            )
            raise ConfigError(f"{given_one} needs {missing} too (the certificate and its key)")
        if self.tls_options:
            object.__setattr__(self, "_tls", self._build_tls())

    def __repr__(self) -> str:
        return (
            f"SyncSecurity(auth={self.auth!r}, user={self.user!r}, "
            f"ca_certs={self.ca_certs!r}, certfile={self.certfile!r})"
        )

    @property
    def auth(self) -> AuthKind | None:
        """The kind of credentials given, or None."""
        if self.user is not None:
            return "user"
        if self.token is not None:
            return "token"
        if self.nkey_seed_file is not None:
            return "nkey"
        return "creds" if self.creds_file is not None else None

    @property
    def tls_options(self) -> bool:
        """Whether a TLS option was given (then TLS is required)."""
        return self.ca_certs is not None or self.certfile is not None

    @property
    def identified(self) -> bool:
        """Whether the server can tell who this replica is: credentials or a client
        certificate (which nats-server can map to a user, ``verify_and_map``)."""
        return self.auth is not None or self.certfile is not None

    def tls_context(self) -> ssl.SSLContext | None:
        """The context the server is verified with (the CA bundle, else the system's
        store) and the client certificate is shown from; None without TLS options."""
        return self._tls

    def connect_options(self) -> dict[str, Any]:
        """The keyword arguments of nats-py's ``connect`` these settings make."""
        options: dict[str, Any] = {}
        if self.user is not None:
            options.update(user=self.user, password=self.password)
        if self.token is not None:
            options["token"] = self.token
        if self.nkey_seed_file is not None:
            options["nkeys_seed"] = self.nkey_seed_file
        if self.creds_file is not None:
            options["user_credentials"] = self.creds_file
        return options

    def _build_tls(self) -> ssl.SSLContext:
        for option, path in (
            ("--sync-ca-certs", self.ca_certs),
            ("--sync-certfile", self.certfile),
            ("--sync-keyfile", self.keyfile),
        ):
            if path is not None:
                _readable(option, path)
        try:
            context = ssl.create_default_context(cafile=self.ca_certs)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"--sync-ca-certs {self.ca_certs}: not a PEM CA bundle ({exc.reason or exc})"
            ) from None
        if self.certfile is not None and self.keyfile is not None:
            try:
                context.load_cert_chain(self.certfile, self.keyfile)
            except ssl.SSLError as exc:
                raise ConfigError(
                    f"--sync-certfile {self.certfile} / --sync-keyfile {self.keyfile}: not a "
                    f"certificate and its private key in PEM ({exc.reason or exc})"
                ) from None
        return context
