"""Disaggregated prefill/decode: the two holders of one request, and whether it needs both.

A request is served by a decode instance, which generates, and usually a prefill
instance, which computes the prompt's KV and hands it over. :func:`decide_pd` chooses:

1. the **decode** holder: the KV-aware cost (:mod:`kvevents.router.decide.scoring`)
   among the decode pool's holders: its load, and what it already caches;
2. whether the prefill hop is needed: the prompt's tokens the decode holder does not
   hold (confirmed blocks, any tier, that an engine reuses: a partial last block is never
   cached, a block-aligned prompt's last is computed again) are its ``uncached_tokens``;
   at most ``max_local_prefill_tokens`` of them (0: never) and the decode instance
   prefills them itself, alone. It does too when ``decode_alone`` says it computes the
   whole prompt whatever it holds or is handed (vLLM, for a request that asks for its
   prompt's logprobs): a prefill leg would compute the prompt twice. Either only when
   its engine can serve a request alone (``serves_alone``: an SGLang decode server
   cannot);
3. otherwise the **prefill** holder: the same cost among the prefill pool's holders,
   predictions included, so the siblings of a burst land on the rank their first
   request was just sent to. Its reason, for the metrics: ``prediction`` when
   predictions changed the choice, ``cache`` when the holder has part of the prompt
   cached, else ``load``.

Recent work (the cost's balance term) decays once per request, as in one-pool mode:
the decode choice advances the decay, the prefill choice does not
(:attr:`RouteDecision.decays <kvevents.router.decide.router.RouteDecision.decays>`).
Both legs advancing it would halve every holder's recent work twice as often, and so
weaken the balance of both pools.

One :class:`~kvevents.router.decide.router.Router` serves both pools, each choice
restricted to a pool's holders (:class:`PDPools`), rather than one Router per pool:
one subscriber, one index and one load board already follow every engine, so a request
is keyed and matched once (:meth:`Router.key_request`) and both choices read that one
lookup (:meth:`Router.route_keyed`); tickets, predictions and peers' load notes work
unchanged per holder. Routers per pool would split the subscriber's items by worker
and key every request twice. Nothing here runs on the one-pool path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, get_args

import msgspec

from kvevents.errors import RouterNotReadyError
from kvevents.router.decide.router import KeyedRequest, Policy, RouteDecision, Router
from kvevents.types import Holder

__all__ = [
    "DEFAULT_MAX_LOCAL_PREFILL_TOKENS",
    "POOLS",
    "PDDecision",
    "PDPools",
    "Pool",
    "PrefillReason",
    "decide_pd",
]

Pool = Literal["prefill", "decode"]
POOLS: tuple[Pool, ...] = get_args(Pool)
PrefillReason = Literal["cache", "prediction", "load"]
"""Why the prefill holder was chosen (see the module docstring)."""

DEFAULT_MAX_LOCAL_PREFILL_TOKENS = 256
"""Uncached prompt tokens a decode instance prefills itself rather than take a hand-off."""


class PDPools:
    """Which engine (worker name) is in which pool; each engine in one pool only.

    :meth:`split` divides a candidate list by pool; the split of the last few candidate
    lists is kept by identity (the Router hands out the same list until its holders or
    the models change), so a request costs no pass over the holders.
    """

    def __init__(self, prefill: Iterable[str], decode: Iterable[str]) -> None:
        self.prefill = frozenset(prefill)
        self.decode = frozenset(decode)
        both = self.prefill & self.decode
        if both:
            raise ValueError(
                f"engine {sorted(both)[0]} is given as --prefill and as --decode: an engine "
                "runs in one disaggregation mode; give it once"
            )
        if not self.prefill or not self.decode:
            raise ValueError(
                "disaggregated serving needs at least one prefill and one decode engine"
            )
        self._splits: dict[int, tuple[list[Holder], list[Holder], list[Holder]]] = {}

    def pool_of(self, worker: str) -> Pool | None:
        if worker in self.prefill:
            return "prefill"
        if worker in self.decode:
            return "decode"
        return None

    def split(self, holders: list[Holder]) -> tuple[list[Holder], list[Holder]]:
        """``holders``' prefill and decode holders, in their order (others are left out)."""
        kept = self._splits.get(id(holders))
        if kept is not None and kept[0] is holders:
            return kept[1], kept[2]
        prefill = [h for h in holders if h.worker in self.prefill]
        decode = [h for h in holders if h.worker in self.decode]
        if len(self._splits) >= 16:  # candidate lists per model, and a new one per change
            self._splits.clear()
        self._splits[id(holders)] = (holders, prefill, decode)
        return prefill, decode


# gc=False: one per request and free of reference cycles
class PDDecision(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Where one request goes in disaggregated serving (see the module docstring)."""

    decode: RouteDecision
    prefill: RouteDecision | None
    """None when the decode instance serves the request alone."""
    prompt_tokens: int
    uncached_tokens: int
    """Prompt tokens the decode holder does not hold (confirmed blocks); all of them when
    it serves alone computing the whole prompt (``decode_alone``)."""
    prefill_reason: PrefillReason | None = None

    @property
    def skipped(self) -> bool:
        """True when the prefill hop is skipped: the decode instance prefills alone."""
        return self.prefill is None


def decide_pd(
    router: Router,
    pools: PDPools,
    prompts: Sequence[Sequence[int]],
    *,
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    decode_alone: bool = False,
    serves_alone: Callable[[str], bool] | None = None,
    policy: Policy = "kv-aware",
    lora: str | int | None = None,
    cache_salt: str | None = None,
    model: str | None = None,
    extra_keys: Sequence[Any] | None = None,
) -> PDDecision:
    """Choose the decode holder and, unless it can prefill alone (or must:
    ``decode_alone``), the prefill holder. ``serves_alone(worker)``: whether that decode
    engine can be sent a request alone at all (None: every one can).

    Changes nothing (``Router.begin`` each leg's decision). RouterNotReadyError when a
    pool that is needed has no available holder; UnknownModelError as ``Router.route``.
    """
    request = router.key_request(
        prompts, lora=lora, cache_salt=cache_salt, model=model, extra_keys=extra_keys
    )
    prefill_pool, decode_pool = pools.split(request.holders)
    decode = _route(router, request, decode_pool, policy, "decode", model)
    prompt_tokens = sum(map(len, prompts))
    uncached = max(0, prompt_tokens - decode.matched_tokens)
    if serves_alone is None or serves_alone(decode.holder.worker):
        if decode_alone:  # it computes every prompt token, whatever it holds
            uncached = prompt_tokens
        if decode_alone or (max_local_prefill_tokens > 0 and uncached <= max_local_prefill_tokens):
            return PDDecision(
                decode=decode, prefill=None, prompt_tokens=prompt_tokens, uncached_tokens=uncached
            )
    prefill = _route(router, request, prefill_pool, policy, "prefill", model)
    reason: PrefillReason
    if prefill.by_prediction:
        reason = "prediction"
    elif prefill.chosen.matched.blocks > 0:
        reason = "cache"
    else:
        reason = "load"
    return PDDecision(
        decode=decode,
        prefill=prefill,
        prompt_tokens=prompt_tokens,
        uncached_tokens=uncached,
        prefill_reason=reason,
    )


def _route(
    router: Router,
    request: KeyedRequest,
    holders: list[Holder],
    policy: Policy,
    pool: Pool,
    model: str | None,
) -> RouteDecision:
    try:
        return router.route_keyed(
            request, holders, policy=policy, rotation=pool, decays=pool == "decode"
        )
    except RouterNotReadyError:
        serving = "" if model is None else f" serving model {model!r}"
        raise RouterNotReadyError(
            f"no {pool} engine rank{serving} is available: the {pool} engines are down or "
            "still being discovered; see /workers"
        ) from None
