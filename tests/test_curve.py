"""CURVE: key files, config checks, and encrypted streams between the real publisher and
the real Subscriber (live and replay), with wrong, missing and unknown keys refused."""

from __future__ import annotations

import argparse
import errno
import http.server
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from kvevents import (
    BlockStored,
    ConfigError,
    CurveKeyPair,
    Delivery,
    DiscoveryError,
    EventPublisherFactory,
    Holder,
    KVEventBatch,
    KVEventsConfig,
    StreamSpec,
    Subscriber,
    Unreachable,
    ZmqEventPublisher,
)
from kvevents.cli.engine_args import (
    add_engine_arguments,
    curve_options,
    endpoint_specs,
    engine_specs,
)
from kvevents.engine.server_info import BoundPublisher, kv_events_block
from kvevents.subscribe import curve_client
from kvevents.subscribe.server_info import streams_from_server_info
from kvevents.subscribe.stats import StreamStatus
from kvevents.transport import curve_keys
from kvevents.transport.curve_keys import load_public_key_file, load_public_keys_dir, write_key_pair
from kvevents.wire.server_info import kv_events_block_to_builtins
from subscriber_support import collect, deliveries, signals, wait_for


def batch(n: int) -> KVEventBatch:
    return KVEventBatch(
        ts=1.0 + n,
        events=[
            BlockStored(
                block_hashes=[n],
                parent_block_hash=None,
                token_ids=[n, n + 1],
                block_size=2,
                lora_id=None,
                medium=None,
            )
        ],
    )


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """Key pairs of a server, an allowed client and a stranger, as kvevents keygen writes them."""
    out: dict[str, Path] = {}
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name in ("server", "client", "stranger"):
        _, secret, _ = write_key_pair(tmp_path, name)
        out[name] = secret
    public_client, _, _ = write_key_pair(allowed, "client2")
    out["allowed_dir"] = allowed
    out["client2"] = allowed / "client2.key_secret"
    out["client2_public"] = public_client
    return out


# --- keys and key files -----------------------------------------------------------------


def test_keygen_files_round_trip_and_the_secret_file_is_private(tmp_path: Path) -> None:
    """write_key_pair writes NAME.key and NAME.key_secret (0600) that load back, also with zmq.auth."""
    public_path, secret_path, pair = write_key_pair(tmp_path, "router")
    assert (public_path.name, secret_path.name) == ("router.key", "router.key_secret")
    assert stat.S_IMODE(os.stat(secret_path).st_mode) == 0o600
    assert CurveKeyPair.load(secret_path, "test") == pair
    assert load_public_key_file(public_path, "test") == pair.public
    assert zmq.auth.load_certificate(secret_path) == (pair.public.encode(), pair.secret.encode())
    assert zmq.auth.load_certificate(public_path) == (pair.public.encode(), None)
    assert CurveKeyPair.from_secret(pair.secret, "test") == pair
    assert pair.secret not in repr(pair)


def test_keygen_refuses_to_overwrite_unless_forced(tmp_path: Path) -> None:
    """An existing pair is kept unless force=True, which writes a new one."""
    _, secret_path, first = write_key_pair(tmp_path, "k")
    with pytest.raises(ConfigError, match=r"already exist.*--force"):
        write_key_pair(tmp_path, "k")
    assert CurveKeyPair.load(secret_path, "test") == first
    _, _, second = write_key_pair(tmp_path, "k", force=True)
    assert second != first and CurveKeyPair.load(secret_path, "test") == second
    assert stat.S_IMODE(os.stat(secret_path).st_mode) == 0o600


@pytest.mark.parametrize("failing", ["k.key", "k.key_secret"])
def test_keygen_that_fails_midway_leaves_the_old_pair_whole(
    tmp_path: Path, failing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replacement whose writing fails (here: the disk is full as one of the two new
    files is written) keeps the old public and secret files as they were, and leaves no
    temporary behind. Before, the public file was replaced first, so a failure writing
    the secret one left a new public key beside the old secret."""
    public_path, secret_path, first = write_key_pair(tmp_path, "k")
    old_public = public_path.read_bytes()
    real = curve_keys._written_beside

    def full_disk(path: Path, text: str, mode: int) -> Path:
        written = real(path, text, mode)
        if path.name == failing:
            written.unlink()
            raise OSError(errno.ENOSPC, "No space left on device")
        return written

    monkeypatch.setattr(curve_keys, "_written_beside", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_key_pair(tmp_path, "k", force=True)
    assert public_path.read_bytes() == old_public
    assert CurveKeyPair.load(secret_path, "test") == first
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["k.key", "k.key_secret"]


def test_a_public_key_file_is_not_a_secret_key_file(tmp_path: Path) -> None:
    """Loading NAME.key as a key pair says to give NAME.key_secret."""
    public_path, _, _ = write_key_pair(tmp_path, "k")
    with pytest.raises(ConfigError, match=r"only a public key.*key_secret"):
        CurveKeyPair.load(public_path, "the file")


def test_public_keys_dir_reads_every_key_file(tmp_path: Path) -> None:
    """A directory of NAME.key files gives their public keys (secret files are not read twice)."""
    pairs = [write_key_pair(tmp_path, name)[2] for name in ("a", "b")]
    assert sorted(load_public_keys_dir(tmp_path, "dir")) == sorted(p.public for p in pairs)


# --- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"curve_secret_key": "short"},
            r"'curve_secret_key' is not a CURVE secret key: it has 5 characters, a key has 40.*kvevents keygen",
        ),
        (
            {"curve_secret_key_file": "/nonexistent/s.key_secret"},
            r"'curve_secret_key_file' '/nonexistent/s.key_secret' is not a file.*kvevents keygen",
        ),
        (
            {"curve_allowed_keys": ["x" * 39]},
            r"'curve_allowed_keys'\[0\] 'xxx.*' is not a CURVE public key: it has 39 characters",
        ),
        ({"curve_allowed_keys": ["~" * 40]}, r"characters outside Z85: '~'"),
        (
            {"curve_allowed_keys_dir": "/nonexistent"},
            r"'curve_allowed_keys_dir' '/nonexistent' is not a directory",
        ),
    ],
)
def test_bad_curve_keys_are_refused_naming_the_key(
    keys: dict[str, Path], extra: dict[str, object], message: str
) -> None:
    """A malformed key or a missing file is a ConfigError naming the config key and kvevents keygen."""
    config: dict[str, object] = {
        "publisher": "zmq",
        "curve_secret_key_file": str(keys["server"]),
        "curve_allowed_keys": [CurveKeyPair.load(keys["client"], "t").public],
    }
    config.update(extra)
    if "curve_secret_key" in extra:
        del config["curve_secret_key_file"]
    with pytest.raises(ConfigError, match=message):
        KVEventsConfig.from_dict(config)


def test_curve_config_needs_both_a_key_pair_and_allowed_subscribers(keys: dict[str, Path]) -> None:
    """A secret key alone, allowed keys alone, or both secret forms are refused with the fix."""
    secret = CurveKeyPair.load(keys["server"], "t").secret
    with pytest.raises(ConfigError, match=r"no allowed subscribers.*curve_allowed_keys"):
        KVEventsConfig.from_dict({"publisher": "zmq", "curve_secret_key_file": str(keys["server"])})
    with pytest.raises(ConfigError, match=r"no publisher key.*curve_secret_key_file"):
        KVEventsConfig.from_dict(
            {"publisher": "zmq", "curve_allowed_keys_dir": str(keys["allowed_dir"])}
        )
    with pytest.raises(ConfigError, match="both 'curve_secret_key' and 'curve_secret_key_file'"):
        KVEventsConfig.from_dict(
            {
                "curve_secret_key": secret,
                "curve_secret_key_file": str(keys["server"]),
                "curve_allowed_keys": [],
            }
        )


def test_an_inline_secret_never_shows_in_its_error() -> None:
    """A secret key with a bad character is refused without echoing it."""
    bad = "~" + "a" * 39
    with pytest.raises(ConfigError) as info:
        KVEventsConfig.from_dict({"curve_secret_key": bad, "curve_allowed_keys": []})
    assert bad not in str(info.value)


# --- encrypted streams --------------------------------------------------------------------


@pytest.fixture
def curve_publisher(keys: dict[str, Path], zmq_context: zmq.Context) -> Iterator[ZmqEventPublisher]:
    """A CURVE publisher on OS-chosen loopback ports that allows "client" and the directory's keys."""
    pub = EventPublisherFactory.create(
        {
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:0",
            "replay_endpoint": "tcp://127.0.0.1:0",
            "bind": True,
            "curve_secret_key_file": str(keys["server"]),
            "curve_allowed_keys": [CurveKeyPair.load(keys["client"], "t").public],
            "curve_allowed_keys_dir": str(keys["allowed_dir"]),
        },
        context=zmq_context,
    )
    assert isinstance(pub, ZmqEventPublisher)
    yield pub
    pub.shutdown(timeout=1.0)


def _spec(pub: ZmqEventPublisher, server_key: str | None) -> StreamSpec:
    assert pub.replay_endpoint is not None
    return StreamSpec.from_endpoint(
        pub.endpoint, replay_endpoint=pub.replay_endpoint, worker="w", curve_server_key=server_key
    )


@pytest.mark.parametrize("client", ["client", "client2"])
def test_an_allowed_key_receives_replay_then_live(
    curve_publisher: ZmqEventPublisher, keys: dict[str, Path], client: str
) -> None:
    """An allowed subscriber (listed, or in the directory) gets what was published before it joined by replay, then live."""
    pub = curve_publisher
    assert pub.curve_public_key == CurveKeyPair.load(keys["server"], "t").public
    for n in range(20):
        pub.publish(batch(n))
    assert pub.flush(timeout=10.0)  # sent before the subscriber exists: only replay has them
    pair = CurveKeyPair.load(keys[client], "t")
    with Subscriber(streams=[_spec(pub, pub.curve_public_key)], curve_key_pair=pair) as sub:
        items = collect(sub, until=lambda got: len(deliveries(got)) == 20)
        for n in range(20, 30):
            pub.publish(batch(n))
        items += collect(sub, until=lambda got: len(deliveries(got)) == 10)
        assert [d.seq for d in deliveries(items)] == list(range(30))
        assert signals(items) == []
        stats = sub.stats()[Holder("w", 0)]
        assert stats.replayed >= 20 and stats.curve and stats.status == StreamStatus.CONNECTED
        assert stats.handshake_failures == 0 and stats.handshake_error is None
    assert pub.stats.curve_handshakes >= 2  # live and replay
    assert pub.stats.curve_refused == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("unknown key", "refused this subscriber's key"),
        ("wrong server key", "did not complete"),
        ("no key pair", "has no key pair"),
        ("no CURVE", "has no server key"),
    ],
)
def test_refused_subscribers_get_nothing_and_both_sides_say_so(
    curve_publisher: ZmqEventPublisher,
    keys: dict[str, Path],
    case: str,
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An unknown key, a wrong server key, a missing key pair or no CURVE at all: no batch
    arrives (live or replay), the stream says "refused" and why, the publisher counts it."""
    pub = curve_publisher
    for n in range(5):
        pub.publish(batch(n))
    assert pub.flush(timeout=10.0)
    server_key = pub.curve_public_key
    pair: CurveKeyPair | None = CurveKeyPair.load(keys["client"], "t")
    if case == "unknown key":
        pair = CurveKeyPair.load(keys["stranger"], "t")
    elif case == "wrong server key":
        server_key = CurveKeyPair.load(keys["stranger"], "t").public
    elif case == "no key pair":
        pair = None
    elif case == "no CURVE":
        server_key = None
    caplog.set_level(logging.WARNING, logger="kvevents.publish")
    with Subscriber(
        streams=[_spec(pub, server_key)], curve_key_pair=pair, replay_timeout=0.5
    ) as sub:
        items = collect(
            sub,
            until=lambda got: any(
                isinstance(i, Unreachable) and "handshake refused" in i.reason for i in got
            ),
        )
        refused = next(i for i in items if isinstance(i, Unreachable))
        assert reason in refused.reason
        for n in range(5, 10):
            pub.publish(batch(n))
        assert pub.flush(timeout=10.0)
        # nothing arrives: every receive below times out (bounded), live and replay alike
        items += collect(sub, until=lambda got: sub.stats()[Holder("w", 0)].replay_timeouts >= 1)
        assert deliveries(items) == []
        stats = sub.stats()[Holder("w", 0)]
        assert stats.status == StreamStatus.REFUSED and stats.batches == 0
        assert stats.handshake_failures >= 1 and reason in (stats.handshake_error or "")
    wait_for(lambda: pub.stats.curve_refused >= 1, what="the publisher counting the refusal")
    assert pub.stats.curve_handshakes == 0
    assert any("refused" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
@pytest.mark.parametrize("curve", [True, False], ids=["curve", "plain"])
def test_a_stream_is_not_connected_before_its_handshake(
    keys: dict[str, Path], curve: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TCP listener that accepts and never speaks (an HTTP port given as the endpoint,
    say): a stream to it, CURVE or plain, has a connection but no handshake, so it says
    "connecting", never "connected"; when the handshake times out (10 s, 2 s here) it
    is reported, with what to check."""
    monkeypatch.setattr(curve_client, "HANDSHAKE_TIMEOUT_MS", 2000)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10.0)
    accepted: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True)
    acceptor.start()
    port = listener.getsockname()[1]
    spec = StreamSpec.from_endpoint(
        f"tcp://127.0.0.1:{port}",
        worker="w",
        curve_server_key=CurveKeyPair.load(keys["server"], "t").public if curve else None,
    )
    try:
        with Subscriber(
            streams=[spec], curve_key_pair=CurveKeyPair.load(keys["client"], "t")
        ) as sub:
            acceptor.join(timeout=10.0)
            assert accepted, "the subscriber never connected to the listener"
            seen = set()
            deadline = time.monotonic() + 1.0  # ZeroMQ's monitor reports a connection in ms
            while time.monotonic() < deadline:
                seen.add(sub.stats()[Holder("w", 0)].status)
                time.sleep(0.01)
            assert seen == {StreamStatus.CONNECTING}
            if not curve:  # the handshake's time limit then says what is wrong
                items = collect(sub, until=lambda got: bool(signals(got, "unreachable")))
                (refused,) = signals(items, "unreachable")
                assert "no ZMQ handshake within 2 s" in refused.reason
                assert sub.stats()[Holder("w", 0)].status == StreamStatus.REFUSED
    finally:
        for conn in accepted:
            conn.close()
        listener.close()


def test_plain_publishers_and_subscribers_are_unchanged(
    zmq_context: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """With no CURVE option anywhere (as SGLang and vLLM publish), streams flow in the
    clear; a subscriber that has a key pair says so, once per stream, naming the fix."""
    caplog.set_level(logging.WARNING, logger="kvevents.subscribe")
    pub = ZmqEventPublisher(
        0, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", bind=True, context=zmq_context
    )
    try:
        assert pub.curve_public_key is None
        pub.publish(batch(0))
        assert pub.flush(timeout=10.0)
        pair = CurveKeyPair.generate()  # a key pair alone changes nothing: no server key
        with Subscriber(streams=[_spec(pub, None)], curve_key_pair=pair) as sub:
            items = collect(sub, until=lambda got: len(deliveries(got)) == 1)
            assert deliveries(items)[0].seq == 0
            assert not sub.stats()[Holder("w", 0)].curve
        warned = [r.getMessage() for r in caplog.records if "in the clear" in r.getMessage()]
        assert len(warned) == 1 and "--curve-server-key" in warned[0], warned
        caplog.clear()
        with Subscriber(streams=[_spec(pub, None)]) as sub:  # no key pair: nothing to say
            collect(sub, until=lambda got: len(deliveries(got)) == 1)
        assert not [r for r in caplog.records if "in the clear" in r.getMessage()]
    finally:
        pub.shutdown(timeout=1.0)


def test_curve_over_ipc(keys: dict[str, Path], tmp_path: Path, zmq_context: zmq.Context) -> None:
    """CURVE works over ipc endpoints too."""
    pub = ZmqEventPublisher(
        0,
        f"ipc://{tmp_path}/live",
        f"ipc://{tmp_path}/replay",
        bind=True,
        context=zmq_context,
        curve_secret_key_file=str(keys["server"]),
        curve_allowed_keys=[CurveKeyPair.load(keys["client"], "t").public],
    )
    try:
        pub.publish(batch(0))
        assert pub.flush(timeout=10.0)
        pair = CurveKeyPair.load(keys["client"], "t")
        with Subscriber(streams=[_spec(pub, pub.curve_public_key)], curve_key_pair=pair) as sub:
            items = collect(sub, until=lambda got: len(deliveries(got)) == 1)
            assert deliveries(items)[0].seq == 0
    finally:
        pub.shutdown(timeout=1.0)


def test_publishers_sharing_a_context_share_one_authenticator(
    keys: dict[str, Path], zmq_context: zmq.Context
) -> None:
    """Two ranks in one context, each with its own allowed keys: each serves only its own."""
    client = CurveKeyPair.load(keys["client"], "t")
    stranger = CurveKeyPair.load(keys["stranger"], "t")
    pubs = [
        ZmqEventPublisher(
            rank,
            "tcp://127.0.0.1:0",
            None,
            bind=True,
            context=zmq_context,
            curve_secret_key_file=str(keys["server"]),
            curve_allowed_keys=[allowed.public],
        )
        for rank, allowed in ((0, client), (1, stranger))
    ]
    try:
        specs = [
            StreamSpec.from_endpoint(
                p.endpoint, worker=f"r{p.rank}", curve_server_key=p.curve_public_key
            )
            for p in pubs
        ]
        with Subscriber(streams=specs, curve_key_pair=client) as sub:
            collect(
                sub,
                until=lambda got: any(isinstance(i, Unreachable) and i.worker == "r1" for i in got),
            )

            def delivered() -> bool:
                pubs[0].publish(batch(0))  # live only: repeat until the connection is up
                return sub.get(timeout=0.2) is not None and sub.stats()[Holder("r0", 0)].batches > 0

            wait_for(delivered, what="rank 0's batches")
            assert sub.stats()[Holder("r1", 0)].status == StreamStatus.REFUSED
    finally:
        for p in pubs:
            p.shutdown(timeout=1.0)
    assert pubs[1].stats.curve_refused >= 1 and pubs[0].stats.curve_refused == 0


# --- discovery and the command-line options -------------------------------------------------


def test_discovery_hands_the_advertised_key_to_every_stream() -> None:
    """A kv_events block with curve_public_key gives each rank's StreamSpec that server key;
    an SGLang block (no such field) gives none; a malformed key is a DiscoveryError."""
    key = CurveKeyPair.generate().public
    block = {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "dp_size": 2}
    url = "http://127.0.0.1:30000"
    keyed = streams_from_server_info(
        {"kv_events": block | {"curve_public_key": key}}, engine_url=url
    )
    assert [s.curve_server_key for s in keyed] == [key, key]
    plain = streams_from_server_info({"kv_events": block}, engine_url=url)
    assert [s.curve_server_key for s in plain] == [None, None]
    with pytest.raises(DiscoveryError, match=r"kv_events.curve_public_key 'nope' is not a CURVE"):
        streams_from_server_info(
            {"kv_events": block | {"curve_public_key": "nope"}}, engine_url=url
        )


def test_a_plain_engines_block_encodes_without_a_key() -> None:
    """The engine's block has curve_public_key only when its config has CURVE keys."""
    plain = kv_events_block(
        KVEventsConfig(publisher="zmq", endpoint="tcp://*:5557"),
        [BoundPublisher(0, "tcp://*:5557")],
        1,
        16,
    )
    assert plain is not None
    assert "curve_public_key" not in kv_events_block_to_builtins(plain)


def test_router_and_watch_options_name_keys_per_engine_or_for_all(keys: dict[str, Path]) -> None:
    """--curve-server-key after --engine is that engine's, before any --engine the default;
    --curve-secret-key-file loads the subscriber's pair; a bad key names the option."""
    engine_key = CurveKeyPair.load(keys["server"], "t").public
    default_key = CurveKeyPair.load(keys["stranger"], "t").public
    parser = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_engine_arguments(parser, endpoints=True)
    args = parser.parse_args(
        [
            f"--curve-server-key={default_key}",  # a Z85 key may start with "-"
            "--curve-secret-key-file", str(keys["client"]),
            "--engine", "http://a:1", f"--curve-server-key={engine_key}",
            "--engine", "http://b:1", "--kv-endpoint", "tcp://b:5557",
            "--endpoint", "tcp://c:5557", f"--curve-server-key={engine_key}",
        ]
    )  # fmt: skip
    options = curve_options(args)
    assert options["curve_key_pair"] == CurveKeyPair.load(keys["client"], "t")
    assert options["curve_server_key"] == default_key
    a, b = engine_specs(args)
    assert (a.curve_server_key, b.curve_server_key) == (engine_key, None)
    assert [s.curve_server_key for s in endpoint_specs(args)] == [engine_key]
    with pytest.raises(
        ConfigError, match=r"engine http://a:1: curve_server_key 'x' is not a CURVE"
    ):
        engine_specs(parser.parse_args(["--engine", "http://a:1", "--curve-server-key", "x"]))
    bad = parser.parse_args(["--curve-secret-key-file", str(keys["allowed_dir"])])
    with pytest.raises(ConfigError, match=r"--curve-secret-key-file .* is not a file"):
        curve_options(bad)


@pytest.mark.slow
def test_an_engine_key_reaches_its_discovered_streams(
    keys: dict[str, Path], zmq_context: zmq.Context
) -> None:
    """Subscriber.add_engine(curve_server_key=) keys the streams its /server_info names when
    the block advertises none: an engine key given by hand reaches a real CURVE publisher."""
    server = CurveKeyPair.load(keys["server"], "t")
    client = CurveKeyPair.load(keys["client"], "t")
    pub = ZmqEventPublisher(
        0,
        "tcp://127.0.0.1:0",
        None,
        bind=True,
        context=zmq_context,
        curve_secret_key_file=str(keys["server"]),
        curve_allowed_keys=[client.public],
    )
    port = int(pub.endpoint.rsplit(":", 1)[1])
    info = {"kv_events": {"endpoint_host": "127.0.0.1", "endpoint_port_base": port, "dp_size": 1}}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(info).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with Subscriber(curve_key_pair=client) as sub:
            sub.add_engine(url, curve_server_key=server.public)

            def delivered() -> bool:
                pub.publish(batch(0))  # live only: repeat until the connection is up
                item = sub.get(timeout=0.2)
                return isinstance(item, Delivery)

            wait_for(delivered, what="a batch through the engine's hand-given key")
            assert sub.stats()[Holder(url, 0)].curve
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
        pub.shutdown(timeout=1.0)


def test_a_context_with_a_foreign_zap_handler_is_refused_with_the_fix(
    keys: dict[str, Path], zmq_context: zmq.Context
) -> None:
    """libzmq allows one ZAP handler per context: a CURVE publisher in a context that has
    another one says so and how to fix it."""
    from zmq.auth.thread import ThreadAuthenticator

    foreign = ThreadAuthenticator(zmq_context)
    foreign.start()
    try:
        with pytest.raises(ConfigError, match=r"another ZAP handler.*context of its own"):
            ZmqEventPublisher(
                0,
                "tcp://127.0.0.1:0",
                None,
                bind=True,
                context=zmq_context,
                curve_secret_key_file=str(keys["server"]),
                curve_allowed_keys=[],
            )
    finally:
        foreign.stop()
