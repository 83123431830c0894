"""The HTTP APIs described: OpenAPI documents built from msgspec types, for both services.

* :mod:`~kvevents.api.document`: :class:`Operation` and friends, and the document built
  from them (``/openapi.json``);
* :mod:`~kvevents.api.docs_page`: ``/docs``, the page that browses it with no CDN;
* :mod:`~kvevents.api.openai`: the OpenAI request and answer bodies the router and the
  simulated engine both serve.

Both services import these from here, so the router never depends on the engine package.
"""

from kvevents.api.document import Body, Operation, Query, document, install

__all__ = ["Body", "Operation", "Query", "document", "install"]
