"""Helpers for the ``--sync`` security tests: a throwaway PKI (``trustme``), the NATS
configuration docs/security.md shows, made runnable here, and :class:`Recorder`, a TCP
relay that keeps what clients send through it."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys
import trustme
from nats_support import NatsServer

__all__ = [
    "GROUP",
    "PASSWORDS",
    "Pki",
    "Recorder",
    "documented_config",
    "fleet_config",
    "make_pki",
    "operator_mode",
    "tls_url",
    "until",
]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "security.md"
GROUP = "kvevents.notes.fleet1"  # the group subject of the documented configuration
PASSWORDS = {"router-a": "pw-of-A-8d1e", "router-b": "pw-of-B-77c3"}
"""The users of the documented configuration and their passwords (in the server's
environment as ``ROUTER_A_PASSWORD`` and ``ROUTER_B_PASSWORD``)."""


@dataclass(frozen=True)
class Pki:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def make_pki(folder: Path) -> Pki:
    """Write a CA, a server certificate and a client certificate (PEM) into ``folder``."""
    ca = trustme.CA()
    paths = {name: str(folder / f"{name}.pem") for name in Pki.__dataclass_fields__}
    ca.cert_pem.write_to_path(paths["ca"])
    server = ca.issue_cert("127.0.0.1")
    server.private_key_pem.write_to_path(paths["server_key"])
    with open(paths["server_cert"], "wb") as f:
        for pem in server.cert_chain_pems:
            f.write(pem.bytes())
    client = ca.issue_cert("router-a")
    client.private_key_pem.write_to_path(paths["client_key"])
    client.cert_chain_pems[0].write_to_path(paths["client_cert"])
    return Pki(**paths)


def documented_config() -> str:
    """The ``conf`` block of docs/security.md."""
    found = re.search(r"```conf\n(.*?)```", DOCS.read_text(), re.S)
    assert found is not None, "docs/security.md has no ```conf block"
    return found.group(1)


def fleet_config(pki: Pki, folder: Path) -> Path:
    """docs/security.md's configuration with this test's certificate paths, written to
    ``folder``; the server reads the passwords from its environment."""
    text = documented_config()
    text = text.replace("/etc/nats/server-cert.pem", pki.server_cert)
    text = text.replace("/etc/nats/server-key.pem", pki.server_key)
    conf = folder / "nats-server.conf"
    conf.write_text(text)
    return conf


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _keypair(prefix: int) -> tuple[bytes, Any, str]:
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    pair = nkeys.from_seed(bytearray(seed))
    return seed, pair, pair.public_key.decode()


def _jwt(issuer: Any, subject: str, claims: dict[str, Any]) -> str:
    """A NATS JWT (``ed25519-nkey``) of ``claims`` about ``subject``, signed by ``issuer``."""
    body = {"iat": int(time.time()), "iss": issuer.public_key.decode(), "sub": subject}
    body.update(name=subject[:8], nats={**claims, "version": 2})
    body["jti"] = base64.b32encode(hashlib.sha256(json.dumps(body).encode()).digest()).decode()
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    signed = f"{header}.{_b64(json.dumps(body).encode())}"
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


def operator_mode(folder: Path, publish: str, subscribe: str) -> tuple[Path, Path, Path]:
    """NATS's decentralised auth in ``folder``: a server configuration trusting one
    operator and its account (``resolver: MEMORY``), a ``.creds`` file of a user of that
    account allowed to publish on ``publish`` and hear ``subscribe``, and the ``.creds`` of
    a user signed by an account the server does not know."""
    _, operator, operator_pub = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    _, account, account_pub = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    _, stranger, _ = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    unlimited = {"subs": -1, "data": -1, "payload": -1}
    limits = {**unlimited, "imports": -1, "exports": -1, "wildcards": True, "conn": -1}
    conf = folder / "operator.conf"
    conf.write_text(
        f"operator: {_jwt(operator, operator_pub, {'type': 'operator'})}\n"
        "resolver: MEMORY\n"
        f"resolver_preload: {{\n  {account_pub}: "
        f"{_jwt(operator, account_pub, {'type': 'account', 'limits': limits})}\n}}\n"
    )
    files = []
    for name, signer in (("user", account), ("stranger", stranger)):
        seed, _, user_pub = _keypair(nkeys.PREFIX_BYTE_USER)
        grants = {"pub": {"allow": [publish]}, "sub": {"allow": [subscribe]}, **unlimited}
        token = _jwt(signer, user_pub, {"type": "user", **grants})
        creds = folder / f"{name}.creds"
        creds.write_text(
            f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n"
        )
        files.append(creds)
    return conf, files[0], files[1]


def tls_url(server: NatsServer) -> str:
    return server.url.replace("nats://", "tls://")


async def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``check`` on the event loop until true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


class Recorder:
    """A TCP relay to ``127.0.0.1:target`` that keeps every byte clients send through it."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.sent = bytearray()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self._tasks += [
            asyncio.create_task(self._pipe(reader, up_writer, record=True)),
            asyncio.create_task(self._pipe(up_reader, writer, record=False)),
        ]

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, record: bool
    ) -> None:
        try:
            while data := await reader.read(65536):
                if record:
                    self.sent += data
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
