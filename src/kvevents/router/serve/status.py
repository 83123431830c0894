"""The router's own state as ``GET /workers``, ``GET /health`` and ``GET /ready`` answer it.

All three are answered by the hot path (:mod:`kvevents.router.serve.hot_path`) without the
framework, so they work from the moment the router prints its ready line, and a probe
or an operator polling ``/workers`` during a warm start sees the index as it fills.
``/health`` is liveness (the process serves), ``/ready`` readiness (it can route now:
:mod:`kvevents.router.serve.readiness`); ``/workers`` carries the same readiness as ``ready``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvevents.router.serve.readiness import Readiness, readiness
from kvevents.router.serve.service import RouterService

__all__ = ["HEALTHY", "ready_answer", "workers_document"]

HEALTHY: dict[str, str] = {"status": "ok"}
"""``/health``'s answer: 200 while the router serves (open even with an API key)."""


def ready_answer(service: RouterService) -> tuple[int, Readiness]:
    """``/ready``: 200 and the readiness when the router can route, else 503 and it."""
    state = readiness(service)
    return (200 if state.ok else 503), state


def workers_document(service: RouterService) -> dict[str, Any]:
    """``/workers``: every engine, stream and holder, the index, and this process."""
    router = service.router
    sub = service.subscriber
    streams = [] if sub is None else [msgspec.to_builtins(s) for s in sub.stats().values()]
    engines = {} if sub is None else msgspec.to_builtins(sub.engines())
    return {
        "ready": msgspec.to_builtins(readiness(service)),
        "engines": [
            {
                "url": st.spec.url,
                "worker": st.spec.worker,
                "kind": st.spec.engine_kind,
                "described": st.spec.to_dict() if st.spec.described else None,
                "registered": st.registered,
                "advertised_block_size": st.advertised_block_size,
                "load_error": st.error,
                "load_slow_polls": st.slow_polls,
                "load_slow": st.slow,
                "load_source": st.load_source,
                "metrics_error": st.metrics_error,
                "models": None if st.models is None else st.models.names(),
                "models_source": None if st.models is None else st.models.source,
                "models_error": st.models_error,
                "discovery": engines.get(st.spec.url),
            }
            for st in service.states.values()
        ],
        "streams": streams,
        "holders": router.holder_summary(),
        "index": {
            "entries": len(router.index),
            "blocks": router.index.num_blocks,
            "block_size": router.index.block_size,
            "batches_applied": router.batches_applied,
            "apply_failures": router.apply_failures,
        },
        "block_size_mismatches": [
            msgspec.to_builtins(m) for m in router.block_sizes.mismatches.values()
        ],
        "process": service.process_info(),
        "warm_start": None
        if service.warm_start is None
        else msgspec.to_builtins(service.warm_start),
        "policy": service.policy,
        "tokenizer": service.text_tokenizer.name,
        "pd": None if service.pd is None else service.pd.summary(),
    }
