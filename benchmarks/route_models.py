"""Micro benchmark: the ``/route`` hot path in-process, without and with ``model``.

    python benchmarks/route_models.py [--holders 8] [--tokens 2048] [--requests 2000]

Drives :class:`~kvevents.router.serve.hot_path.HotPath` as the ASGI server would (no
sockets, so the figure is the router's own work per request: body decode, keys, match,
score, encode) with ``{"input_ids": [...]}`` and, when the router knows models, with
``"model"`` as well. ``holders`` ranks of two engines each serving one model; every
prompt is stored on one rank, and the native core is loaded, as a router has it. Prints
CPU microseconds per request (median of 5 rounds). Run it on two checkouts to compare a
change; it is a quick check, not a CI figure.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import msgspec

from kvevents import BlockStored, Delivery, Holder, KVEventBatch, Router, kernels
from kvevents.bench.route_fleet import route_request_us
from kvevents.router.serve.app import create_app
from kvevents.router.serve.service import RouterService


def _router(holders: int, tokens: int, prompts: int, bs: int) -> tuple[Router, list[bytes]]:
    router = Router(block_size=bs)
    hs = [Holder(f"http://e{i % 2}", i // 2) for i in range(holders)]
    for h in hs:
        router.add_holder(h, block_size=bs)
    bodies = []
    for p in range(prompts):
        ids = [(p * 7919 + t) % 50_000 for t in range(tokens)]
        n = tokens // bs
        event = BlockStored(
            block_hashes=list(range(p * n + 1, p * n + n + 1)),
            parent_block_hash=None,
            token_ids=ids,
            block_size=bs,
            lora_id=None,
            medium=None,
        )
        router.handle(Delivery(hs[p % holders], p, KVEventBatch(ts=0.0, events=[event])))
        bodies.append(ids)
    return router, [msgspec.json.encode({"input_ids": b}) for b in bodies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--holders", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    kernels.load()  # as the router does (it keys and matches with them once loaded)
    router, plain = _router(args.holders, args.tokens, 64, 16)
    app = create_app(RouterService(router, []))
    rows = {"no model": plain}
    models = getattr(router, "models", None)
    if models is not None:
        from kvevents.router.decide.models import models_from_names

        models.set("http://e0", models_from_names(["m0"]))
        models.set("http://e1", models_from_names(["m1"]))
        rows["model"] = [b[:-1] + b',"model":"m0"}' for b in plain]
    for name, bodies in rows.items():
        rounds = [asyncio.run(route_request_us(app, bodies, args.requests)) for _ in range(5)]
        print(f"{name:>9}: {statistics.median(rounds):7.1f} us per /route")


if __name__ == "__main__":
    main()
