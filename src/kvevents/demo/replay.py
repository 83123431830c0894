"""Replaying a trace against a target: compressed arrival times, bounded concurrency.

A :class:`Workload` is the first ``N`` requests of a Mooncake trace with their arrival
offsets divided by ``speedup``. :func:`replay` sends request ``i`` at its compressed
arrival time, or as soon as one of ``concurrency`` slots frees up if the target is
behind, so the load follows the trace's own bursts and never exceeds ``concurrency``
requests in flight. Every request is a real ``POST /generate`` with the request's token
ids; what the target answers (``dp_rank``, ``prompt_tokens``, ``cached_tokens``, and
through a router the blocks it counted as cached) is recorded per request, in arrival
order. Token ids are generated as each request is sent (:func:`kvevents.traces.request_tokens`),
so memory holds one request's tokens per slot.

Several targets are taken in turn, from a list the caller may change while the replay
runs (the demo's restart step swaps a killed replica for its successor). A request whose
connection fails is sent once more, to the next target, as a load balancer would
(:attr:`PolicyRun.retried` counts those). A caller that sends requests another way (the
P/D demo's baseline) gives ``send`` and keeps the arrival times and the bound in flight.

:func:`pooled_upper_bound` replays the same requests, in the same order, on one
in-process :class:`~kvevents.engine.cache.PrefixCache` holding the capacity of all ranks
together: the hit rate no placement on separate caches can beat while nothing is
evicted (up to the order in which concurrent requests happen to be admitted); once LRU
evicts, separate caches may pass it a little. Its hits are counted as an engine's are,
at most the blocks an engine reuses (the cache applies :mod:`kvevents.index.reusable`),
so the bound and the engines' hit rates agree. The P/D demo's pooled bound is this
function on the prefill legs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from kvevents.engine.cache import PrefixCache
from kvevents.errors import ConfigError
from kvevents.traces import TraceRequest, load_trace, request_tokens
from kvevents.wire.hashing import get_hash_scheme

__all__ = [
    "Outcome",
    "PolicyRun",
    "Sender",
    "TargetGone",
    "Workload",
    "pooled_upper_bound",
    "replay",
    "send_generate",
]


@dataclass(frozen=True)
class Workload:
    """The requests to replay and how: see the module docstring."""

    requests: tuple[TraceRequest, ...]
    speedup: float
    max_new_tokens: int
    trace_name: str

    @classmethod
    def load(
        cls, trace: str | Path | None, count: int, *, speedup: float, max_new_tokens: int
    ) -> Workload:
        if count < 1:
            raise ConfigError(f"--requests {count}: must be at least 1")
        if not speedup > 0:
            raise ConfigError(f"--speedup {speedup}: must be > 0 (trace seconds per second)")
        if max_new_tokens < 0:
            raise ConfigError(f"--max-new-tokens {max_new_tokens}: must be >= 0")
        try:
            requests = load_trace(trace, count)
        except OSError as exc:
            raise ConfigError(f"--trace {trace}: cannot read it ({exc.strerror})") from None
        except ValueError as exc:
            raise ConfigError(f"--trace: {exc}") from None
        if not requests:
            raise ConfigError(f"--trace {trace}: the file holds no requests")
        name = "conversation_trace.jsonl (bundled)" if trace is None else Path(trace).name
        return cls(tuple(requests), speedup, max_new_tokens, name)

    def __len__(self) -> int:
        return len(self.requests)

    def arrival_s(self, i: int) -> float:
        """Compressed arrival time of request ``i``, seconds after the first one."""
        first = self.requests[0].timestamp
        return (self.requests[i].timestamp - first) / 1000.0 / self.speedup

    def new_tokens(self, i: int) -> int:
        return min(self.requests[i].output_length, self.max_new_tokens)

    def body(self, i: int) -> bytes:
        """The JSON body of ``POST /generate`` for request ``i`` (no rank: the target picks)."""
        tokens = request_tokens(self.requests[i]).tolist()
        return msgspec.json.encode({"input_ids": tokens, "max_new_tokens": self.new_tokens(i)})


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the target answered for one request (``dp_rank`` is -1 when it failed)."""

    dp_rank: int
    prompt_tokens: int
    cached_tokens: int
    sent_s: float
    latency_s: float
    error: str | None = None
    target: str = ""
    """The URL the request was answered by."""
    router_cached_blocks: float | None = None
    """Blocks the router counted as cached on the chosen rank (its answer's
    ``router.cached_blocks``); None when the target is not a router."""
    routed: dict[str, Any] | None = None
    """The answer's ``router`` member as it came (where a router sent the request)."""


@dataclass
class PolicyRun:
    """One replay of a workload: outcomes in arrival order, and its wall time."""

    name: str
    outcomes: list[Outcome | None] = field(default_factory=list)
    wall_s: float = 0.0
    started: float = 0.0
    """``time.monotonic()`` when the replay began (``Outcome.sent_s`` counts from it)."""
    retried: int = 0
    """Requests sent again to another target after their connection failed."""

    @property
    def failed(self) -> list[str]:
        return [o.error for o in self.outcomes if o is not None and o.error is not None]


class TargetGone(Exception):
    """The connection to the target failed: worth sending to another one."""


async def send_generate(client: httpx.AsyncClient, url: str, body: bytes, t0: float) -> Outcome:
    """POST ``body`` to ``url`` (a ``/generate``) and read the answer as an :class:`Outcome`
    (an error one when it failed); :class:`TargetGone` when the connection failed."""
    sent = time.monotonic()
    try:
        response = await client.post(
            url, content=body, headers={"content-type": "application/json"}
        )
        answer = response.json() if response.status_code == 200 else None
    except httpx.TransportError as exc:
        raise TargetGone(f"{type(exc).__name__}: {exc}") from None
    except (httpx.HTTPError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        return Outcome(-1, 0, 0, sent - t0, time.monotonic() - sent, error)
    if not isinstance(answer, dict):
        error = f"HTTP {response.status_code}: {response.text[:200]}"
        return Outcome(-1, 0, 0, sent - t0, time.monotonic() - sent, error)
    try:
        rank, prompt, cached = (
            int(answer[k]) for k in ("dp_rank", "prompt_tokens", "cached_tokens")
        )
    except (KeyError, TypeError, ValueError):
        error = f"answer lacks dp_rank, prompt_tokens or cached_tokens: {response.text[:200]}"
        return Outcome(-1, 0, 0, sent - t0, time.monotonic() - sent, error)
    routed = answer.get("router")
    counted = routed.get("cached_blocks") if isinstance(routed, dict) else None
    return Outcome(
        rank,
        prompt,
        cached,
        sent - t0,
        time.monotonic() - sent,
        target=url,
        router_cached_blocks=float(counted) if isinstance(counted, int | float) else None,
        routed=routed if isinstance(routed, dict) else None,
    )


Sender = Callable[[httpx.AsyncClient, int, bytes, float], Awaitable[Outcome]]
"""Sends request ``i`` (its ``/generate`` body) on the replay's client; ``t0`` is the
replay's start (``Outcome.sent_s`` counts from it)."""


async def replay(
    name: str,
    workload: Workload,
    url: str | list[str],
    *,
    concurrency: int,
    on_done: Callable[[Outcome], None] | None = None,
    timeout: float = 120.0,
    send: Sender | None = None,
) -> PolicyRun:
    """Send every request of ``workload`` to ``url`` (a ``/generate`` endpoint, or several,
    taken in turn: request ``i`` goes to ``url[i % len(url)]``, the list as it is when
    the request is sent), or with ``send`` (``url`` unused); see the module docstring."""
    urls = [url] if isinstance(url, str) else url
    if concurrency < 1:
        raise ConfigError(f"--concurrency {concurrency}: must be at least 1")
    run = PolicyRun(name, [None] * len(workload))
    slots = asyncio.Semaphore(concurrency)
    # Idle connections expire before the servers' (uvicorn: 5 s) keep-alive timeout closes them.
    # Two per request: a ``send`` may hold two legs open at once, and a leg waiting for its
    # other half must never wait for a connection that half needs.
    limits = httpx.Limits(
        max_connections=2 * concurrency,
        max_keepalive_connections=2 * concurrency,
        keepalive_expiry=2.0,
    )
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = run.started = time.monotonic()

        async def send_one(i: int) -> Outcome:
            body = workload.body(i)
            if send is not None:
                return await send(client, i, body, t0)
            now = tuple(urls)  # one copy: another thread may change the list
            try:
                return await send_generate(client, now[i % len(now)], body, t0)
            except TargetGone:
                run.retried += 1
            now = tuple(urls)
            try:
                return await send_generate(client, now[(i + 1) % len(now)], body, t0)
            except TargetGone as exc:
                return Outcome(-1, 0, 0, time.monotonic() - t0, 0.0, str(exc))

        async def one(i: int) -> None:
            try:
                outcome = await send_one(i)
            finally:
                slots.release()
            run.outcomes[i] = outcome
            if on_done is not None:
                on_done(outcome)

        tasks: list[asyncio.Task[None]] = []
        try:
            for i in range(len(workload)):
                delay = t0 + workload.arrival_s(i) - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await slots.acquire()
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        run.wall_s = time.monotonic() - t0
    return run


def pooled_upper_bound(
    workload: Workload, page_size: int, capacity: int, hash_scheme: str = "sglang"
) -> list[tuple[int, int]]:
    """``(prompt_tokens, cached_tokens)`` per request on one cache of ``capacity`` pages.

    O(total prompt tokens): one hash per page, as the engine's own cache does.
    """
    cache = PrefixCache(page_size, capacity, get_hash_scheme(hash_scheme, seed="0"))
    out: list[tuple[int, int]] = []
    for request in workload.requests:
        admission = cache.admit(request_tokens(request))
        cache.release(admission)
        cache.take_events()
        out.append((admission.prompt_tokens, admission.cached_tokens))
    return out


def hit_rate(pairs: Sequence[tuple[int, int]]) -> float:
    """Cached prompt tokens over prompt tokens of ``(prompt, cached)`` pairs (0.0 if empty)."""
    prompt = sum(p for p, _ in pairs)
    return sum(c for _, c in pairs) / prompt if prompt else 0.0
