"""``GET /docs``: a page that browses the service's ``/openapi.json``, with nothing from a CDN.

FastAPI's own ``/docs`` loads Swagger UI's script and stylesheet from a CDN, so on a
machine without internet access (a cluster's private network, an air-gapped lab) it is
a blank page. Both services serve this one instead: a single HTML file shipped in the
package (``kvevents/data/api_docs.html``), its script and style inline and written for
it, which fetches the document and lists every operation (method, path, summary,
parameters, the request body's schema and example, each answer's status, meaning and
schema) with a form that sends the request, with an API key if one is typed. It
references no other asset, so it needs no route beyond ``/docs`` and ``/openapi.json``
(open without the services' API keys: :data:`kvevents.http.auth.OPEN_PATHS`).

Vendoring Swagger UI instead would mean a new dependency (no package installed with
FastAPI ships its files) or someone else's minified bundle in our tree, for a page read
by people, not tools: tools read ``/openapi.json``.
"""

from __future__ import annotations

import html
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # FastAPI is imported when the app is built, not with this module
    from fastapi import FastAPI
    from starlette.requests import Request

__all__ = ["DOCS_PATH", "docs_page", "serve_docs_page"]

DOCS_PATH = "/docs"


@cache
def _template() -> str:
    return (resources.files("kvevents") / "data" / "api_docs.html").read_text(encoding="utf-8")


def docs_page(title: str, openapi_url: str, root_path: str = "") -> str:
    """The page for the document at ``root_path + openapi_url``, requests sent under
    ``root_path`` (a proxy's prefix, as ASGI's ``root_path`` gives it)."""
    return (
        _template()
        .replace("__TITLE__", html.escape(title))
        .replace("__OPENAPI_URL__", html.escape(root_path + openapi_url))
        .replace("__ROOT_PATH__", html.escape(root_path))
    )


def serve_docs_page(app: FastAPI) -> None:
    """Serve :func:`docs_page` at ``/docs`` of ``app``, which must be created with
    ``docs_url=None`` and ``redoc_url=None`` (FastAPI's pages load their assets from a
    CDN); ValueError otherwise."""
    from starlette.responses import HTMLResponse

    if app.docs_url is not None or app.redoc_url is not None:
        raise ValueError(
            "create the FastAPI app with docs_url=None and redoc_url=None: its own pages "
            f"load Swagger UI and ReDoc from a CDN, and {DOCS_PATH} is served without one"
        )
    openapi_url = app.openapi_url or "/openapi.json"

    async def docs(request: Request) -> HTMLResponse:
        root_path = str(request.scope.get("root_path", "")).rstrip("/")
        return HTMLResponse(docs_page(app.title, openapi_url, root_path))

    # a plain Starlette route: FastAPI would resolve the handler's annotations as parameters
    app.add_route(DOCS_PATH, docs, methods=["GET"], include_in_schema=False)
