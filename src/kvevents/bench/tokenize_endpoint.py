"""What ``--tokenize-endpoint`` costs the router per text prompt: its engine client against httpx.

A router started with ``--tokenize-endpoint`` asks the engine's ``/tokenize`` for every
text prompt and chat it routes, so that request is on the hot path of text routing.
This benchmark starts a real ``kvevents engine`` and, in this process, sends it the
same ``/tokenize`` request one at a time, in alternating rounds, two ways:

* ``upstream``: :class:`~kvevents.router.prompts.tokenize.EndpointTokenizer` as the router
  runs it, posting through the router's engine client (:class:`~kvevents.http.upstream.Upstream`);
* ``httpx``: the same request through one kept-alive ``httpx.AsyncClient`` and
  ``response.json()``, a general-purpose client for comparison.

Per way it reports this process's CPU per request (what the router spends; the engine's
work is in another process) and the wall time per request, p50 over the rounds.
Both ways must return the same ids, or the benchmark fails.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from kvevents.demo.procs import Child
from kvevents.http.upstream import Upstream
from kvevents.router.prompts.tokenize import EndpointTokenizer

__all__ = ["run_tokenize_endpoint_bench"]

_TEXT = "Route each request to the replica that already holds its prefix. " * 32
"""About 2,100 characters: 2,100 ids from the simulated engine's byte tokenizer."""


def run_tokenize_endpoint_bench(*, requests: int = 2000, rounds: int = 3) -> dict[str, Any]:
    """Start an engine, time both ways ``rounds`` times each; see the module docstring."""
    if requests < 1 or rounds < 1:
        raise ValueError(f"requests={requests}, rounds={rounds}: give at least 1 of each")
    engine = Child("engine", ["--port", "0"])
    try:
        url = engine.start(timeout=60.0)
        return asyncio.run(_measure(f"{url}/tokenize", requests, rounds))
    finally:
        engine.stop()


async def _measure(url: str, requests: int, rounds: int) -> dict[str, Any]:
    upstream = Upstream(timeout=30.0)
    tokenizer = EndpointTokenizer(url, upstream)
    client = httpx.AsyncClient(timeout=30.0)
    body = {"prompt": _TEXT, "add_special_tokens": True}

    async def through_httpx() -> list[int]:
        response = await client.post(url, json=body)
        response.raise_for_status()
        tokens: list[int] = response.json()["tokens"]
        return tokens

    async def through_upstream() -> list[int]:
        return await tokenizer.encode(_TEXT)

    ways: dict[str, Callable[[], Awaitable[list[int]]]] = {
        "upstream": through_upstream,
        "httpx": through_httpx,
    }
    try:
        ids = await through_upstream()
        if await through_httpx() != ids:
            raise RuntimeError("the two ways tokenized the same prompt differently")
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, way in ways.items():
                for _ in range(min(100, requests)):  # warm the connection and caches
                    await way()
                cpu0, wall0 = time.process_time(), time.perf_counter()
                for _ in range(requests):
                    await way()
                cpu = (time.process_time() - cpu0) / requests
                wall = (time.perf_counter() - wall0) / requests
                samples[name].append((cpu * 1e6, wall * 1e6))
    finally:
        await client.aclose()
        await upstream.close()
    results: dict[str, Any] = {
        "settings": {"requests": requests, "rounds": rounds, "prompt_ids": len(ids)},
        "ways": {},
    }
    for name, measured in samples.items():
        results["ways"][name] = {
            "cpu_us_per_request": round(statistics.median(c for c, _ in measured), 1),
            "wall_us_per_request": round(statistics.median(w for _, w in measured), 1),
            "rounds_cpu_us": [round(c, 1) for c, _ in measured],
        }
    ways_out = results["ways"]
    results["cpu_ratio"] = round(
        ways_out["httpx"]["cpu_us_per_request"] / ways_out["upstream"]["cpu_us_per_request"], 1
    )
    return results
