"""``GET /docs`` of the router and the engine works offline: the page needs nothing from
another host, everything it references is served by the service itself, and its script
renders every operation of the service's ``/openapi.json`` (run under node, when there)."""

from __future__ import annotations

import html.parser
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_support import KV_CONFIG, Engine, RouterProc

from kvevents.api.docs_page import docs_page, serve_docs_page

pytestmark = pytest.mark.slow

KEY = "docs-page-test-key"
DOM = Path(__file__).with_name("docs_page_dom.js")


@pytest.fixture(scope="module")
def services() -> Iterator[dict[str, httpx.Client]]:
    """A simulated engine and a router in front of it that requires an API key."""
    engine = Engine(["--dp-size", "1"], KV_CONFIG)
    try:
        router = RouterProc([engine.url], env={"KVEVENTS_API_KEY": KEY})
        try:
            yield {"engine": engine.http, "router": router.http}
        finally:
            router.stop()
    finally:
        engine.stop()


class _References(html.parser.HTMLParser):
    """Every URL an HTML page references: src, href, and the page's data-openapi."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.scripts_with_src: list[str] = []
        self.stylesheets: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        for name in ("src", "href", "data-openapi"):
            if name in values:
                self.urls.append(values[name])
        if tag == "script" and "src" in values:
            self.scripts_with_src.append(values["src"])
        if tag == "link":
            self.stylesheets.append(values.get("href", ""))


def _page(client: httpx.Client) -> str:
    answer = client.get("/docs")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/html")
    return answer.text


@pytest.mark.parametrize("service", ["router", "engine"])
def test_docs_loads_nothing_from_another_host(
    services: dict[str, httpx.Client], service: str
) -> None:
    """/docs holds no http:// or https:// URL (no CDN script or stylesheet), and every URL
    it references is answered 200 by the service itself, without the router's API key."""
    page = _page(services[service])
    assert re.search(r"https?://|//cdn|src=\"//", page) is None
    refs = _References()
    refs.feed(page)
    assert refs.urls, "the page names at least the OpenAPI document"
    for url in refs.urls:
        assert url.startswith("/"), url
        assert services[service].get(url).status_code == 200, url
    assert "/openapi.json" in refs.urls


@pytest.mark.parametrize("path", ["/redoc", "/docs/oauth2-redirect"])
@pytest.mark.parametrize("service", ["router", "engine"])
def test_fastapi_cdn_pages_are_not_served(
    services: dict[str, httpx.Client], service: str, path: str
) -> None:
    """FastAPI's own pages, which load Swagger UI or ReDoc from a CDN, are not served
    (asked with the router's key: without it, a path that is not open answers 401)."""
    key = {"Authorization": f"Bearer {KEY}"} if service == "router" else {}
    assert services[service].get(path, headers=key).status_code == 404


def test_the_router_key_guards_the_api_but_not_its_description(
    services: dict[str, httpx.Client],
) -> None:
    """With the router's API key set, /docs and /openapi.json answer without it and a
    routed endpoint does not: the page loads and sends the key the user types."""
    router = services["router"]
    assert router.get("/openapi.json").status_code == 200
    assert router.get("/workers").status_code == 401
    assert router.get("/workers", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
@pytest.mark.parametrize("service", ["router", "engine"])
def test_the_page_renders_every_operation(services: dict[str, httpx.Client], service: str) -> None:
    """The page's script, run on the page and document the service serves, shows one entry
    per operation with its summary, request body and answers, and its filter keeps only
    the operations matching every word typed."""
    client = services[service]
    page = _page(client)
    doc = client.get("/openapi.json").json()
    script = re.search(r"<script>(.*)</script>", page, re.S)
    assert script is not None
    body = dict(re.findall(r'data-(openapi|root)="([^"]*)"', page))
    filter_words = "post tokens"
    rendered = _run_page(script.group(1), body, doc, filter_words)
    assert rendered["error"] == ""
    assert rendered["fetched"] == ["/openapi.json"]
    assert rendered["title"] == doc["info"]["title"]
    expected = sorted(
        (method, path, op.get("summary", ""))
        for path, item in doc["paths"].items()
        for method, op in item.items()
    )
    assert (
        sorted((o["method"], o["path"], o["summary"]) for o in rendered["operations"]) == expected
    )
    for shown in rendered["operations"]:
        op = doc["paths"][shown["path"]][shown["method"]]
        for status in op["responses"]:
            assert status in shown["text"], (shown["path"], status)
        if "requestBody" in op:
            assert "Request body" in shown["text"], shown["path"]
    matching = [
        o["path"]
        for o in rendered["operations"]
        if all(word in o["search"] for word in filter_words.split())
    ]
    assert rendered["shown"] == matching
    assert 0 < len(matching) < len(expected)


def _run_page(script: str, body: dict[str, str], doc: Any, filter_words: str) -> Any:
    done = subprocess.run(
        ["node", str(DOM)],
        input=json.dumps({"script": script, "body": body, "document": doc, "filter": filter_words}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_page_escapes_what_it_is_given() -> None:
    """The title and URLs put into the page are HTML-escaped, so they cannot add markup."""
    page = docs_page('<script>x</script>"', '/openapi.json"><script>', "/prefix")
    assert "<script>x</script>" not in page
    assert 'data-openapi="/prefix/openapi.json&quot;&gt;&lt;script&gt;"' in page
    assert 'data-root="/prefix"' in page


def test_an_app_with_fastapi_pages_is_refused() -> None:
    """serve_docs_page refuses an app that still serves FastAPI's CDN pages, naming the fix."""
    from fastapi import FastAPI

    with pytest.raises(ValueError, match="docs_url=None and redoc_url=None"):
        serve_docs_page(FastAPI())
