"""OpenAI routing benchmark: what ``/v1/completions`` through the router costs, and how right it is.

    python benchmarks/openai_proxy.py [--requests N] [--quick] [--json PATH]

Starts the simulated engine (dp 2, page 16, events on consecutive loopback ports) and
``kvevents router`` describing it by flags only (``--kv-endpoint``, ``--dp-size``,
``--engine-kind kvevents``: no ``/server_info`` discovery). Then, one request at a time:

1. ``N`` completions (``max_tokens`` 1) of a conversation-like workload (8 shared
   system prompts of 256 tokens, each request adding 32 to 96 unique tokens) through
   the router; per request: latency, the router's matched tokens (``x-kvevents-matched-
   tokens``) and the engine's own ``cached_tokens``.
2. After flushing every rank's cache, the same requests straight to the engine's
   ``/v1/completions`` (its round-robin): the latency baseline, and the hit rate
   without KV-aware routing, from the same cold start.
3. ``N / 4`` streamed completions (``max_tokens`` 16), through the router and directly:
   time to the first chunk and to the end.

Reported: latency p50/p99 both ways and the router's added median; the fraction of
requests whose predicted matched tokens equal the engine's cached tokens, and the
engine-reported hit rate. JSON goes to ``--json`` (default
``benchmarks/results/openai_proxy.json``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from kvevents.demo.procs import Child
from kvevents.results import write_results
from kvevents.transport.endpoints import free_port_range

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "openai_proxy.json"
PAGE = 16


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(256) for _ in range(256)] for _ in range(8)]
    return [
        systems[rng.randrange(8)] + [rng.randrange(256) for _ in range(rng.randrange(32, 97))]
        for _ in range(n)
    ]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_requests(client: httpx.Client, url: str, prompts: list[list[int]]) -> dict[str, Any]:
    latencies, exact, predicted_any, cached, prompt_total = [], 0, False, 0, 0
    for prompt in prompts:
        t0 = time.perf_counter()
        response = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        latencies.append(time.perf_counter() - t0)
        response.raise_for_status()
        engine_cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = response.headers.get("x-kvevents-matched-tokens")
        predicted_any |= predicted is not None
        exact += predicted is not None and int(predicted) == engine_cached
        cached += engine_cached
        prompt_total += len(prompt)
    return {
        "requests": len(prompts),
        "p50_ms": pct(latencies, 0.5) * 1000,
        "p99_ms": pct(latencies, 0.99) * 1000,
        "mean_ms": statistics.fmean(latencies) * 1000,
        "prediction_exact": exact / len(prompts) if predicted_any else None,
        "engine_hit_rate": cached / prompt_total,
    }


def run_streams(client: httpx.Client, url: str, prompts: list[list[int]]) -> dict[str, Any]:
    first, total = [], []
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 16, "stream": True}
        t0 = time.perf_counter()
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            chunks = response.iter_raw()
            next(chunks)
            first.append(time.perf_counter() - t0)
            for _ in chunks:
                pass
        total.append(time.perf_counter() - t0)
    return {
        "streams": len(prompts),
        "first_chunk_p50_ms": pct(first, 0.5) * 1000,
        "first_chunk_p99_ms": pct(first, 0.99) * 1000,
        "complete_p50_ms": pct(total, 0.5) * 1000,
    }


def wait_ready(client: httpx.Client, router: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        streams = client.get(f"{router}/workers").json()["streams"]
        if sum(s["status"] == "connected" for s in streams) == 2:
            return
        time.sleep(0.1)
    raise RuntimeError("the router did not connect to both ranks in 30 s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per path")
    parser.add_argument("--quick", action="store_true", help="200 requests per path")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    n = 200 if args.quick else args.requests
    base = free_port_range(4)
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{base}",
        "replay_endpoint": f"tcp://*:{base + 2}",
    }
    engine = Child("engine", ["--port", "0", "--dp-size", "2", "--page-size", str(PAGE),
                              "--kv-events-config", json.dumps(config)])  # fmt: skip
    router = Child("router", ["--port", "0", "--workers", "1"])
    try:
        engine_url = engine.start(60)
        router.argv += [
            "--engine", engine_url, "--kv-endpoint", f"tcp://*:{base}",
            "--replay-endpoint", f"tcp://*:{base + 2}", "--dp-size", "2",
            "--engine-kind", "kvevents",
        ]  # fmt: skip
        router_url = router.start(60)
        prompts = workload(n)
        with httpx.Client(timeout=60.0) as client:
            wait_ready(client, router_url)
            routed = run_requests(client, router_url, prompts)
            client.post(f"{engine_url}/flush_cache").raise_for_status()
            direct = run_requests(client, engine_url, prompts)
            streams = prompts[: max(1, n // 4)]
            routed_streams = run_streams(client, router_url, streams)
            direct_streams = run_streams(client, engine_url, streams)
    finally:
        router.stop(20)
        engine.stop(20)
    result = {
        "benchmark": "openai_proxy",
        "requests": n,
        "routed": routed,
        "direct": direct,
        "router_added_p50_ms": routed["p50_ms"] - direct["p50_ms"],
        "routed_streams": routed_streams,
        "direct_streams": direct_streams,
    }
    table = Table(title=f"/v1/completions, {n} requests, one at a time")
    for column in (
        "path",
        "p50 ms",
        "p99 ms",
        "first chunk p50 ms",
        "prediction exact",
        "engine hit rate",
    ):
        table.add_column(column, justify="right")
    for name, plain, stream in (
        ("via router", routed, routed_streams),
        ("direct", direct, direct_streams),
    ):
        table.add_row(
            name,
            f"{plain['p50_ms']:.2f}",
            f"{plain['p99_ms']:.2f}",
            f"{stream['first_chunk_p50_ms']:.2f}",
            f"{plain['prediction_exact']:.1%}" if name == "via router" else "-",
            f"{plain['engine_hit_rate']:.1%}",
        )
    Console().print(table)
    print(f"router adds {result['router_added_p50_ms']:.2f} ms at the median")
    write_results(args.json, result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
