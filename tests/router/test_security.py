"""API keys and TLS on both services, with real processes over real HTTP(S).

A `kvevents engine` with ``--api-key`` and a `kvevents router` with its own key and
``--engine-api-key``; a router without the engine key; then both services over HTTPS
(certificates from a throwaway CA), the router with ``--workers 2``.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
from router_support import KV_CONFIG, Engine, RouterProc, wait_until

pytestmark = pytest.mark.slow

ROUTER_KEY = "router-key-Zq81"
ENGINE_KEY = "engine-key-Pw27"
PROMPT = list(range(1000, 1064))  # 4 blocks of 16

ENGINE_PROTECTED = [
    ("POST", "/generate", {"input_ids": [1, 2, 3]}),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("GET", "/kv_blocks?dp_rank=0", None),
    ("POST", "/flush_cache", None),
    ("POST", "/admin/restart_rank?dp_rank=0", None),
    ("GET", "/server_info", None),
    ("GET", "/load", None),
]
ROUTER_PROTECTED = [
    ("POST", "/route", {"input_ids": PROMPT}),
    ("POST", "/query", {"input_ids": PROMPT}),
    ("POST", "/generate", {"input_ids": PROMPT}),
    ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/dump", None),
    ("GET", "/workers", None),
]


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def call(client: httpx.Client, method: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    return client.request(method, path, json=body, **kw)


def assert_refused(response: httpx.Response, path: str, reason: str) -> None:
    assert response.status_code == 401, (path, response.status_code, response.text)
    assert response.headers["www-authenticate"].startswith("Bearer"), path
    error = response.json()["error"]
    if path.startswith("/v1/"):  # OpenAI's error shape
        assert error["type"] == "authentication_error" and error["code"] == 401, path
        error = error["message"]
    assert reason in error, (path, error)


@pytest.fixture(scope="module")
def key_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("keys")
    paths = {}
    for name, key in (("router", ROUTER_KEY), ("engine", ENGINE_KEY)):
        path = folder / name
        path.write_text(key + "\n")
        paths[name] = str(path)
    return paths


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine], key_files: dict[str, str]) -> Engine:
    return make_engine(["--dp-size", "2", "--api-key-file", key_files["engine"]], KV_CONFIG)


@pytest.fixture(scope="module")
def router(
    make_router: Callable[..., RouterProc], engine: Engine, key_files: dict[str, str]
) -> RouterProc:
    return make_router(
        [engine.url],
        "--engine-api-key-file",
        key_files["engine"],
        env={"KVEVENTS_API_KEY": ROUTER_KEY},  # the router's own key from its variable
    )


def listening_hosts(port: int) -> set[str]:
    """The local addresses listening on TCP ``port`` (IPv4, from /proc/net/tcp)."""
    hosts = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            hosts.add(".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return hosts


def test_engine_refuses_every_endpoint_but_health_without_its_key(engine: Engine) -> None:
    """Routing and admin endpoints answer 401 to a missing or wrong key and do nothing; /health stays open."""
    pids = engine.rank_pids()
    assert engine.http.get("/health").status_code == 200
    for method, path, body in ENGINE_PROTECTED:
        assert_refused(call(engine.http, method, path, body), path, "missing API key")
        wrong = call(engine.http, method, path, body, headers=bearer(ROUTER_KEY))
        assert_refused(wrong, path, "wrong API key")
    assert engine.rank_pids() == pids  # the refused restart_rank restarted nothing


def test_engine_answers_with_its_key_and_publishes_on_loopback(engine: Engine) -> None:
    """With the key every endpoint answers; the publishers bind 127.0.0.1 and /server_info says so."""
    key = bearer(ENGINE_KEY)
    response = engine.http.post("/generate", json={"input_ids": [5, 6, 7]}, headers=key)
    assert response.status_code == 200, response.text
    info = engine.http.get("/server_info", headers=key).json()
    block = info["kv_events"]
    assert block["endpoint_host"] == "127.0.0.1"
    for pub in block["publishers"]:
        for endpoint in (pub["endpoint"], pub["replay_endpoint"]):
            assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
            assert listening_hosts(int(endpoint.rsplit(":", 1)[1])) == {"127.0.0.1"}


def test_router_refuses_without_its_key_and_leaves_health_metrics_and_docs_open(
    router: RouterProc,
) -> None:
    """Routing, OpenAI, /dump and /workers answer 401 without the router's key (or with the engine's); the rest stays open."""
    for method, path, body in ROUTER_PROTECTED:
        assert_refused(call(router.http, method, path, body), path, "missing API key")
        wrong = call(router.http, method, path, body, headers=bearer(ENGINE_KEY))
        assert_refused(wrong, path, "wrong API key")
    for path in ("/health", "/metrics", "/openapi.json", "/docs"):
        assert router.http.get(path).status_code == 200, path


def test_router_reaches_the_keyed_engine_with_its_own_key(router: RouterProc) -> None:
    """Discovery, load polling, forwarding and the streams all work against an engine with --api-key.

    The client sends the router's key, which the engine refuses: each 200 shows the
    router sent its engine key instead of the client's header.
    """
    key = bearer(ROUTER_KEY)

    def ready() -> bool:
        workers = router.http.get("/workers", headers=key).json()
        engine = workers["engines"][0]
        connected = sum(s["status"] == "connected" for s in workers["streams"])
        return engine["registered"] and engine["load_error"] is None and connected == 2

    wait_until(ready, 30, "the router to register the keyed engine and follow both streams")
    generated = router.http.post("/generate", json={"input_ids": PROMPT}, headers=key)
    assert generated.status_code == 200, generated.text
    completion = router.http.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers=key
    )
    assert completion.status_code == 200, completion.text

    def indexed() -> bool:
        asked = {"input_ids": [*PROMPT, 0]}  # one token more: every block is reusable
        answer = router.http.post("/query", json=asked, headers=key).json()
        return any(m["matched_tokens"] == len(PROMPT) for m in answer.get("matches", []))

    wait_until(indexed, 20, "the engine's stored blocks to reach the router's index")
    dump = router.http.get("/dump", headers=key)
    assert dump.status_code == 200 and dump.content


def test_router_without_the_engine_key_says_the_engine_refused_it(
    engine: Engine, key_files: dict[str, str]
) -> None:
    """No --engine-api-key: /workers and the log say the engine wants a key; nothing is routed there.

    The router here also has --metrics-auth, so /metrics needs its key too.
    """
    proc = RouterProc(
        [engine.url],
        "--api-key-file",
        key_files["router"],
        "--metrics-auth",
        "--load-interval",
        "0.2",
    )
    try:
        key = bearer(ROUTER_KEY)

        def refused() -> bool:
            # the load poller and discovery learn it independently: wait for both
            engine_info = proc.http.get("/workers", headers=key).json()["engines"][0]
            error = engine_info["load_error"]
            return (
                error is not None
                and "--engine-api-key" in error
                and engine_info["discovery"]["last_error"] is not None
            )

        wait_until(refused, 20, "/workers to report the engine refused the router's key")
        workers = proc.http.get("/workers", headers=key).json()
        assert "HTTP 401" in workers["engines"][0]["load_error"]
        assert workers["engines"][0]["registered"] is False
        discovery = workers["engines"][0]["discovery"]
        assert "requires an API key" in discovery["last_error"], discovery
        routed = proc.http.post("/route", json={"input_ids": PROMPT}, headers=key)
        assert routed.status_code == 503, routed.text
        assert proc.http.get("/metrics").status_code == 401
        assert proc.http.get("/metrics", headers=key).status_code == 200
    finally:
        proc.stop()
    assert "requires an API key" in proc.stderr
    assert ROUTER_KEY not in proc.stderr and ENGINE_KEY not in proc.stderr


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {name: str(folder / f"{name}.pem") for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    cert.private_key_pem.write_to_path(paths["key"])
    for i, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(paths["cert"], append=i > 0)
    return paths


def test_both_services_over_https_with_keys_and_router_workers(
    tls_files: dict[str, str], key_files: dict[str, str]
) -> None:
    """An HTTPS engine with a key behind an HTTPS router (--workers 2) verifying it with --ssl-ca-certs.

    Every worker serves HTTPS and requires the key; requests route through to the
    engine over TLS; a plain HTTP request gets no answer. The engine here publishes on
    every interface (--kv-events-host '*').
    """
    tls = ["--ssl-certfile", tls_files["cert"], "--ssl-keyfile", tls_files["key"]]
    engine = Engine(
        ["--api-key-file", key_files["engine"], "--kv-events-host", "*", *tls], KV_CONFIG
    )
    router = None
    try:
        assert engine.url.startswith("https://127.0.0.1:")
        trust = ssl.create_default_context(cafile=tls_files["ca"])
        with httpx.Client(base_url=engine.url, verify=trust, timeout=10) as client:
            info = client.get("/server_info", headers=bearer(ENGINE_KEY)).json()
        assert info["kv_events"]["endpoint_host"] == "*"  # as configured: every interface
        port = int(info["kv_events"]["publishers"][0]["endpoint"].rsplit(":", 1)[1])
        assert listening_hosts(port) == {"0.0.0.0"}
        router = RouterProc(
            [engine.url],
            *tls,
            "--ssl-ca-certs",
            tls_files["ca"],
            "--api-key-file",
            key_files["router"],
            "--engine-api-key-file",
            key_files["engine"],
            "--workers",
            "2",
            timeout=60,
        )
        assert router.url.startswith("https://127.0.0.1:")
        key = bearer(ROUTER_KEY)
        seen: set[int] = set()
        for _ in range(24):  # a new connection each time: the kernel spreads them over workers
            with httpx.Client(base_url=router.url, verify=trust, timeout=10) as client:
                assert_refused(client.get("/workers"), "/workers", "missing API key")
            with httpx.Client(base_url=router.url, verify=trust, timeout=10) as client:
                seen.add(client.get("/workers", headers=key).json()["process"]["index"])
        assert seen == {0, 1}

        def routed() -> bool:
            with httpx.Client(base_url=router.url, verify=trust, timeout=10) as client:
                r = client.post("/generate", json={"input_ids": PROMPT}, headers=key)
            return r.status_code == 200

        wait_until(routed, 30, "a request to route through the HTTPS router to the HTTPS engine")
        with pytest.raises(httpx.HTTPError):
            httpx.get(router.url.replace("https://", "http://") + "/health", timeout=5)
    finally:
        if router is not None:
            router.stop()
        engine.stop()


def test_watch_reads_a_keyed_engine_with_the_engine_key(
    engine: Engine, key_files: dict[str, str]
) -> None:
    """kvevents watch --engine-api-key-file follows the keyed engine; without the key it says the engine wants one."""
    generated = engine.http.post(
        "/generate", json={"input_ids": list(range(1, 40))}, headers=bearer(ENGINE_KEY)
    )
    assert generated.status_code == 200, generated.text
    watch = [sys.executable, "-m", "kvevents.cli.main", "watch", engine.url, "--jsonl"]
    env = {k: v for k, v in os.environ.items() if k != "KVEVENTS_ENGINE_API_KEY"}
    followed = subprocess.run(
        [*watch, "--engine-api-key-file", key_files["engine"], "--count", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert followed.returncode == 0, followed.stderr
    assert json.loads(followed.stdout.splitlines()[0])["events"], followed.stdout
    refused = subprocess.run(
        [*watch, "--duration", "2"], capture_output=True, text=True, timeout=60, env=env
    )
    assert "requires an API key" in refused.stdout, (refused.stdout, refused.stderr)
