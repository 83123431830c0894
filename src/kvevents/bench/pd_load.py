"""The P/D router benchmark's two clients: both legs sent directly, or one request to the router.

:func:`run_load` keeps ``connections`` requests in flight for ``warmup + duration``
seconds, on one event loop in this process with the project's HTTP client
(:class:`~kvevents.http.upstream.Upstream`, kept-alive connections), and reports the
latencies of the requests sent after the warm-up (from sending to the decode's whole
answer) and the CPU seconds this process spent per request. A request is one
:class:`Send`:

* :class:`ViaRouter`: the client's body to the router's ``/v1/completions``;
* :class:`DirectLegs`: SGLang's two legs at once, built from the same body by
  :func:`kvevents.router.serve.pd_legs.sglang_legs` with a fixed pair of ranks. The
  decode's answer is awaited; the prefill's is read as it comes and only checked, as the
  router reads it behind the decode's.
* :class:`VllmDirectLegs`: vLLM's legs in turn, the fixed ranks in the
  ``X-data-parallel-rank`` header: the prefill leg
  (:func:`~kvevents.router.serve.pd_legs.vllm_prefill_body`), then the client's body with
  the ``kv_transfer_params`` the prefill answered, read and appended as the router does
  (:func:`~kvevents.router.serve.pd_body.transfer_params`).

Each SGLang leg body is encoded once per prompt with a placeholder ``bootstrap_room``
(:data:`ROOM_PLACEHOLDER`) and a fresh room is spliced in per request (vLLM's prefill
legs are encoded once per prompt), so neither client spends more on a body than a copy:
the two differ by what the router does.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from kvevents.http.upstream import Upstream
from kvevents.http.upstream_answers import FullResponse
from kvevents.http.upstream_errors import UpstreamError
from kvevents.router.serve.pd_body import transfer_params, vllm_decode_bytes
from kvevents.router.serve.pd_legs import sglang_legs, vllm_prefill_body
from kvevents.router.serve.relay_headers import RANK_HEADER

__all__ = ["ROOM_PLACEHOLDER", "DirectLegs", "Send", "ViaRouter", "VllmDirectLegs", "run_load"]

ROOM_PLACEHOLDER = 1_234_567_890_123_456_789
"""The room the leg bodies are encoded with; 19 digits no other field of them holds."""
_PATH = "/v1/completions"
_HEADERS = {"content-type": "application/json"}
_FAILURES = (UpstreamError, TimeoutError, OSError)


class Send(Protocol):
    """One request, ``i`` choosing its body; True when it was answered 200."""

    async def __call__(self, upstream: Upstream, i: int) -> bool: ...


class ViaRouter:
    """Posts ``bodies[i % len(bodies)]`` to the router's ``/v1/completions``."""

    def __init__(self, router_url: str, bodies: Sequence[dict[str, Any]]) -> None:
        self.url = router_url
        self.bodies = [msgspec.json.encode(b) for b in bodies]

    async def __call__(self, upstream: Upstream, i: int) -> bool:
        body = self.bodies[i % len(self.bodies)]
        answer: FullResponse = await upstream.post_whole(self.url, _PATH, body, _HEADERS)
        return answer.status == 200


class DirectLegs:
    """Sends both legs of ``bodies[i % len(bodies)]`` itself (see the module docstring).

    ``bootstrap``: the prefill engine's bootstrap server ``(host, port)``; ``ranks``:
    the fixed ``(prefill, decode)`` DP ranks. ``prefill_failures`` counts prefill legs
    that did not answer 200.
    """

    def __init__(
        self,
        prefill_url: str,
        decode_url: str,
        bootstrap: tuple[str, int],
        bodies: Sequence[dict[str, Any]],
        ranks: tuple[int, int] = (0, 0),
    ) -> None:
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.prefill_failures = 0
        self.legs: list[tuple[bytes, bytes]] = []
        for body in bodies:
            prefill, decode = sglang_legs(
                body,
                host=bootstrap[0],
                port=bootstrap[1],
                rooms=ROOM_PLACEHOLDER,
                prefill_rank=ranks[0],
                decode_rank=ranks[1],
            )
            self.legs.append((msgspec.json.encode(prefill), msgspec.json.encode(decode)))
        self._placeholder = b"%d" % ROOM_PLACEHOLDER

    async def __call__(self, upstream: Upstream, i: int) -> bool:
        prefill_body, decode_body = self.legs[i % len(self.legs)]
        room = b"%d" % random.getrandbits(63)
        mark = self._placeholder
        prefill = upstream.post_whole(
            self.prefill_url, _PATH, prefill_body.replace(mark, room, 1), _HEADERS
        )
        prefill.add_done_callback(self._prefill_done)
        decode = upstream.post_whole(
            self.decode_url, _PATH, decode_body.replace(mark, room, 1), _HEADERS
        )
        answer: FullResponse = await decode
        return answer.status == 200

    def _prefill_done(self, answer: asyncio.Future[FullResponse]) -> None:
        if answer.cancelled() or answer.exception() is not None or answer.result().status != 200:
            self.prefill_failures += 1


class VllmDirectLegs:
    """Sends vLLM's legs of ``bodies[i % len(bodies)]`` itself, one after the other (see
    the module docstring); ``ranks``: the fixed ``(prefill, decode)`` DP ranks.
    ``prefill_failures`` counts prefill legs that did not answer 200 (the decode leg is
    then not sent, as the router would not send it)."""

    def __init__(
        self,
        prefill_url: str,
        decode_url: str,
        bodies: Sequence[dict[str, Any]],
        ranks: tuple[int, int] = (0, 0),
    ) -> None:
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.prefill_failures = 0
        self.legs = [
            (msgspec.json.encode(vllm_prefill_body(b)), msgspec.json.encode(b)) for b in bodies
        ]
        self._headers = [{**_HEADERS, RANK_HEADER: str(rank)} for rank in ranks]

    async def __call__(self, upstream: Upstream, i: int) -> bool:
        prefill_body, body = self.legs[i % len(self.legs)]
        prefill_headers, decode_headers = self._headers
        prefilled: FullResponse = await upstream.post_whole(
            self.prefill_url, _PATH, prefill_body, prefill_headers
        )
        if prefilled.status != 200:
            self.prefill_failures += 1
            return False
        try:
            decode = vllm_decode_bytes(body, transfer_params(prefilled.body))
        except msgspec.DecodeError:  # the router answers 502 for it
            self.prefill_failures += 1
            return False
        answer: FullResponse = await upstream.post_whole(
            self.decode_url, _PATH, decode, decode_headers
        )
        return answer.status == 200


def _percentile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def run_load(
    send: Send, *, connections: int, duration: float, warmup: float, timeout: float = 60.0
) -> dict[str, Any]:
    """``connections`` requests in flight for ``warmup + duration`` seconds; the figures
    of the requests sent after the warm-up (see the module docstring)."""
    upstream = Upstream(timeout=timeout)
    latencies: list[float] = []
    errors = [0, 0]  # after the warm-up, in all
    count = itertools.count()
    began = time.perf_counter()
    measure_from, end = began + warmup, began + warmup + duration
    cpu = time.process_time()

    async def worker() -> None:
        while (sent := time.perf_counter()) < end:
            i = next(count)
            try:
                ok = await send(upstream, i)
            except _FAILURES:
                ok = False
            if sent >= measure_from:
                latencies.append(time.perf_counter() - sent)
                errors[0] += not ok
            errors[1] += not ok

    try:
        await asyncio.gather(*(worker() for _ in range(connections)))
    finally:
        await upstream.close()
    total = next(count)
    ordered = sorted(latencies)
    return {
        "requests": len(ordered),
        "requests_all": total,
        "requests_per_s": len(ordered) / duration,
        "p50_ms": _percentile(ordered, 0.50) * 1000,
        "p90_ms": _percentile(ordered, 0.90) * 1000,
        "p99_ms": _percentile(ordered, 0.99) * 1000,
        "mean_ms": statistics.fmean(ordered) * 1000 if ordered else 0.0,
        "errors": errors[0],
        "errors_all": errors[1],
        "connections": connections,
        "duration_s": duration,
        "warmup_s": warmup,
        "client_cpu_us_per_request": (time.process_time() - cpu) / total * 1e6 if total else None,
    }
