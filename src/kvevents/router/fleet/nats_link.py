"""Opening the NATS connection of ``--sync``: its URL checked before anything connects,
its credentials and TLS (:class:`~kvevents.router.fleet.sync_security.SyncSecurity`)
handed to nats-py, and plain text refused whenever TLS is required.

nats-py upgrades a connection to TLS only when the server's ``INFO`` says
``tls_required``; given a ``tls://`` URL and a server without TLS, it goes on in plain
text and sends its ``CONNECT``, credentials included, in the clear. :class:`TlsOnlyClient`
checks that ``INFO`` before nats-py acts on it, on every connection (the first, each
reconnection, every server a cluster announces), and raises :class:`PlainTextRefused`
instead: nats-py reports it to the error callback and tries again later, so the replica
stays unconnected, says why, and never writes a byte after the server's greeting. The
check overrides nats-py's ``_process_info``, the one step between reading ``INFO`` and
answering it; nats-py has no public hook there.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import nats.errors
from nats.aio.client import Client

from kvevents.errors import ConfigError
from kvevents.http.auth import masked_url
from kvevents.router.fleet.sync_security import SyncSecurity

__all__ = ["PlainTextRefused", "TlsOnlyClient", "check_url", "open_client", "shown_url"]

shown_url = masked_url
"""``text`` with the credentials of every URL in it masked (``--sync
nats://user:pass@host`` is how nats-py takes them)."""


class PlainTextRefused(nats.errors.Error):
    """The server offers no TLS where this replica requires it: nothing was sent."""

    def __str__(self) -> str:
        return (
            "nats: TLS required (a tls:// URL or --sync-ca-certs/--sync-certfile) but the "
            "server does not offer it; refusing to connect in plain text (give the server "
            "a tls block, or a nats:// URL and no TLS options to go without)"
        )


class TlsOnlyClient(Client):
    """A nats-py client that, with ``require_tls``, never connects in plain text."""

    require_tls = False

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if initial_connection and self.require_tls and not info.get("tls_required", False):
            raise PlainTextRefused
        await super()._process_info(info, initial_connection)


def check_url(url: str) -> None:
    """ConfigError unless ``url`` is one NATS URL with a host and a valid port (or none:
    4222). nats-py checks them only as it connects, and raises there, before its retry
    loop: a replica started with a typo would go on without sync, saying only that it
    is not connected."""
    shown = shown_url(url)
    example = "give a NATS URL, e.g. nats://127.0.0.1:4222"
    if not url.startswith(("nats://", "tls://")):
        raise ConfigError(f"--sync {shown!r}: {example}")
    try:
        parsed = urllib.parse.urlsplit(url)
        port = parsed.port
    except ValueError:  # a port that is not a number or out of range, a broken [IPv6]
        port = -1
    if port is not None and not 0 < port < 65536:
        raise ConfigError(
            f"--sync {shown!r}: cannot read a port from 1 to 65535 in the URL; {example}"
        )
    if not parsed.hostname:
        raise ConfigError(f"--sync {shown!r}: the URL names no host; {example}")


def url_credentials(url: str) -> bool:
    """Whether ``url`` carries a user, password or token (``nats://user:pass@host``)."""
    return "@" in urllib.parse.urlsplit(url).netloc


async def open_client(
    url: str, security: SyncSecurity, *, require_tls: bool, **options: Any
) -> TlsOnlyClient:
    """A connected client: nats-py's ``connect`` with ``options``, the credentials and TLS
    of ``security``, and plain text refused when ``require_tls``."""
    client = TlsOnlyClient()
    client.require_tls = require_tls
    tls = security.tls_context()
    if tls is not None:
        options["tls"] = tls
    await client.connect(url, **options, **security.connect_options())
    return client
