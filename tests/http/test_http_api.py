"""Both services' HTTP APIs as a client sees them: the OpenAPI documents, the router's body
limit on every route that reads a body, and a bounded schemathesis run with no 5xx."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_support import KV_CONFIG, Engine, RouterProc, wait_until

from kvevents.api import document
from kvevents.engine import api_schema as engine_api
from kvevents.engine.server import EngineInfo, create_app
from kvevents.engine.supervisor import RankSupervisor
from kvevents.engine.topology import plan_topology
from kvevents.publish.config import KVEventsConfig
from kvevents.router.decide.router import Router
from kvevents.router.serve import api_schema as router_api
from kvevents.router.serve.fastapi_app import create_fastapi_app
from kvevents.router.serve.hot_path import HotPath
from kvevents.router.serve.pd_mode import PDEngine, PDMode
from kvevents.router.serve.service import RouterService

LIMIT = 65_536
"""The router's --max-body-bytes here: small, so bodies on both sides of it are cheap."""
FUZZ_EXAMPLES = 20
"""Schemathesis cases per operation and phase: about 15 s per service on 2 shared cores."""


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine(["--dp-size", "2", "--max-new-tokens-limit", "64"], KV_CONFIG)


@pytest.fixture(scope="module")
def router(make_router: Callable[..., RouterProc], engine: Engine) -> RouterProc:
    proc = make_router([engine.url], "--max-body-bytes", str(LIMIT), streams=2)
    wait_until(
        lambda: proc.post("/route", {"input_ids": [1]}).status_code == 200, 20, "a rank routable"
    )
    return proc


def _router_app() -> Any:
    return create_fastapi_app(RouterService(Router(), []))


@contextlib.contextmanager
def _engine_app() -> Iterator[Any]:
    """The engine's app around a supervisor with no ranks (no route is called)."""
    supervisor = RankSupervisor([])
    info = EngineInfo(plan_topology(1, None, False), 16, 8, "sglang", KVEventsConfig())
    try:
        yield create_app(supervisor, info)
    finally:
        asyncio.run(supervisor.stop())


def _served(app: Any) -> set[tuple[str, str]]:
    skip = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    return {
        (method.lower(), route.path)
        for route in app.routes
        if route.path not in skip
        for method in getattr(route, "methods", ()) or ()
        if method != "HEAD"
    }


@pytest.mark.parametrize("service", ["router", "engine"])
def test_every_endpoint_is_described_and_every_description_is_served(service: str) -> None:
    """The operations table names exactly the routes the app serves (plus the hot path's),
    and every POST that reads a body declares it."""
    if service == "router":
        _check_described(
            _router_app(), router_api.OPERATIONS, {("post", "/route"), ("post", "/query")}
        )
    else:
        with _engine_app() as app:
            _check_described(app, engine_api.OPERATIONS, set())


def _check_described(app: Any, operations: Any, extra: set[tuple[str, str]]) -> None:
    declared = {(op.method, op.path) for op in operations}
    assert declared == _served(app) | extra
    doc = app.openapi()
    for method, path in declared:
        item = doc["paths"][path][method]
        assert item["summary"] and "200" in item["responses"]
        if method == "post" and path not in ("/flush_cache", "/admin/restart_rank"):
            assert "$ref" in item["requestBody"]["content"]["application/json"]["schema"]
    refs = {r for r in json.dumps(doc).split('"') if r.startswith("#/components/schemas/")}
    assert {r.rsplit("/", 1)[1] for r in refs} <= set(doc["components"]["schemas"])


def test_the_hot_path_routes_are_the_ones_documented() -> None:
    """/route and /query, which FastAPI never sees, are in the router's document."""
    hot = HotPath(RouterService(Router(), []), _router_app())
    paths = document(_router_app(), router_api.OPERATIONS)["paths"]
    assert set(hot._handlers) <= set(paths)
    body = paths["/route"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/TokensBody"}


def test_a_disaggregated_router_describes_its_own_route_answer() -> None:
    """In P/D mode /openapi.json describes /route's two-holder answer and the prefill
    headers of the relayed routes, and every reference in it resolves."""
    pd = PDMode(
        [PDEngine("http://p:1", "p", "prefill"), PDEngine("http://d:1", "d", "decode")], "sglang"
    )
    app = create_fastapi_app(RouterService(Router(), [], pd=pd))
    _check_described(app, router_api.PD_OPERATIONS, {("post", "/route"), ("post", "/query")})
    doc = app.openapi()
    ok = doc["paths"]["/route"]["post"]["responses"]["200"]["content"]["application/json"]
    assert ok["schema"] == {"$ref": "#/components/schemas/PDRouteAnswer"}
    assert {"prefill", "decode", "prefill_skipped"} <= set(
        doc["components"]["schemas"]["PDRouteAnswer"]["properties"]
    )
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        assert "x-kvevents-prefill-worker" in doc["paths"][path]["post"]["description"]
    one_pool = _router_app().openapi()
    assert "PDRouteAnswer" not in one_pool["components"]["schemas"]


def _exchange(sock: socket.socket, request: bytes) -> tuple[int, bytes]:
    """Send one HTTP/1.1 request on ``sock``; the status and body of its answer."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection; got {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.split(b": ", 1) for line in lines[1:])
    length = int(headers[b"content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-answer"
        rest += chunk
    return status, rest[:length]


def _post(path: str, body: bytes, *, chunked: bool = False) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    if not chunked:
        return f"{head}content-length: {len(body)}\r\n\r\n".encode() + body
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 8192]), body[i : i + 8192])
        for i in range(0, len(body), 8192)
    )
    return f"{head}transfer-encoding: chunked\r\n\r\n".encode() + chunks + b"0\r\n\r\n"


def _padded(path: str, size: int) -> bytes:
    """A valid body for ``path`` of exactly ``size`` bytes (a text prompt filled with 'a')."""
    if path == "/v1/chat/completions":
        shell = {"messages": [{"role": "user", "content": ""}], "max_tokens": 1}
    elif path == "/v1/completions":
        shell = {"prompt": "", "max_tokens": 1}
    elif path == "/generate":
        shell = {"text": "", "max_new_tokens": 1}  # an engine member: forwarded as it is
    else:
        shell = {"text": ""}  # /route and /query refuse members they do not take
    empty = json.dumps(shell).encode()
    return empty.replace(b'""', b'"' + b"a" * (size - len(empty)) + b'"', 1)


ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions", "/route", "/query"]


@pytest.mark.slow
@pytest.mark.parametrize("path", ROUTES)
def test_the_body_limit_holds_on_every_router_route_and_the_connection_stays_usable(
    router: RouterProc, path: str
) -> None:
    """A body of exactly --max-body-bytes is served; one byte more, or a chunked body past
    it, answers 413 naming the flag (OpenAI's error shape on /v1 routes), and the next
    request on the same connection is answered."""
    url = httpx.URL(router.url)
    with socket.create_connection((url.host, url.port), timeout=30.0) as sock:
        status, answer = _exchange(sock, _post(path, _padded(path, LIMIT)))
        assert status == 200, answer[:300]
        for request in (
            _post(path, _padded(path, LIMIT + 1)),
            _post(path, _padded(path, 3 * LIMIT), chunked=True),
        ):
            status, answer = _exchange(sock, request)
            assert status == 413, answer[:300]
            error = json.loads(answer)["error"]
            message = error["message"] if path.startswith("/v1/") else error
            assert "--max-body-bytes" in message and str(LIMIT) in message
            status, answer = _exchange(sock, _post(path, _padded(path, 100)))
            assert status == 200, answer[:300]


@pytest.mark.slow
@pytest.mark.parametrize("path", ROUTES)
def test_json_nested_too_deeply_is_a_400_on_every_router_route(
    router: RouterProc, path: str
) -> None:
    """A body nested 5,000 deep in a member the router does not read (forwarded on
    /generate, refused on /route and /query) answers 400 saying so (it was a 500 on
    /generate), and the connection stays usable."""
    deep = b"[" * 5000 + b"]" * 5000
    body = _padded(path, 100)[:-1] + b', "extra": ' + deep + b"}"
    url = httpx.URL(router.url)
    with socket.create_connection((url.host, url.port), timeout=30.0) as sock:
        status, answer = _exchange(sock, _post(path, body))
        assert status == 400, answer[:300]
        assert b"nested" in answer
        status, answer = _exchange(sock, _post(path, _padded(path, 100)))
        assert status == 200, answer[:300]


@pytest.mark.slow
def test_an_openai_body_field_of_the_wrong_type_is_a_400(engine: Engine) -> None:
    """A field the document types (here `model`, echoed in the answer) with another type is
    refused naming it, on both OpenAI routes and /tokenize (found by schemathesis)."""
    for path, body in (
        ("/v1/completions", {"prompt": "Hi", "model": [None, None]}),
        ("/v1/chat/completions", {"messages": [{"role": "u", "content": "x"}], "model": 3}),
        ("/tokenize", {"prompt": "Hi", "add_special_tokens": "yes"}),
    ):
        answer = engine.http.post(path, json=body)
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert "$." in message and ("model" in message or "add_special_tokens" in message)


def _schemathesis(url: str, cwd: Path, *exclude: str) -> subprocess.CompletedProcess[str]:
    """``st run`` against ``url``'s document, in ``cwd`` (it leaves a cache directory)."""
    st = Path(sys.executable).with_name("st")
    argv = [
        str(st),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "not_a_server_error,status_code_conformance,content_type_conformance,"
        "response_schema_conformance",
        "--phases",
        "examples,fuzzing",
        "--max-examples",
        str(FUZZ_EXAMPLES),
        "--generation-deterministic",  # the same cases every run: reproducible
        "--workers",
        "1",
        "--request-timeout",
        "20",
        "--no-color",
    ]
    for path in exclude:
        argv += ["--exclude-path", path]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, cwd=cwd)


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_in_the_engine(engine: Engine, tmp_path: Path) -> None:
    """Every engine operation, fed schema-derived and schema-violating bodies, answers a
    declared status with a body of the declared shape, and never a 5xx.

    Excluded: POST /admin/restart_rank, which kills the rank it names (that is its job):
    every request routed there in the meantime answers the documented 503, which is no
    defect but would fail the no-5xx check for the operations after it.
    """
    done = _schemathesis(engine.url, tmp_path, "/admin/restart_rank")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_in_the_router(
    router: RouterProc, tmp_path: Path
) -> None:
    """Every router operation (the hot path's included), fed schema-derived and
    schema-violating bodies, answers a declared status and shape, and never a 5xx."""
    done = _schemathesis(router.url, tmp_path)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
