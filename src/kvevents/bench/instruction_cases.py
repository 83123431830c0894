"""One case of the instruction-count benchmark, run in process: ``python -m
kvevents.bench.instruction_cases CASE REQUESTS``.

:mod:`kvevents.bench.instructions` runs this module under callgrind, once with
``REQUESTS`` 0 and once with many, and divides the difference: the instructions one
request of ``CASE`` costs, the same on every run of the same code on the same machine,
whatever else the machine is doing. Each case is the work a request costs past the HTTP
server, exactly as the router's server calls it, with nothing to wait for:

* ``bare``: the bare server's ``/route`` (:mod:`kvevents.bench.bare_server`): the body
  decoded as the router decodes it, the token count answered: the ceiling's work;
* ``route`` and ``query``: the router's :meth:`~kvevents.router.serve.hot_path.HotPath.answer_inline`;
* ``bare_relay``: the bare relay's ``/v1/completions``, its engine answering at once;
* ``relay``: the router's relayed completion (:meth:`OpenAIRelay.inline
  <kvevents.router.serve.openai_relay.OpenAIRelay.inline>`: decode, route, the rank added,
  headers, the engine's answer taken), its engine answering at once.

For both relays the engine request's head is built as the forwarding client builds it,
so both count the same head work.

The router holds ``PROMPTS`` prompts of ``TOKENS`` tokens, block 16, each stored on one
of 4 ranks, and the requests cycle through them, as in ``kvevents bench router``. The
native core is loaded and the heap frozen, as in a router that has settled.
"""

from __future__ import annotations

import asyncio
import gc
import random
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import NamedTuple

import msgspec

from kvevents import kernels
from kvevents.bench.bare_server import BareApp
from kvevents.http.upstream import Upstream
from kvevents.http.upstream_answers import FullResponse
from kvevents.index.predictions import DEFAULT_PREDICTION_TTL_S
from kvevents.router.decide.router import Router
from kvevents.router.serve.hot_path import HotPath
from kvevents.router.serve.service import RouterService
from kvevents.types import Holder

__all__ = ["CASES", "PROMPTS", "TOKENS", "AnsweringUpstream", "Cases", "build_cases", "main"]

PROMPTS = 256
TOKENS = 2048
_BLOCK = 16
_RANKS = 4
_ENGINE = "http://127.0.0.1:9"  # never contacted: the upstream below answers in process
_HEADERS = [
    (b"host", b"127.0.0.1:8000"),
    (b"user-agent", b"wrk"),
    (b"content-type", b"application/json"),
]
# what the simulated engine answers a 1-token completion of a cached prompt
_ANSWER = msgspec.json.encode(
    {
        "id": "cmpl-0",
        "object": "text_completion",
        "model": "sim",
        "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": TOKENS,
            "completion_tokens": 1,
            "total_tokens": TOKENS + 1,
            "prompt_tokens_details": {"cached_tokens": TOKENS},
        },
    }
)


class AnsweringUpstream(Upstream):
    """An engine that answers every forwarded request at once, with :data:`_ANSWER`."""

    def __init__(self) -> None:
        super().__init__(timeout=60.0)
        self.forwarded = 0
        self.last: tuple[str, bytes, Mapping[str, str] | bytes] | None = None
        """The last request forwarded: its path, body and headers."""

    def post_whole(
        self,
        base: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | bytes,
        *,
        timeout: float | None = None,
    ) -> asyncio.Future[FullResponse]:
        self.forwarded += 1
        self.last = (path, body, headers)
        self._start(base, path, body, headers, timeout)  # the request's head, as it would be
        answered: asyncio.Future[FullResponse] = asyncio.get_running_loop().create_future()
        answered.set_result(FullResponse(200, {"content-type": "application/json"}, _ANSWER))
        return answered


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(1, 50_000) for _ in range(TOKENS)] for _ in range(PROMPTS)]


def _router(prompts: list[list[int]]) -> Router:
    router = Router(block_size=_BLOCK, prediction_ttl_s=DEFAULT_PREDICTION_TTL_S)
    holders = [Holder(_ENGINE, rank) for rank in range(_RANKS)]
    for holder in holders:
        router.add_holder(holder, block_size=_BLOCK, source="configured")
    for i, prompt in enumerate(prompts):
        router.index.store_keys(holders[i % _RANKS], router.index.keys_for(prompt))
    router.index.sync_mirror()
    return router


class Cases(NamedTuple):
    """Every case, and what they serve with (for tests to look into)."""

    run: Mapping[str, Callable[[int], Awaitable[None]]]
    """Per case, one request: the ``i``-th prompt's (``i`` taken modulo :data:`PROMPTS`)."""
    service: RouterService
    router_engine: AnsweringUpstream
    bare_engine: AnsweringUpstream


def build_cases() -> Cases:
    """The router and the bare server of the module docstring, and a request of each case."""
    prompts = _prompts()
    ids = [msgspec.json.encode({"input_ids": p}) for p in prompts]
    completions = [
        msgspec.json.encode({"model": "sim", "prompt": p, "max_tokens": 1}) for p in prompts
    ]
    router_engine, bare_engine = AnsweringUpstream(), AnsweringUpstream()
    service = RouterService(_router(prompts), [_ENGINE], upstream=router_engine)
    hot = HotPath(service, _no_fallback)
    bare = BareApp(_ENGINE, upstream=bare_engine)

    def answered(status: int | None) -> None:
        if status != 200:
            raise RuntimeError(f"the case answered {status}, not 200: see its code")

    async def bare_route(i: int) -> None:
        result = bare.answer_inline(b"/route", _HEADERS, ids[i % PROMPTS])
        answered(None if result is None else result[0])

    async def route(i: int) -> None:
        result = hot.answer_inline(b"/route", _HEADERS, ids[i % PROMPTS])
        answered(None if result is None else result[0])

    async def query(i: int) -> None:
        result = hot.answer_inline(b"/query", _HEADERS, ids[i % PROMPTS])
        answered(None if result is None else result[0])

    async def bare_relay(i: int) -> None:
        pending = bare.answer_async_inline(b"/v1/completions", _HEADERS, completions[i % PROMPTS])
        answered((await pending)[0])

    async def relay(i: int) -> None:
        pending = hot.answer_async_inline(b"/v1/completions", _HEADERS, completions[i % PROMPTS])
        answered(None if pending is None else (await pending)[0])

    run = {
        "bare": bare_route,
        "route": route,
        "query": query,
        "bare_relay": bare_relay,
        "relay": relay,
    }
    return Cases(run, service, router_engine, bare_engine)


async def _no_fallback(scope: object, receive: object, send: object) -> None:
    raise RuntimeError("the instruction cases only call the hot path")


CASES = ("bare", "route", "query", "bare_relay", "relay")


async def _run(case: str, requests: int) -> None:
    one = build_cases().run[case]
    for i in range(PROMPTS):  # every prompt once: caches filled, first-use work done
        await one(i)
    gc.collect()
    gc.freeze()
    for i in range(requests):
        await one(i)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in CASES or not args[1].isdigit():
        print(f"usage: python -m kvevents.bench.instruction_cases {{{','.join(CASES)}}} REQUESTS")
        return 2
    if kernels.load() is None:
        print(f"the compiled kernels are off: {kernels.status()}", file=sys.stderr)
        return 1
    asyncio.run(_run(args[0], int(args[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
