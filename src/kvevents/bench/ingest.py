"""Ingest capacity: how many engines one router process follows while it answers ``/route``.

A feeder process plays ``M`` engines. Each has a real prefix cache (the simulated
engine's :class:`~kvevents.engine.cache.PrefixCache`, small enough to evict) fed the
bundled Mooncake conversation trace, and publishes the resulting ``BlockStored`` /
``BlockRemoved`` batches on its own ZMQ PUB socket at ``block_ops`` block operations
per second (stored plus removed blocks), with the live wire framing. Every engine answers
``GET /health`` on one small HTTP server, so the router sees it as available. The batches
are built and encoded before the clock starts, so the feeder spends its time sending.

One ``kvevents router`` (``--workers 1``, then ``--workers 2``: per process, then per
machine) follows all ``M`` (described in an engines file,
SGLang kind) while a client posts ``/route`` with 2,048-token prompts at a fixed rate.
For each ``M`` the run reports the router's applied-batch backlog (batches published but
not yet in the index, in seconds of the feed) and the ``/route`` latencies; the capacity
is the largest ``M`` with a backlog under 1 s and a ``/route`` p99 under 10 ms.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import tempfile
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import zmq

from kvevents.demo.procs import Child
from kvevents.engine.cache import PrefixCache
from kvevents.errors import KVEventsError
from kvevents.http.upstream import Upstream
from kvevents.traces import iter_trace, request_tokens
from kvevents.wire.codec import encode_batch
from kvevents.wire.events import KVEventBatch
from kvevents.wire.frames import encode_seq
from kvevents.wire.hashing import get_hash_scheme

__all__ = ["run_ingest_bench"]

_BLOCK = 16
_TICK_S = 0.005


def _payloads(requests: int, max_blocks: int) -> list[tuple[bytes, int]]:
    """The trace through one small cache: one encoded batch per request and its block ops."""
    cache = PrefixCache(_BLOCK, max_blocks, get_hash_scheme("sglang"))
    out: list[tuple[bytes, int]] = []
    for req in iter_trace(None, requests):
        cache.release(cache.admit(request_tokens(req)))
        events = cache.take_events()
        if not events:
            continue
        ops = sum(len(getattr(e, "block_hashes", ())) for e in events)
        out.append((encode_batch(KVEventBatch(ts=time.time(), events=events)), ops))
    return out


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = 200 if self.path.endswith("/health") else 404
        self.send_response(code)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _feed(engines: int, block_ops: float, ready: Any, go: Any, stop: Any, published: Any) -> None:
    """The feeder process (module docstring): sends its ports, feeds from ``go`` to ``stop``."""
    batches = _payloads(3000, 4096)
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    ctx = zmq.Context()
    socks, ports = [], []
    for _ in range(engines):
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 1_000_000)
        sock.bind("tcp://127.0.0.1:0")
        socks.append(sock)
        ports.append(int(str(sock.getsockopt_string(zmq.LAST_ENDPOINT)).rsplit(":", 1)[1]))
    ready.send({"http_port": http.server_address[1], "ports": ports})
    ready.close()
    rng = random.Random(7)
    cursor = [rng.randrange(len(batches)) for _ in range(engines)]
    seq = [0] * engines
    sent_ops = [0] * engines
    go.wait()  # every stream of the router is connected: nothing sent from here is missed
    start = time.monotonic()
    total = 0
    while not stop.is_set():
        due = block_ops * (time.monotonic() - start)
        for i, sock in enumerate(socks):
            while sent_ops[i] < due:
                payload, ops = batches[cursor[i]]
                cursor[i] = (cursor[i] + 1) % len(batches)
                sock.send_multipart([b"", encode_seq(seq[i]), payload])
                seq[i] += 1
                sent_ops[i] += ops
                total += 1
        published.value = total
        time.sleep(_TICK_S)
    http.shutdown()
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


_JSON = {"content-type": "application/json"}


async def _route_at_rate(url: str, rate: float, seconds: float) -> list[float]:
    """POST /route with fresh 2,048-token prompts at ``rate`` per second; latencies in ms."""
    rng = random.Random(11)
    bodies = [
        json.dumps({"input_ids": [rng.randrange(1, 50_000) for _ in range(2048)]}).encode()
        for _ in range(64)
    ]
    latencies: list[float] = []
    errors = 0

    client = Upstream(timeout=60.0)  # the router's own engine client, kept-alive connections

    async def one(body: bytes) -> None:
        nonlocal errors
        t0 = time.perf_counter()
        answer = await client.post_whole(url, "/route", body, _JSON)
        if answer.status != 200:
            errors += 1
        latencies.append((time.perf_counter() - t0) * 1000)

    tasks = []
    start = time.perf_counter()
    n = int(rate * seconds)
    try:
        for k in range(n):
            delay = start + k / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(bodies[k % len(bodies)])))
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    if errors:
        raise KVEventsError(f"/route answered {errors} of {n} requests with an error")
    return latencies


def _wait_connected(client: httpx.Client, engines: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = client.get("/workers").json()
        streams = workers["streams"]
        # measured once start-up has settled (native mirror built, heap frozen)
        settled = workers["process"].get("settled", True)
        if settled and sum(s["status"] == "connected" for s in streams) == engines:
            return
        time.sleep(0.1)
    raise KVEventsError(f"the router did not connect to {engines} streams within {timeout:g} s")


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _one_round(
    engines: int, block_ops: float, route_rate: float, seconds: float, workers: int = 1
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    ready_recv, ready_send = ctx.Pipe(duplex=False)
    stop, go = ctx.Event(), ctx.Event()
    published = ctx.Value("q", 0)
    feeder = ctx.Process(target=_feed, args=(engines, block_ops, ready_send, go, stop, published))
    feeder.start()
    ready_send.close()
    if not ready_recv.poll(120):
        feeder.kill()
        raise KVEventsError("the feeder did not start within 120 s")
    info = ready_recv.recv()
    router: Child | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="kvevents-ingest-") as tmp:
            spec = {
                "engines": [
                    {
                        "url": f"http://127.0.0.1:{info['http_port']}/e{i}",
                        "kv_endpoint": f"tcp://127.0.0.1:{port}",
                        "dp_size": 1,
                        "block_size": _BLOCK,
                        "kind": "sglang",
                    }
                    for i, port in enumerate(info["ports"])
                ]
            }
            path = Path(tmp) / "engines.json"
            path.write_text(json.dumps(spec))
            router = Child(
                "router", ["--engines-file", str(path), "--port", "0", "--workers", str(workers)]
            )
            url = router.start(timeout=60.0)
            with httpx.Client(base_url=url, timeout=10.0) as client:
                _wait_connected(client, engines)
                go.set()
                time.sleep(2.0)  # warm: the feed reaches its rate, the index fills
                applied0 = client.get("/workers").json()["index"]["batches_applied"]
                fed0, t0 = published.value, time.monotonic()
                latencies = asyncio.run(_route_at_rate(url, route_rate, seconds))
                backlog = (
                    published.value - client.get("/workers").json()["index"]["batches_applied"]
                )
                fed1, t1 = published.value, time.monotonic()
                applied1 = client.get("/workers").json()["index"]["batches_applied"]
        feed_rate = (fed1 - fed0) / (t1 - t0)
        return {
            "engines": engines,
            "router_processes": workers,
            "block_ops_per_engine_s": block_ops,
            "batches_fed_per_s": feed_rate,
            "batches_applied_per_s": (applied1 - applied0) / (t1 - t0),
            "backlog_batches": backlog,
            "backlog_s": backlog / feed_rate if feed_rate else float("inf"),
            "route_rate": route_rate,
            "route_p50_ms": _percentile(latencies, 0.50),
            "route_p99_ms": _percentile(latencies, 0.99),
        }
    finally:
        if router is not None:
            router.stop()
        stop.set()
        feeder.join(20)
        if feeder.is_alive():
            feeder.kill()


def run_ingest_bench(
    *,
    engine_counts: Sequence[int] = (4, 8, 16, 32, 64),
    block_ops: float = 3000.0,
    route_rate: float = 200.0,
    seconds: float = 10.0,
    workers: Sequence[int] = (1, 2),
) -> dict[str, Any]:
    """For each router size (``--workers``), rounds of growing ``M`` until the router falls
    behind or ``/route`` p99 passes 10 ms; the capacity is the last ``M`` that kept up."""
    rounds = []
    capacity: dict[str, int] = {}
    for n in workers:
        capacity[str(n)] = 0
        for engines in engine_counts:
            result = _one_round(engines, block_ops, route_rate, seconds, workers=n)
            result["keeps_up"] = result["backlog_s"] < 1.0 and result["route_p99_ms"] <= 10.0
            rounds.append(result)
            if not result["keeps_up"]:
                break
            capacity[str(n)] = engines
    return {
        "setup": {
            "block_ops_per_engine_s": block_ops,
            "route_rate": route_rate,
            "seconds_per_round": seconds,
            "cpus": os.cpu_count(),
            "prompt_tokens": 2048,
        },
        "rounds": rounds,
        "engines_kept_up": capacity,
    }
