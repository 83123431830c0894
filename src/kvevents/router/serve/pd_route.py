"""``POST /route`` in disaggregated (P/D) mode, and the hook that puts the router in it.

``/route`` takes the body it takes in one-pool mode (token ids, text or a chat; ``model``,
``lora``, ``cache_salt``, ``extra_keys``, ``top``, ``all_scores``, ``record``) and answers
the P/D decision (:func:`~kvevents.router.decide.pd.decide_pd`)::

    {"worker", "dp_rank",             the decode holder: the instance that answers
     "recorded", "protocol",          the client, as one-pool /route names it
     "prompt_tokens", "uncached_tokens", "max_local_prefill_tokens",
     "prefill_skipped",               true: the decode instance serves alone
     "prefill_reason",                "cache" | "prediction" | "load" | null
     "decode": {...}, "prefill": {...} | null}

``decode`` and ``prefill`` are each pool's decision in one-pool ``/route``'s shape
(:class:`~kvevents.router.serve.hot_path.RouteAnswer`: the holder, its scores among its
pool, best first). Asking changes nothing unless ``"record": true``: then both holders
count the request (:meth:`Router.record`: balance and predictions), as a gateway that
sends the legs itself needs. Errors as one-pool ``/route``'s.

:func:`serve_pd` turns a :class:`~kvevents.router.serve.hot_path.HotPath` to P/D mode:
the relay's paths (:data:`~kvevents.router.serve.pd_request.PD_PATHS`, ``/generate``
included) go to :class:`~kvevents.router.serve.pd_relay.PDRelay`, from the parser's
callbacks when their answer is written whole (:meth:`PDRelay.inline_path`), and
``/route`` here; ``/query`` is answered as in one-pool mode (every holder of both pools).
"""

from __future__ import annotations

import msgspec

from kvevents.router.decide.pd import PDDecision, decide_pd
from kvevents.router.serve.hot_path import HotPath, RouteAnswer, route_answer
from kvevents.router.serve.pd_mode import PDMode
from kvevents.router.serve.pd_relay import PDRelay
from kvevents.router.serve.pd_request import PD_PATHS
from kvevents.router.serve.service import BadRequest, RouterService

__all__ = ["PDRoute", "PDRouteAnswer", "serve_pd"]

_ENCODER = msgspec.json.Encoder()


class PDRouteAnswer(msgspec.Struct, gc=False):
    """``/route``'s answer in P/D mode (see the module docstring)."""

    worker: str
    dp_rank: int
    recorded: bool
    protocol: str
    prompt_tokens: int
    uncached_tokens: int
    max_local_prefill_tokens: int
    prefill_skipped: bool
    prefill_reason: str | None
    decode: RouteAnswer
    prefill: RouteAnswer | None


class PDRoute:
    """Answers ``POST /route`` bodies in P/D mode."""

    def __init__(self, service: RouterService, pd: PDMode) -> None:
        self.service = service
        self.pd = pd

    async def answer(self, raw: bytes) -> bytes:
        service, pd = self.service, self.pd
        tokens, body = await service.tokens(raw)
        try:
            decision = decide_pd(
                service.router,
                pd.pools,
                [tokens],
                max_local_prefill_tokens=pd.max_local_prefill_tokens,
                serves_alone=pd.serves_alone,
                policy=service.policy,
                lora=body.adapter,
                cache_salt=body.cache_salt,
                model=body.model,
                extra_keys=body.extra_keys,
            )
        except ValueError as exc:  # extra keys that cannot be keyed
            if body.extra_keys is None:
                raise
            raise BadRequest(f"request body: {exc}") from None
        if body.record:
            service.router.record(decision.decode)
            if decision.prefill is not None:
                service.router.record(decision.prefill)
        top = None if body.all_scores else body.top
        return _ENCODER.encode(self.encode(decision, recorded=body.record, top=top))

    def encode(self, decision: PDDecision, *, recorded: bool, top: int | None) -> PDRouteAnswer:
        prefill = decision.prefill
        return PDRouteAnswer(
            worker=decision.decode.worker,
            dp_rank=decision.decode.dp_rank,
            recorded=recorded,
            protocol=self.pd.protocol,
            prompt_tokens=decision.prompt_tokens,
            uncached_tokens=decision.uncached_tokens,
            max_local_prefill_tokens=self.pd.max_local_prefill_tokens,
            prefill_skipped=prefill is None,
            prefill_reason=decision.prefill_reason,
            decode=route_answer(decision.decode, recorded=recorded, top=top),
            prefill=None if prefill is None else route_answer(prefill, recorded=recorded, top=top),
        )


def serve_pd(hot: HotPath, pd: PDMode) -> None:
    """Put ``hot`` in P/D mode (see the module docstring)."""
    relay = PDRelay(hot.service, pd, max_body_bytes=hot.max_body_bytes)
    hot.disaggregate(relay, frozenset(PD_PATHS), PDRoute(hot.service, pd).answer, relay.inline_path)
