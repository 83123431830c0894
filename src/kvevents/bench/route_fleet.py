"""What one ``/route`` costs as the fleet grows: the best few scored, against every holder.

In process, no sockets (the figure is the router's own work, CPU time, median of the
rounds): a :class:`~kvevents.router.decide.router.Router` with ``ranks`` holders (4 ranks
per engine), ``prompts`` prompts of ``tokens`` tokens stored one per holder in turn, and
the loads the engines' polls would give it (some requests running on every rank), with
the native core loaded as the router has it. Per fleet size:

* ``top_us``: :meth:`Router.route` with ``top=4``, what ``POST /route`` does by default
  (:class:`~kvevents.router.decide.scoring.Ranking`: the holders the request matched, then
  the best four of the rest);
* ``every_us``: :meth:`Router.route` scoring every holder (``"all_scores": true``), in
  the same run;
* ``request_us``: the whole ``POST /route`` request through the router's ASGI app
  (body decode, route with ``top=4``, answer encode);
* ``relayed_us``: what a relayed completion asks of the router, :meth:`Router.route`
  with ``top=1`` then :meth:`~Router.begin` and :meth:`~Router.finish`: the loads
  change under every request, so no ranking serves it (the load table's scan does,
  :mod:`kvevents.router.decide.load_board`);
* ``recorded_us``: a ``/route`` with ``"record": true``, :meth:`Router.route` with
  ``top=4`` then :meth:`~Router.record`: the loads change under every request too.

Both ways must choose the same holder for every prompt, or the benchmark fails.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvevents import kernels
from kvevents.router.decide.router import Router
from kvevents.router.serve.app import create_app
from kvevents.router.serve.service import RouterService
from kvevents.types import Holder

__all__ = ["route_request_us", "run_route_fleet_bench"]

_BLOCK = 16
_TOP = 4


def _fleet(ranks: int, prompts: int, tokens: int) -> tuple[Router, list[Sequence[int]]]:
    router = Router(block_size=_BLOCK)
    holders = [Holder(f"http://engine-{i // 4}:8000", i % 4) for i in range(ranks)]
    for h in holders:
        router.add_holder(h, block_size=_BLOCK)
    for engine in range(0, ranks, 4):
        ranks_load = [{"dp_rank": r, "running": (engine + r) % 3, "waiting": 0} for r in range(4)]
        router.update_load(f"http://engine-{engine // 4}:8000", {"ranks": ranks_load})
    chosen: list[Sequence[int]] = []
    for p in range(prompts):
        ids = [(p * 7919 + t * 31) % 50_000 for t in range(tokens)]
        keys = list(router._keys(ids, None, None))
        router.index.store_keys(holders[p % ranks], keys[: len(keys) * (1 + p % 4) // 4])
        chosen.append(ids)
    return router, chosen


def _cpu_us(work: Callable[[int], object], requests: int) -> float:
    for i in range(min(200, requests)):
        work(i)
    start = time.process_time()  # CPU time: the machine is shared, wall time is noise
    for i in range(requests):
        work(i)
    return (time.process_time() - start) / requests * 1e6


async def route_request_us(app: Any, bodies: Sequence[bytes], requests: int) -> float:
    """CPU microseconds per ``POST /route`` through ASGI app ``app``, in process (no
    sockets), with ``bodies`` in turn; RuntimeError when the first is not answered 200."""
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/route", "method": "POST", "headers": []}
    start = time.process_time()
    for i in range(requests):
        body = bodies[i % len(bodies)]

        async def receive(body: bytes = body) -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        await app(scope, receive, send)
    elapsed = time.process_time() - start
    if sent[0]["status"] != 200:
        raise RuntimeError(f"/route answered {sent[0]['status']}: {sent[1]['body']!r}")
    return elapsed / requests * 1e6


def _measure(count: int, prompts: int, tokens: int, requests: int, rounds: int) -> dict[str, float]:
    """One fleet size's three figures (see the module docstring)."""
    router, chosen = _fleet(count, prompts, tokens)
    for ids in chosen:
        few, every = router.route(ids, top=_TOP), router.route(ids)
        if (few.worker, few.dp_rank) != (every.worker, every.dp_rank):
            raise RuntimeError(f"{count} ranks: the two ways chose differently")
    app = create_app(RouterService(router, []))
    bodies = [msgspec.json.encode({"input_ids": ids}) for ids in chosen]
    chosen = [array("I", ids) for ids in chosen]  # what the body's parser hands the router
    n = len(chosen)

    def relayed(i: int) -> None:
        router.finish(router.begin(router.route(chosen[i % n], top=1)))

    def recorded(i: int) -> None:
        router.record(router.route(chosen[i % n], top=_TOP))

    figures: dict[str, list[float]] = {
        "top_us": [],
        "every_us": [],
        "request_us": [],
        "relayed_us": [],
        "recorded_us": [],
    }
    for _ in range(rounds):
        figures["top_us"].append(_cpu_us(lambda i: router.route(chosen[i % n], top=_TOP), requests))
        figures["every_us"].append(_cpu_us(lambda i: router.route(chosen[i % n]), requests))
        figures["request_us"].append(asyncio.run(route_request_us(app, bodies, requests)))
        figures["relayed_us"].append(_cpu_us(relayed, requests))
        figures["recorded_us"].append(_cpu_us(recorded, requests))
    return {name: round(statistics.median(values), 2) for name, values in figures.items()}


def run_route_fleet_bench(
    *,
    ranks: Sequence[int] = (4, 16, 64, 256),
    prompts: int = 256,
    tokens: int = 2048,
    requests: int = 4000,
    rounds: int = 5,
) -> dict[str, Any]:
    """Measure every fleet size in ``ranks``; see the module docstring."""
    if not ranks or min(ranks) < 1 or requests < 1 or rounds < 1 or prompts < 1:
        raise ValueError("give at least one fleet size, request, round and prompt")
    kernels.load()  # as the router does (it keys and matches with them once loaded)
    results: dict[str, Any] = {
        "settings": {
            "prompts": prompts,
            "tokens": tokens,
            "requests": requests,
            "rounds": rounds,
            "top": _TOP,
        },
        "fleets": {},
    }
    for count in ranks:
        results["fleets"][str(count)] = _measure(count, prompts, tokens, requests, rounds)
    return results
