"""The disaggregated demo's baseline: the router's decode choice, prefill ranks in turn.

What the baseline must change is the prefill choice alone. ``kvevents router`` has no
option for that: ``--policy round-robin`` applies to both pools, so the decode choice
(and with it which requests skip the prefill hop) would change too. The baseline
therefore does what a gateway in front of the engines would: per request it asks the
router's ``POST /route`` (``"record": true``, so the router's balance and predictions
count the request as its relay would; only the relay counts it in flight), keeps the
decode holder and the router's verdict on the prefill hop, and when there is one sends
it to the next prefill rank in turn (every rank of every prefill engine), both legs at
once in SGLang's protocol (:func:`kvevents.router.serve.pd_legs.sglang_legs`: a fresh
``bootstrap_room`` joining them). A skipped prefill goes to the decode alone, its rank
pinned (:func:`~kvevents.router.serve.pd_legs.pinned_body`).

The outcome is the decode's answer, read as the replay reads any
(:func:`~kvevents.demo.replay.send_generate`), timed from the ``/route`` call, with a
``routed`` member shaped like the router's own ``router`` member (``decode``,
``prefill``, ``prefill_skipped``), so both runs are summed by the same code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import msgspec

from kvevents.demo.replay import Outcome, TargetGone, send_generate
from kvevents.router.serve.pd_legs import new_rooms, pinned_body, sglang_legs

__all__ = ["RoundRobinPrefill"]

_JSON = {"content-type": "application/json"}


class RoundRobinPrefill:
    """A :data:`~kvevents.demo.replay.Sender` for the baseline (see the module docstring).

    ``prefills``: the prefill ranks taken in turn, as ``(engine URL, dp rank)``;
    ``bootstrap``: each prefill engine's bootstrap server, ``(host, port)`` by URL.
    """

    def __init__(
        self,
        router_url: str,
        prefills: Sequence[tuple[str, int]],
        bootstrap: Mapping[str, tuple[str, int]],
    ) -> None:
        if not prefills:
            raise ValueError("RoundRobinPrefill: give at least one prefill rank")
        self.route_url = f"{router_url.rstrip('/')}/route"
        self.prefills = list(prefills)
        self.bootstrap = dict(bootstrap)
        self.turn = 0

    async def __call__(self, client: httpx.AsyncClient, i: int, body: bytes, t0: float) -> Outcome:
        sent = time.monotonic()
        request = msgspec.json.decode(body)
        routed, error = await self._route(client, request)
        if routed is None:
            return Outcome(-1, 0, 0, sent - t0, time.monotonic() - sent, error)
        decode_url, decode_rank = str(routed["worker"]), int(routed["dp_rank"])
        info: dict[str, Any] = {
            "decode": {"worker": decode_url, "dp_rank": decode_rank},
            "prefill": None,
            "prefill_skipped": bool(routed["prefill_skipped"]),
            "uncached_tokens": routed.get("uncached_tokens"),
        }
        if info["prefill_skipped"]:
            alone = msgspec.json.encode(pinned_body(request, decode_rank))
            outcome = await _decode(client, decode_url, alone, t0)
        else:
            url, rank = self.prefills[self.turn % len(self.prefills)]
            self.turn += 1
            info["prefill"] = {"worker": url, "dp_rank": rank}
            host, port = self.bootstrap[url]
            prefill_body, decode_body = sglang_legs(
                request,
                host=host,
                port=port,
                rooms=new_rooms(1, 1, batched=False),
                prefill_rank=rank,
                decode_rank=decode_rank,
            )
            outcome, prefill_error = await asyncio.gather(
                _decode(client, decode_url, msgspec.json.encode(decode_body), t0),
                _prefill(client, url, msgspec.json.encode(prefill_body)),
            )
            if prefill_error is not None and outcome.error is None:
                outcome = dataclasses.replace(outcome, dp_rank=-1, error=prefill_error)
        return dataclasses.replace(
            outcome, sent_s=sent - t0, latency_s=time.monotonic() - sent, routed=info
        )

    async def _route(
        self, client: httpx.AsyncClient, request: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, str | None]:
        body = msgspec.json.encode({"input_ids": request["input_ids"], "record": True})
        try:
            response = await client.post(self.route_url, content=body, headers=_JSON)
        except httpx.HTTPError as exc:
            return None, f"/route: {type(exc).__name__}: {exc}"
        if response.status_code != 200:
            return None, f"/route: HTTP {response.status_code}: {response.text[:200]}"
        answer = response.json()
        if not isinstance(answer, dict) or "prefill_skipped" not in answer:
            return None, f"/route answered no P/D decision: {response.text[:200]}"
        return answer, None


async def _decode(client: httpx.AsyncClient, url: str, body: bytes, t0: float) -> Outcome:
    sent = time.monotonic()
    try:
        return await send_generate(client, f"{url}/generate", body, t0)
    except TargetGone as exc:
        return Outcome(-1, 0, 0, sent - t0, time.monotonic() - sent, f"decode leg: {exc}")


async def _prefill(client: httpx.AsyncClient, url: str, body: bytes) -> str | None:
    """Send the prefill leg; its error, or None when it answered 200."""
    try:
        response = await client.post(f"{url}/generate", content=body, headers=_JSON)
    except httpx.HTTPError as exc:
        return f"prefill leg to {url}: {type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return f"prefill leg to {url}: HTTP {response.status_code}: {response.text[:200]}"
    return None
