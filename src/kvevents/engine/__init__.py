"""The simulated data-parallel engine: real prefix caching, real KV events, real ports.

Modules, one concept each:

* :mod:`~kvevents.engine.cache`: the paged radix prefix cache that records events;
* :mod:`~kvevents.engine.scheduler`: one rank's request queue, stepping at a simulated speed;
* :mod:`~kvevents.engine.topology`: SGLang's scheduler ranks and which of them publish;
* :mod:`~kvevents.engine.rank`, :mod:`~kvevents.engine.supervisor`: rank processes and
  their parent-side control;
* :mod:`~kvevents.engine.server`, :mod:`~kvevents.engine.openai_api`,
  :mod:`~kvevents.engine.server_info`: the HTTP API and its ``/server_info`` discovery
  block (a :class:`~kvevents.wire.server_info.KVEventsBlock`);
* :mod:`~kvevents.engine.disaggregation`: the prefill and decode roles of disaggregated
  serving, over :mod:`~kvevents.engine.handoff` (a request's P/D fields),
  :mod:`~kvevents.engine.transfer_registry` (what a prefill holds for its decodes) and
  :mod:`~kvevents.engine.bootstrap` (the prefill's bootstrap server and the decode's
  client).

``kvevents engine`` itself is :mod:`kvevents.cli.engine`; tokenizing text is
:mod:`kvevents.text`, reading traces :mod:`kvevents.traces`. The engine imports nothing
of the consumer side (``subscribe``, ``index``, ``router``). Only the light pieces are
imported here; the HTTP server (FastAPI, uvicorn) loads with ``kvevents.engine.server``.
"""

from kvevents.engine.cache import Admission, CacheStats, PrefixCache
from kvevents.engine.scheduler import Completion, QueueFullError, Scheduler, StepResult
from kvevents.engine.server_info import BoundPublisher, build_kv_events_block, kv_events_block
from kvevents.engine.topology import SchedulerRole, Topology, plan_topology

__all__ = [
    "Admission",
    "BoundPublisher",
    "CacheStats",
    "Completion",
    "PrefixCache",
    "QueueFullError",
    "Scheduler",
    "SchedulerRole",
    "StepResult",
    "Topology",
    "build_kv_events_block",
    "kv_events_block",
    "plan_topology",
]
