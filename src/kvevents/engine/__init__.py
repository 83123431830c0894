"""The simulated data-parallel engine: real prefix caching, real KV events, real ports.

Modules, one concept each:

* :mod:`~kvevents.engine.cache`: the paged radix prefix cache that records events;
* :mod:`~kvevents.engine.scheduler`: one rank's request queue, stepping at a simulated speed;
* :mod:`~kvevents.engine.topology`: SGLang's scheduler ranks and which of them publish;
* :mod:`~kvevents.engine.rank`, :mod:`~kvevents.engine.supervisor`: rank processes and
  their parent-side control;
* :mod:`~kvevents.engine.server`, :mod:`~kvevents.engine.server_info`: the HTTP API and
  its ``/server_info`` discovery block;
* :mod:`~kvevents.engine.launcher`: ``kvevents engine``;
* :mod:`~kvevents.engine.trace`, :mod:`~kvevents.engine.tokenizer`: Mooncake traces to
  tokens, and the byte-level tokenizer;
* :mod:`~kvevents.engine.bench`: events and blocks emitted per second per rank.

Only the light pieces are imported here; the HTTP server (FastAPI, uvicorn) loads when
``kvevents.engine.launcher`` or ``kvevents.engine.server`` is imported.
"""

from kvevents.engine.bench import run_engine_bench
from kvevents.engine.cache import Admission, CacheStats, PrefixCache
from kvevents.engine.scheduler import Completion, QueueFullError, Scheduler, StepResult
from kvevents.engine.server_info import BoundPublisher, build_kv_events_block
from kvevents.engine.tokenizer import ByteTokenizer
from kvevents.engine.topology import SchedulerRole, Topology, plan_topology
from kvevents.engine.trace import (
    TraceRequest,
    bundled_trace_path,
    hash_id_tokens,
    iter_trace,
    load_trace,
    request_tokens,
)

__all__ = [
    "Admission",
    "BoundPublisher",
    "ByteTokenizer",
    "CacheStats",
    "Completion",
    "PrefixCache",
    "QueueFullError",
    "Scheduler",
    "SchedulerRole",
    "StepResult",
    "Topology",
    "TraceRequest",
    "build_kv_events_block",
    "bundled_trace_path",
    "hash_id_tokens",
    "iter_trace",
    "load_trace",
    "plan_topology",
    "request_tokens",
    "run_engine_bench",
]
