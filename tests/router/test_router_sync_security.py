"""A load note on the replicas' NATS bus speaks only for the replica whose subject it came
on, and claims no more than one request carries (docs/security.md); the ``--sync``
security options are checked at start. Against a real ``nats-server``, under the very
configuration docs/security.md shows."""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from typing import Any

import msgspec
import nats
import nats.errors
import pytest
from nats_support import NatsServer
from router_support import Engine, RouterProc, wait_until
from sync_security_support import (
    GROUP,
    PASSWORDS,
    Pki,
    tls_url,
    until,
)

from kvevents import Holder, Router
from kvevents.errors import ConfigError
from kvevents.router.fleet import peers
from kvevents.router.fleet.nats_sync import NatsNoteTransport, default_subject
from kvevents.router.fleet.peers import LoadNote, LoadNotes
from kvevents.router.fleet.senders import sender_id
from kvevents.router.fleet.sync_security import SyncSecurity
from process_support import run_kvevents

DP = 2  # the ranks of the shared `engine` (tests/conftest.py)
H = Holder("http://engine", 0)


def replica(name: str, server: NatsServer, pki: Pki, *, user: str | None = None) -> LoadNotes:
    """An in-process replica ``name`` of the documented group, signed in as ``user``."""
    user = user or name
    security = SyncSecurity(user=user, password=PASSWORDS[user], ca_certs=pki.ca)
    link = NatsNoteTransport(tls_url(server), GROUP, security=security, reconnect_wait=0.2)
    router = Router(block_size=16)
    router.add_holder(H)
    return LoadNotes(router, sender_id(name, f"1-{time.time_ns()}"), [link], ttl=60.0)


def link_of(notes: LoadNotes) -> NatsNoteTransport:
    link = notes.transports[0]
    assert isinstance(link, NatsNoteTransport)
    return link


def note(sender: str, kind: str, ticket: int, **numbers: Any) -> bytes:
    fields: dict[str, Any] = {"n_blocks": 4, "inflight_blocks": 4.0, "dp_rank": 0}
    fields.update(numbers)
    return msgspec.msgpack.encode(
        LoadNote(
            sender,
            kind,  # type: ignore[arg-type]
            H.worker,
            fields["dp_rank"],
            ticket,
            fields["n_blocks"],
            fields["inflight_blocks"],
            60.0,
        )
    )


# --- who may speak ------------------------------------------------------------------------


@pytest.mark.slow
def test_the_documented_configuration_lets_no_one_speak_for_another_replica(
    fleet: NatsServer, pki: Pki
) -> None:
    """Under docs/security.md's configuration a client without credentials cannot connect;
    a holder of router-b's credentials cannot publish on router-a's subject (NATS refuses),
    and what it publishes on its own subject in router-a's name (a hello, a later run of
    router-a, a begin) is counted forged and changes nothing: router-a's requests stay in
    flight on router-b. The same holder's notes in its own name count."""
    tls = ssl.create_default_context(cafile=pki.ca)

    async def main() -> None:
        with pytest.raises((nats.errors.Error, OSError)):
            await nats.connect(tls_url(fleet), tls=tls, allow_reconnect=False, connect_timeout=5)
        a, b = replica("router-a", fleet, pki), replica("router-b", fleet, pki)
        refused: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            refused.append(exc)

        mallory = await nats.connect(
            tls_url(fleet),
            tls=tls,
            user="router-b",
            password=PASSWORDS["router-b"],
            allow_reconnect=False,
            connect_timeout=5,
            error_cb=on_error,
        )
        a.start()
        b.start()
        try:
            await until(lambda: link_of(a).connected and link_of(b).connected, 10, "A and B")
            tickets = [a.router.begin(a.router.route(list(range(64)))) for _ in range(3)]
            await until(lambda: b.remote_inflight == 3, 10, "A's 3 requests on B")
            own = f"{GROUP}.router-b"
            later_run = sender_id("router-a", f"2-{time.time_ns() + 10**12}")
            for raw in (
                note(a.sender, "hello", 0, n_blocks=0, inflight_blocks=0.0),
                note(later_run, "routed", -1),
                note(a.sender, "finish", tickets[0].id),
            ):
                await mallory.publish(own, raw)
            await mallory.flush(timeout=5)
            await until(lambda: b.forged == 3, 10, "the 3 notes in A's name counted forged on B")
            assert (b.remote_inflight, b.reset, b.superseded) == (3, 0, 0)
            await until(lambda: a.forged == 3, 10, "and on A")

            received = a.received
            await mallory.publish(f"{GROUP}.router-a", note(a.sender, "hello", 0))
            await mallory.publish(own, note(sender_id("router-b", "m"), "begin", 9))
            await mallory.flush(timeout=5)
            # NATS keeps one connection's order: the next note is heard after the refused one
            await until(lambda: a.remote_inflight == 1, 10, "mallory's own begin on A")
            assert a.received == received + 1 and a.forged == 3
            await until(lambda: bool(refused), 10, "NATS refusing the publish on A's subject")
            assert "permissions violation" in str(refused[0]).lower()
            # on B, router-b's own subject carries a process that is not B: forged too
            await until(lambda: b.forged == 4, 10, "mallory's note on B")
            assert b.remote_inflight == 3 and b.reset == 0
        finally:
            await mallory.close()
            await a.close()
            await b.close()

    asyncio.run(main())


def test_a_replica_has_at_most_max_peer_inflight_requests_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A begin past the bound of requests in flight per replica (all its processes) is
    malformed (oversized) and not counted; once one of them finishes, a begin counts again."""
    monkeypatch.setattr(peers, "MAX_PEER_INFLIGHT", 3)
    router = Router(block_size=16)
    router.add_holder(H)
    notes = LoadNotes(router, "me", [], ttl=60.0)
    for process, ticket in ((0, 1), (1, 1), (0, 2), (1, 2)):
        notes.apply(
            msgspec.msgpack.decode(note(f"far/{process}#r", "begin", ticket), type=LoadNote)
        )
    assert (notes.remote_inflight, notes.malformed, notes.oversized) == (3, 1, 1)
    notes.apply(msgspec.msgpack.decode(note("far/0#r", "finish", 1), type=LoadNote))
    notes.apply(msgspec.msgpack.decode(note("far/1#r", "begin", 2), type=LoadNote))
    assert (notes.remote_inflight, notes.malformed) == (3, 1)
    notes.apply(msgspec.msgpack.decode(note("near#r", "begin", 1), type=LoadNote))
    assert notes.remote_inflight == 4  # another replica has its own bound


@pytest.mark.slow
def test_notes_claiming_more_than_a_request_carries_are_malformed_and_move_no_route(
    engine: Engine, plain: NatsServer
) -> None:
    """With --max-body-bytes 4096 (so at most 4,096 tokens, 1,024 blocks of 4, a request):
    a begin of 10**12 blocks, a routed note of 10**6 and a rank past 65,535 are counted
    malformed and oversized, and every fresh prompt goes where it went before; a begin of
    500 blocks, within the bound, does move them. The router, whose bus has no
    credentials, warned so at start."""
    router = RouterProc([engine.url], "--sync", plain.url, "--max-body-bytes", "4096")
    subject = default_subject([engine.url]) + ".peer"
    prompts = [[7000 + 16 * i + j for j in range(12)] for i in range(8)]

    def routes() -> list[int]:
        answers = [router.post("/route", {"input_ids": p}) for p in prompts]
        assert all(r.status_code == 200 for r in answers), answers[0].text
        return [int(r.json()["dp_rank"]) for r in answers]

    def notes() -> dict[str, int]:
        counts: dict[str, int] = router.http.get("/workers").json()["process"]["notes"]
        return counts

    async def publish(*raws: bytes) -> None:
        nc = await nats.connect(plain.url, connect_timeout=5, max_reconnect_attempts=0)
        try:
            for raw in raws:
                await nc.publish(subject, raw)
            await nc.flush(timeout=5)
        finally:
            await nc.close()

    def holder_note(kind: str, ticket: int, **numbers: Any) -> bytes:
        raw = msgspec.msgpack.decode(note("peer", kind, ticket, **numbers), type=LoadNote)
        return msgspec.msgpack.encode(msgspec.structs.replace(raw, worker=engine.url))

    try:
        wait_until(
            lambda: (
                router.connected() == DP
                and router.http.get("/workers").json()["process"]["sync"]["connected"]
            ),
            30,
            "the streams and NATS",
        )
        before = routes()
        busy = before[0]
        asyncio.run(
            publish(
                holder_note("begin", 1, dp_rank=busy, inflight_blocks=1e12, n_blocks=1),
                holder_note("routed", -1, dp_rank=busy, n_blocks=10**6, inflight_blocks=0.0),
                holder_note("begin", 2, dp_rank=70_000),
            )
        )
        wait_until(lambda: notes()["malformed"] == 3, 20, "the 3 oversized notes")
        assert notes()["oversized"] == 3 and notes()["peer_inflight"] == 0
        assert routes() == before

        asyncio.run(publish(holder_note("begin", 3, dp_rank=busy, inflight_blocks=500.0)))
        wait_until(lambda: notes()["peer_inflight"] == 1, 20, "the begin within the bound")
        assert busy not in routes()  # the control: a claim within the bound does steer
    finally:
        router.stop()
    assert "the NATS link has no credentials" in router.stderr


# --- TLS ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ({"user": "u"}, "--sync-user needs a password"),
        ({"password": "p"}, "a NATS password needs --sync-user"),
        ({"user": "u", "password": "p", "token": "t"}, "give one kind of NATS credentials"),
        ({"certfile": "c.pem"}, "--sync-certfile needs --sync-keyfile"),
        ({"ca_certs": "/nonexistent/ca.pem"}, "--sync-ca-certs /nonexistent/ca.pem cannot be read"),
        ({"nkey_seed_file": "/nonexistent/seed"}, "--sync-nkey-seed-file /nonexistent/seed"),
    ],
)
def test_sync_credentials_and_tls_options_are_checked_as_they_are_read(
    given: dict[str, str], problem: str
) -> None:
    """Half a pair, two kinds of credentials or an unreadable file fail at start, naming
    the option; the message never holds the secret."""
    with pytest.raises(ConfigError, match=re.escape(problem)) as refused:
        SyncSecurity(**given)
    assert "p'" not in str(refused.value) and "secret" not in str(refused.value)


def test_credentials_both_in_the_url_and_in_options_are_refused() -> None:
    """Credentials in the URL and in the options both: refused, naming neither secret."""
    security = SyncSecurity(user="u", password="hunter2")
    with pytest.raises(ConfigError, match="give them once") as refused:
        NatsNoteTransport("nats://x:urlsecret@127.0.0.1:4222", "t.x", security=security)
    assert "urlsecret" not in str(refused.value) and "hunter2" not in str(refused.value)
    assert "hunter2" not in repr(security)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--sync-user", "u"], "--sync-user needs --sync NATS_URL"),
        (["--sync", "nats://127.0.0.1:4222", "--sync-name", "a.b"], "--sync-name 'a.b'"),
        (
            ["--sync", "nats://127.0.0.1:4222", "--sync-password-file", "/nonexistent/pw"],
            "--sync-password-file /nonexistent/pw cannot be read",
        ),
    ],
)
def test_kvevents_router_refuses_bad_sync_options_before_starting(
    argv: list[str], problem: str
) -> None:
    """The command exits 2 with one line naming the option, before following any engine."""
    done = run_kvevents("router", "--engine", "http://127.0.0.1:9", *argv)
    assert done.returncode == 2, done.stderr
    assert f"kvevents router: error: {problem}" in done.stderr
    assert "Traceback" not in done.stderr
