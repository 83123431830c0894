"""The replicas' NATS link signs in with credentials from files and the environment, never
shown, and is TLS or nothing: ``tls://`` never falls back to plain text, a CA bundle and a
client certificate are honoured (docs/security.md). Against a real ``nats-server``."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from pathlib import Path

import nkeys
import pytest
from nats_support import NatsServer
from router_support import Engine, RouterProc, wait_until
from sync_security_support import (
    GROUP,
    PASSWORDS,
    Pki,
    Recorder,
    operator_mode,
    tls_url,
    until,
)

from kvevents import Holder, Router
from kvevents.cli.security import SYNC_OPTIONS, SYNC_PASSWORD_ENV, SYNC_TOKEN_ENV, sync_security
from kvevents.router.fleet.nats_sync import NatsNoteTransport
from kvevents.router.fleet.peers import LoadNotes
from kvevents.router.fleet.senders import sender_id
from kvevents.router.fleet.sync_security import SyncSecurity

DP = 2  # the ranks of the shared `engine` (tests/conftest.py)
H = Holder("http://engine", 0)


def link_of(notes: LoadNotes) -> NatsNoteTransport:
    link = notes.transports[0]
    assert isinstance(link, NatsNoteTransport)
    return link


@pytest.mark.slow
def test_a_tls_url_never_falls_back_to_plain_text(plain: NatsServer) -> None:
    """``tls://`` against a server without TLS: the transport stays unconnected, says why,
    and sends nothing after the server's greeting (no CONNECT, no password), attempt after
    attempt; the same server through the same relay is reachable with ``nats://``."""

    async def main() -> None:
        relay = Recorder(plain.port)
        await relay.start()
        security = SyncSecurity(user="router-a", password="never-on-the-wire")
        strict = NatsNoteTransport(
            f"tls://127.0.0.1:{relay.port}", "t.tls", security=security, reconnect_wait=0.1
        )
        strict.publish_as("router-a")
        strict.start(lambda raw, origin: None)
        try:
            await until(lambda: "plain text" in str(strict.last_error), 10, "the refusal")
            await asyncio.sleep(0.5)  # several more attempts, each refused
            status = strict.status()
            assert not status["connected"] and status["tls"] is True
            assert "refusing to connect in plain text" in str(status["last_error"])
            assert b"CONNECT" not in relay.sent and b"never-on-the-wire" not in relay.sent
        finally:
            await strict.close()
        loose = NatsNoteTransport(f"nats://127.0.0.1:{relay.port}", "t.tls", reconnect_wait=0.1)
        loose.publish_as("router-b")
        loose.start(lambda raw, origin: None)
        try:
            await until(lambda: loose.connected, 10, "the plain connection (the control)")
            assert b"CONNECT" in relay.sent
        finally:
            await loose.close()
            await relay.close()

    asyncio.run(main())


@pytest.mark.slow
def test_kvevents_router_with_a_tls_url_refuses_a_plain_server_and_says_so(
    engine: Engine, plain: NatsServer
) -> None:
    """``kvevents router --sync tls://`` pointed at a NATS without TLS routes alone:
    ``/workers`` says it is not connected and why, and the log says so as an error."""
    router = RouterProc([engine.url], "--sync", tls_url(plain))
    try:
        wait_until(
            lambda: (
                "plain text"
                in str(router.http.get("/workers").json()["process"]["sync"]["last_error"])
            ),
            20,
            "the refusal in /workers",
        )
        sync = router.http.get("/workers").json()["process"]["sync"]
        assert sync["connected"] is False and sync["tls"] is True
        assert "refusing to connect in plain text" in sync["last_error"]
        assert router.post("/route", {"input_ids": list(range(16))}).status_code == 200
    finally:
        router.stop()
    assert re.search(r"ERROR.*NATS tls://127\.0\.0\.1:\d+: .*plain text", router.stderr), (
        router.stderr
    )


@pytest.mark.slow
def test_tls_connects_with_the_ca_bundle_and_not_without_it(pki: Pki) -> None:
    """A server with a certificate of a private CA: ``--sync-ca-certs`` with that CA
    connects, and notes flow over TLS; the system's trust store refuses the certificate."""
    server = NatsServer(extra=("--tls", "--tlscert", pki.server_cert, "--tlskey", pki.server_key))

    async def main() -> None:
        trusted = SyncSecurity(ca_certs=pki.ca)
        a = LoadNotes(
            Router(block_size=16),
            "a",
            [NatsNoteTransport(tls_url(server), "t.ca", security=trusted, reconnect_wait=0.2)],
        )
        rb = Router(block_size=16)
        rb.add_holder(H)
        b = LoadNotes(
            rb,
            "b",
            [NatsNoteTransport(server.url, "t.ca", security=trusted, reconnect_wait=0.2)],
        )
        stranger = NatsNoteTransport(tls_url(server), "t.ca", reconnect_wait=0.2)
        stranger.publish_as("c")
        a.router.add_holder(H)
        a.start()
        b.start()
        stranger.start(lambda raw, origin: None)
        try:
            await until(lambda: link_of(a).connected and link_of(b).connected, 10, "a and b")
            assert link_of(b).require_tls  # a TLS option makes a nats:// URL TLS-only too
            a.router.begin(a.router.route(list(range(64))))
            await until(lambda: b.remote_inflight == 1, 10, "a's request on b")
            await until(
                lambda: "CERTIFICATE_VERIFY_FAILED" in str(stranger.last_error),
                10,
                "the untrusted server refused",
            )
            assert not stranger.connected
        finally:
            await a.close()
            await b.close()
            await stranger.close()

    try:
        asyncio.run(main())
    finally:
        server.kill()


@pytest.mark.slow
def test_a_server_requiring_client_certificates_admits_the_certificate_holder(
    pki: Pki,
) -> None:
    """``--tlsverify``: without a client certificate the replica is refused; with
    ``--sync-certfile``/``--sync-keyfile`` of the server's CA it connects."""
    server = NatsServer(
        extra=(
            "--tlsverify",
            "--tlscert",
            pki.server_cert,
            "--tlskey",
            pki.server_key,
            "--tlscacert",
            pki.ca,
        )
    )

    async def main() -> None:
        without = NatsNoteTransport(
            tls_url(server), "t.mtls", security=SyncSecurity(ca_certs=pki.ca), reconnect_wait=0.2
        )
        holder = SyncSecurity(ca_certs=pki.ca, certfile=pki.client_cert, keyfile=pki.client_key)
        with_cert = NatsNoteTransport(
            tls_url(server), "t.mtls", security=holder, reconnect_wait=0.2
        )
        for i, link in enumerate((without, with_cert)):
            link.publish_as(f"r{i}")
            link.start(lambda raw, origin: None)
        try:
            await until(lambda: with_cert.connected, 10, "the certificate holder")
            await until(lambda: without.last_error is not None, 10, "the refusal")
            assert not without.connected
        finally:
            await without.close()
            await with_cert.close()

    try:
        asyncio.run(main())
    finally:
        server.kill()


# --- credentials --------------------------------------------------------------------------


@pytest.mark.slow
def test_credentials_from_a_file_and_the_environment_work_and_are_never_shown(
    engine: Engine, fleet: NatsServer, pki: Pki, tmp_path: Path
) -> None:
    """Two ``kvevents router`` replicas under the documented configuration, router-a with
    its password in a file, router-b in ``$KVEVENTS_SYNC_PASSWORD``: both join, a request
    through one counts on the other, and neither password shows in ``/workers`` or in the
    logs, which warn of nothing."""
    password_file = tmp_path / "router-a.password"
    password_file.write_text(PASSWORDS["router-a"] + "\n")
    common = ("--sync", tls_url(fleet), "--sync-ca-certs", pki.ca, "--sync-subject", GROUP)
    a = RouterProc(
        [engine.url],
        *common,
        "--sync-name",
        "router-a",
        "--sync-user",
        "router-a",
        "--sync-password-file",
        str(password_file),
    )
    b = RouterProc(
        [engine.url],
        *common,
        "--sync-name",
        "router-b",
        "--sync-user",
        "router-b",
        env={SYNC_PASSWORD_ENV: PASSWORDS["router-b"]},
    )
    try:
        wait_until(
            lambda: all(
                r.http.get("/workers").json()["process"]["sync"]["connected"] for r in (a, b)
            ),
            20,
            "both replicas on NATS",
        )
        sync = a.http.get("/workers").json()["process"]["sync"]
        assert (sync["auth"], sync["tls"]) == ("user", True)
        assert sync["publish_subject"] == f"{GROUP}.router-a"
        answer = a.post("/generate", {"input_ids": list(range(16)), "max_new_tokens": 2})
        assert answer.status_code == 200, answer.text
        wait_until(
            lambda: b.http.get("/workers").json()["process"]["notes"]["received"] == 2,
            20,
            "a's begin and finish on b",
        )
        for r in (a, b):
            shown = r.http.get("/workers").text
            assert not any(pw in shown for pw in PASSWORDS.values())
    finally:
        a.stop()
        b.stop()
    for r in (a, b):
        assert not any(pw in r.stderr for pw in PASSWORDS.values())
        assert "--sync" not in r.stderr, r.stderr  # no warning about the link


@pytest.mark.slow
def test_a_token_from_the_environment_and_an_nkey_seed_file_sign_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$KVEVENTS_SYNC_TOKEN`` signs in to a server requiring that token (and a wrong one
    is refused); ``--sync-nkey-seed-file`` signs in to a server that knows its public key,
    and a seed it does not know is refused."""
    token = "tok-5e1f0c"
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    (tmp_path / "seed").write_bytes(seed)
    (tmp_path / "other").write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    (tmp_path / "nkey.conf").write_text(f'authorization {{ users = [ {{ nkey: "{public}" }} ] }}\n')
    by_token = NatsServer(extra=("--auth", token))
    by_nkey = NatsServer(extra=("-c", str(tmp_path / "nkey.conf")))

    def from_options(**given: str) -> SyncSecurity:
        options: dict[str, str | None] = {
            name.lstrip("-").replace("-", "_"): None for name in SYNC_OPTIONS
        }
        options.update(given)
        return sync_security(argparse.Namespace(**options))

    async def main() -> None:
        monkeypatch.setenv(SYNC_TOKEN_ENV, token)
        good_token = from_options()
        monkeypatch.setenv(SYNC_TOKEN_ENV, "wrong")
        bad_token = from_options()
        monkeypatch.delenv(SYNC_TOKEN_ENV)
        links = {
            "token": NatsNoteTransport(by_token.url, "t.auth", security=good_token),
            "bad-token": NatsNoteTransport(by_token.url, "t.auth", security=bad_token),
            "nkey": NatsNoteTransport(
                by_nkey.url,
                "t.auth",
                security=from_options(sync_nkey_seed_file=str(tmp_path / "seed")),
            ),
            "bad-nkey": NatsNoteTransport(
                by_nkey.url,
                "t.auth",
                security=from_options(sync_nkey_seed_file=str(tmp_path / "other")),
            ),
        }
        for name, link in links.items():
            link.reconnect_wait = 0.2
            link.publish_as(name)
            link.start(lambda raw, origin: None)
        try:
            await until(lambda: links["token"].connected, 10, "the token")
            await until(lambda: links["nkey"].connected, 10, "the nkey")
            for refused in (links["bad-token"], links["bad-nkey"]):
                await until(
                    lambda: "authorization violation" in str(refused.last_error).lower(),  # noqa: B023 - awaited here
                    10,
                    "a wrong secret refused",
                )
                assert not refused.connected
            assert links["token"].status()["auth"] == "token"
            assert token not in str(links["token"].status())
        finally:
            for link in links.values():
                await link.close()

    try:
        asyncio.run(main())
    finally:
        by_token.kill()
        by_nkey.kill()


# --- options ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_creds_file_signs_in_under_decentralised_auth(tmp_path: Path) -> None:
    """``--sync-creds-file``: a server trusting an operator admits the replica whose
    ``.creds`` its account signed, and notes flow on the subjects the JWT grants; a
    ``.creds`` signed by an account the server does not know is refused."""
    conf, creds, stranger = operator_mode(tmp_path, "t.jwt.router-c", "t.jwt.*")
    server = NatsServer(extra=("-c", str(conf)))

    async def main() -> None:
        rb = Router(block_size=16)
        rb.add_holder(H)
        c = LoadNotes(
            Router(block_size=16),
            sender_id("router-c", "1"),
            [NatsNoteTransport(server.url, "t.jwt", security=SyncSecurity(creds_file=str(creds)))],
        )
        b = LoadNotes(
            rb,
            sender_id("router-b", "1"),
            [NatsNoteTransport(server.url, "t.jwt", security=SyncSecurity(creds_file=str(creds)))],
        )
        refused = NatsNoteTransport(
            server.url, "t.jwt", security=SyncSecurity(creds_file=str(stranger)), reconnect_wait=0.2
        )
        refused.publish_as("router-d")
        c.router.add_holder(H)
        c.start()
        b.start()
        refused.start(lambda raw, origin: None)
        try:
            await until(lambda: link_of(c).connected and link_of(b).connected, 10, "c and b")
            assert link_of(c).status()["auth"] == "creds"
            c.router.begin(c.router.route(list(range(64))))
            await until(lambda: b.remote_inflight == 1, 10, "c's request on b")
            await until(
                lambda: "authorization violation" in str(refused.last_error).lower(),
                10,
                "the stranger refused",
            )
            assert not refused.connected
        finally:
            await c.close()
            await b.close()
            await refused.close()

    try:
        asyncio.run(main())
    finally:
        server.kill()
