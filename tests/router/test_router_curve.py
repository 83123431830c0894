"""CURVE end to end: `kvevents engine` with CURVE keys, `kvevents router` and `kvevents
watch` with a key pair (the server key from /server_info, or given), and without one."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from router_support import KV_CONFIG, Engine, RouterProc, wait_until

PAGE = 4
pytestmark = pytest.mark.slow


def keygen(directory: Path, name: str) -> str:
    """Run `kvevents keygen`; the public key it prints."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvevents.cli.main",
            "keygen",
            "--dir",
            str(directory),
            "--name",
            name,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert f"{directory / name}.key_secret" in done.stdout
    return done.stdout.rsplit("public-key = ", 1)[1].strip()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    base = tmp_path_factory.mktemp("curve")
    allowed = base / "allowed"
    allowed.mkdir()
    return {
        "base": base,
        "engine": keygen(base, "engine"),
        "router": keygen(allowed, "router"),  # its NAME.key sits in the allowed directory
        "stranger": keygen(base, "stranger"),
        "allowed": allowed,
    }


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine], keys: dict[str, Path | str]) -> Engine:
    config = KV_CONFIG | {
        "curve_secret_key_file": f"{keys['base']}/engine.key_secret",
        "curve_allowed_keys_dir": str(keys["allowed"]),
    }
    return make_engine(["--dp-size", "2", "--page-size", str(PAGE)], config)


def test_the_engine_advertises_its_public_key(engine: Engine, keys: dict[str, Path | str]) -> None:
    """/server_info's kv_events block carries the publishers' CURVE public key, never the secret."""
    info = engine.server_info()
    assert info["kv_events"]["curve_public_key"] == keys["engine"]
    assert "secret" not in json.dumps(info["kv_events"])


def test_a_router_with_an_allowed_key_fills_its_index(
    engine: Engine, keys: dict[str, Path | str]
) -> None:
    """The router's key pair is allowed and the server key comes from /server_info: the index fills."""
    router = RouterProc(
        [engine.url], "--curve-secret-key-file", f"{keys['allowed']}/router.key_secret"
    )
    try:
        wait_until(lambda: router.connected() == 2, 20, "both streams connected")
        prompt = list(range(500, 516))
        engine.generate(prompt, rank=1)

        def indexed() -> bool:
            matches = router.post("/query", {"input_ids": [*prompt, 0]}).json()["matches"]
            return any(m["dp_rank"] == 1 and m["matched_tokens"] == len(prompt) for m in matches)

        wait_until(indexed, 20, "rank 1's blocks in the router's index")
        streams = router.http.get("/workers").json()["streams"]
        assert all(s["curve"] and s["handshake_failures"] == 0 for s in streams)
    finally:
        router.stop()


@pytest.mark.parametrize("key", ["stranger", None])
def test_a_router_with_a_refused_or_no_key_says_why_and_indexes_nothing(
    engine: Engine, keys: dict[str, Path | str], key: str | None
) -> None:
    """An unknown key, or none: /workers shows every stream "refused" with the reason, the
    engine's /load counts the refusals, and the index stays empty."""
    before = sum(r["curve_refused"] for r in engine.http.get("/load").json()["ranks"])
    extra = [] if key is None else ["--curve-secret-key-file", f"{keys['base']}/{key}.key_secret"]
    router = RouterProc([engine.url], *extra)
    try:
        seen: list[list[dict[str, object]]] = [[]]

        def refused() -> bool:
            seen[0] = router.http.get("/workers").json()["streams"]
            return len(seen[0]) == 2 and all(s["status"] == "refused" for s in seen[0])

        try:  # 40 s: past ZeroMQ's 30 s handshake timeout, should a handshake stall once
            wait_until(refused, 40, "both streams refused")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; /workers streams last: {seen[0]}") from None
        streams = seen[0]
        expected = "has no key pair" if key is None else "refused this subscriber's key"
        assert all(expected in s["handshake_error"] for s in streams), streams
        prompt = list(range(600, 616))
        engine.generate(prompt, rank=0)
        wait_until(
            lambda: (
                sum(r["curve_refused"] for r in engine.http.get("/load").json()["ranks"]) > before
            ),
            20,
            "the engine counting refused handshakes",
        )
        answer = router.post("/query", {"input_ids": [*prompt, 0]})
        assert answer.status_code == 200, answer.text
        assert all(m["matched_tokens"] == 0 for m in answer.json()["matches"])
    finally:
        router.stop()


def test_watch_follows_an_endpoint_with_the_given_server_key(
    engine: Engine, keys: dict[str, Path | str]
) -> None:
    """kvevents watch --endpoint with --curve-server-key and its key pair prints the batches."""
    publisher = engine.server_info()["kv_events"]["publishers"][0]
    endpoint = publisher["endpoint"].replace("*", "127.0.0.1")
    engine.generate(list(range(700, 716)), rank=0)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvevents.cli.main",
            "watch",
            "--endpoint",
            endpoint,
            "--replay-endpoint",
            publisher["replay_endpoint"].replace("*", "127.0.0.1"),
            f"--curve-server-key={keys['engine']}",  # a Z85 key may start with "-"
            "--curve-secret-key-file",
            f"{keys['allowed']}/router.key_secret",
            "--jsonl",
            "--count",
            "1",
            "--duration",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    first = json.loads(done.stdout.splitlines()[0])
    assert first["seq"] == 0 and first["events"]


def test_an_inline_secret_key_is_never_served(keys: dict[str, Path | str]) -> None:
    """An engine given its secret inline (`curve_secret_key`) runs with it, and /server_info
    shows the config with the secret hidden and the public key advertised."""
    secret_file = Path(keys["base"]) / "engine.key_secret"
    secret = next(
        line.split("=", 1)[1].strip().strip('"')
        for line in secret_file.read_text().splitlines()
        if line.strip().startswith("secret-key")
    )
    config = KV_CONFIG | {
        "curve_secret_key": secret,
        "curve_allowed_keys_dir": str(keys["allowed"]),
    }
    eng = Engine(["--dp-size", "1", "--page-size", str(PAGE)], config)
    try:
        info = eng.server_info()
        assert secret not in json.dumps(info)
        assert json.loads(info["kv_events_config"])["curve_secret_key"] == "(hidden)"
        assert info["kv_events"]["curve_public_key"] == keys["engine"]
    finally:
        eng.stop()
