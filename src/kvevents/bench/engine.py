"""Engine benchmark: KV events and blocks emitted per second per rank on a real trace.

Each rank runs in its own process, as in ``kvevents engine``: a :class:`PrefixCache`, a
:class:`Scheduler` at unlimited simulated speed, and a real
:class:`~kvevents.publish.zmq_publisher.ZmqEventPublisher` bound on loopback. Requests of a Mooncake
trace go to ranks round-robin. Token ids are generated from the trace in chunks before
each chunk is timed, so the figures measure the engine side only: admission (hashing,
matching, inserting, evicting), event recording, batching and publishing.

Requests arrive one per scheduler step (the step that admits a request also decodes the
running ones), so each step publishes a batch of about one chain, as an engine under
steady load does.

Figures per rank: requests, batches, events, blocks stored and removed, hit rate,
engine seconds (wall time inside submit and step, and the publisher's final drain),
CPU seconds of the process in those same sections (the publisher's sender thread
included), events and blocks per engine second and per CPU second, and the publisher's
own counters (published, dropped). Ranks share the machine's cores, so per-CPU-second figures are
the ones that do not depend on how many ranks run at once.
"""

from __future__ import annotations

import math
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from kvevents.engine.cache import PrefixCache
from kvevents.engine.scheduler import Scheduler
from kvevents.traces import bundled_trace_path, iter_trace, request_tokens
from kvevents.wire.hashing import get_hash_scheme

__all__ = ["run_engine_bench"]

_CHUNK = 128


def _rank_worker(params: dict[str, Any]) -> dict[str, Any]:
    from kvevents.publish.zmq_publisher import ZmqEventPublisher

    rank, dp_size = params["rank"], params["dp_size"]
    publisher = ZmqEventPublisher(attn_dp_rank=rank, endpoint="tcp://127.0.0.1:0", bind=True)
    cache = PrefixCache(
        params["page_size"], params["max_blocks"], get_hash_scheme(params["hash_scheme"])
    )
    sched = Scheduler(
        rank,
        cache,
        publisher,
        prefill_tokens_per_s=math.inf,
        decode_steps_per_s=math.inf,
        max_running=params["max_running"],
        max_waiting=10 * _CHUNK,
    )
    mine = (
        req
        for i, req in enumerate(iter_trace(params["trace"], params["requests"]))
        if i % dp_size == rank
    )
    engine_s = cpu_s = 0.0
    requests = 0
    while True:
        chunk = [
            (request_tokens(req), min(req.output_length, params["max_new_tokens"]))
            for _, req in zip(range(_CHUNK), mine, strict=False)
        ]
        if not chunk:
            break
        t0, c0 = time.perf_counter(), time.process_time()
        for i, (tokens, max_new) in enumerate(chunk):  # one arrival per step
            sched.submit(requests + i, tokens, max_new)
            sched.step()
        while sched.has_work:
            sched.step()
        engine_s += time.perf_counter() - t0
        cpu_s += time.process_time() - c0
        requests += len(chunk)
    t0, c0 = time.perf_counter(), time.process_time()
    publisher.shutdown()  # sends what is still queued
    engine_s += time.perf_counter() - t0
    cpu_s += time.process_time() - c0
    load = sched.load()
    stats = publisher.stats
    blocks = load["blocks_stored"] + load["blocks_removed"]
    events = load["events_published"]
    return {
        "dp_rank": rank,
        "requests": requests,
        "batches": load["batches_published"],
        "events": events,
        "blocks_stored": load["blocks_stored"],
        "blocks_removed": load["blocks_removed"],
        "hit_rate": load["hit_rate"],
        "engine_s": engine_s,
        "cpu_s": cpu_s,
        "events_per_s": events / engine_s if engine_s else 0.0,
        "blocks_per_s": blocks / engine_s if engine_s else 0.0,
        "events_per_cpu_s": events / cpu_s if cpu_s else 0.0,
        "blocks_per_cpu_s": blocks / cpu_s if cpu_s else 0.0,
        "publisher_published": stats.published,
        "publisher_dropped": stats.dropped,
    }


def run_engine_bench(
    *,
    trace: str | Path | None = None,
    requests: int | None = 2000,
    dp_size: int = 4,
    page_size: int = 16,
    max_blocks: int = 16384,
    max_running: int = 64,
    max_new_tokens: int = 64,
    hash_scheme: str = "sglang",
) -> dict[str, Any]:
    """Replay ``requests`` of ``trace`` (default: the bundled conversation trace) on ``dp_size`` ranks.

    Returns the figures described in the module docstring, per rank and in total.
    ``max_new_tokens`` caps each request's decode steps (the trace's output lengths).
    """
    if dp_size < 1 or page_size < 1 or max_blocks < 1:
        raise ValueError(
            f"run_engine_bench: dp_size={dp_size}, page_size={page_size}, max_blocks={max_blocks} "
            "must all be >= 1"
        )
    trace_path = bundled_trace_path() if trace is None else Path(trace)
    params = {
        "trace": str(trace_path),
        "requests": requests,
        "dp_size": dp_size,
        "page_size": page_size,
        "max_blocks": max_blocks,
        "max_running": max_running,
        "max_new_tokens": max_new_tokens,
        "hash_scheme": hash_scheme,
    }
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=dp_size, mp_context=get_context("spawn")) as pool:
        ranks = list(pool.map(_rank_worker, [params | {"rank": r} for r in range(dp_size)]))
    wall_s = time.perf_counter() - t0
    total_events = sum(r["events"] for r in ranks)
    total_blocks = sum(r["blocks_stored"] + r["blocks_removed"] for r in ranks)
    return {
        "benchmark": "engine",
        "trace": trace_path.name,
        "settings": {k: v for k, v in params.items() if k != "trace"},
        "ranks": ranks,
        "total": {
            "requests": sum(r["requests"] for r in ranks),
            "events": total_events,
            "blocks": total_blocks,
            "wall_s": wall_s,
            "events_per_s_per_rank_mean": sum(r["events_per_s"] for r in ranks) / dp_size,
            "blocks_per_s_per_rank_mean": sum(r["blocks_per_s"] for r in ranks) / dp_size,
            "blocks_per_cpu_s_mean": sum(r["blocks_per_cpu_s"] for r in ranks) / dp_size,
            "publisher_dropped": sum(r["publisher_dropped"] for r in ranks),
        },
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
    }
