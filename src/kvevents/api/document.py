"""The OpenAPI documents of the router and the simulated engine, built from msgspec types.

Both services parse bodies by hand or with msgspec decoders (a FastAPI ``Request`` in,
no pydantic models), so FastAPI alone documents no body at all. Each service instead
lists its endpoints as :class:`Operation` values: the request body's type is the same
msgspec struct its decoder validates with (or, where a handler checks a body by hand,
a struct that states what that handler accepts), the answers' types are the structs
the tests check the live answers against. :func:`install` replaces ``app.openapi``
with one that turns those types into JSON Schema with
:func:`msgspec.json.schema_components` and writes one operation per endpoint, so
``/openapi.json`` and ``/docs`` cannot drift from the types the code uses, and a schema
fuzzer (schemathesis, in the test suite) can reach every handler.

An operation may describe a path FastAPI does not route at all (the router's ``/route``
and ``/query`` are answered by its bare ASGI hot path in front of FastAPI); the
document holds it all the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from kvevents.api.docs_page import serve_docs_page

if TYPE_CHECKING:  # FastAPI is imported when a document is built, not with this module
    from fastapi import FastAPI

__all__ = ["Body", "Operation", "Query", "document", "install"]

_REF = "#/components/schemas/{name}"
_SSE = {
    "type": "object",
    "description": "One server-sent event: `data` is a JSON chunk, or `[DONE]` last",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}


@dataclass(frozen=True)
class Body:
    """A request or response body: a msgspec-describable ``type`` under ``media_type``.

    ``type`` None with a text media type declares a plain string; ``example`` is shown
    in ``/docs``.
    """

    type: Any = None
    media_type: str = "application/json"
    description: str = ""
    example: Any = None
    also: Sequence[str] = ()
    """Further media types the same answer may come as (``text/event-stream`` when streamed)."""


@dataclass(frozen=True)
class Query:
    """One query parameter."""

    name: str
    schema: Mapping[str, Any]
    description: str
    required: bool = False


@dataclass(frozen=True)
class Operation:
    """One endpoint: method, path, what it takes and every status it answers with.

    ``errors`` maps each error status to what it means; every one is answered with
    ``error_type`` (the service's error shape for this endpoint).
    """

    method: Literal["get", "post"]
    path: str
    summary: str
    ok: Body
    description: str = ""
    request: Body | None = None
    query: Sequence[Query] = ()
    errors: Mapping[int, str] = field(default_factory=dict)
    error_type: Any = None
    ok_status: int = 200
    other: Mapping[int, tuple[str, Body]] = field(default_factory=dict)
    """Statuses other than ``ok_status`` that answer a non-error body (``/health``'s 503)."""


def _types(operations: Sequence[Operation]) -> list[Any]:
    found: list[Any] = []
    for op in operations:
        bodies = [op.ok, *(b for _, b in op.other.values())]
        if op.request is not None:
            bodies.append(op.request)
        candidates = [b.type for b in bodies]
        if op.errors:
            candidates.append(op.error_type)
        found.extend(t for t in candidates if t is not None and t not in found)
    return found


def _content(body: Body, schema: Mapping[str, Any]) -> dict[str, Any]:
    media: dict[str, Any] = {"schema": dict(schema)}
    if body.example is not None:
        media["example"] = body.example
    content = {body.media_type: media}
    for other in body.also:
        content[other] = {"schema": _SSE if other == "text/event-stream" else {"type": "string"}}
    return content


def _plain(body: Body) -> dict[str, Any]:
    if body.media_type == "application/octet-stream":
        return {"type": "string", "format": "binary"}
    return {"type": "string"}


def _item(op: Operation, schemas: Mapping[Any, Mapping[str, Any]]) -> dict[str, Any]:
    def schema_of(body: Body) -> Mapping[str, Any]:
        return _plain(body) if body.type is None else schemas[body.type]

    responses: dict[str, Any] = {
        str(op.ok_status): {
            "description": op.ok.description or "Success",
            "content": _content(op.ok, schema_of(op.ok)),
        }
    }
    for status, (meaning, body) in op.other.items():
        responses[str(status)] = {
            "description": meaning,
            "content": _content(body, schema_of(body)),
        }
    for status, meaning in sorted(op.errors.items()):
        error = Body(op.error_type)
        responses[str(status)] = {
            "description": meaning,
            "content": _content(error, schemas[op.error_type]),
        }
    item: dict[str, Any] = {
        "summary": op.summary,
        "operationId": f"{op.method}{op.path.replace('/', '_')}",
        "responses": responses,
    }
    if op.description:
        item["description"] = op.description
    if op.query:
        item["parameters"] = [
            {
                "name": q.name,
                "in": "query",
                "required": q.required,
                "description": q.description,
                "schema": dict(q.schema),
            }
            for q in op.query
        ]
    if op.request is not None:
        item["requestBody"] = {
            "required": True,
            "content": _content(op.request, schema_of(op.request)),
        }
        if op.request.description:
            item["requestBody"]["description"] = op.request.description
    return item


def document(app: FastAPI, operations: Sequence[Operation]) -> dict[str, Any]:
    """The OpenAPI document of ``app`` with every operation in ``operations`` written in.

    FastAPI's own entries for those paths (which know no body) are replaced; its
    components are kept. ``ValueError`` when two operations share a method and path.
    """
    from fastapi.openapi.utils import get_openapi

    seen = {(op.method, op.path) for op in operations}
    if len(seen) != len(operations):
        raise ValueError("two operations share a method and path")
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
    )
    types = _types(operations)
    refs, components = msgspec.json.schema_components(types, ref_template=_REF)
    schemas = dict(zip(types, refs, strict=True))
    doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
    paths: dict[str, Any] = doc.setdefault("paths", {})
    for op in operations:
        paths.setdefault(op.path, {})[op.method] = _item(op, schemas)
    return doc


def install(app: FastAPI, operations: Sequence[Operation]) -> None:
    """Serve :func:`document` of ``app`` as its ``/openapi.json`` (built once, on first
    use), and the page browsing it at ``/docs`` (:mod:`kvevents.api.docs_page`: create
    the app with ``docs_url=None, redoc_url=None``)."""
    serve_docs_page(app)
    cached: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not cached:
            cached.update(document(app, operations))
        return cached

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
