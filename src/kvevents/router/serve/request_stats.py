"""Counters of the requests a router forwarded: where, why, how much was cached.

Recorded by the HTTP service for every forwarded request (``/generate`` and
``/v1/completions``), read by :class:`~kvevents.router.serve.metrics.RouterCollector` at
scrape time:

* ``requests_total{endpoint,worker,dp_rank,policy,status}``: forwarded requests by
  the engine's HTTP status ("502" when the engine could not be reached);
* ``matched_tokens{endpoint}``: a histogram of the tokens the chosen holder had cached
  (the router's prediction), with ``prompt_tokens_total{endpoint}`` beside it, so
  ``matched / prompt`` is the predicted hit rate;
* ``engine_cached_tokens_total{worker,dp_rank}`` and ``engine_prompt_tokens_total``:
  what the engines themselves reported (``usage.prompt_tokens_details.cached_tokens``
  in OpenAI answers, ``cached_tokens`` in ``/generate`` answers), the measured hit rate.

O(1) per request; memory O(label combinations).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Mapping
from typing import Any

import msgspec

from kvevents.router.decide.router import RouteDecision
from kvevents.types import Holder

__all__ = ["MATCHED_TOKEN_BUCKETS", "RequestStats", "engine_usage", "engine_usage_of_json"]

MATCHED_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
"""Upper bounds (tokens) of the matched-tokens histogram; +Inf is implied."""


class RequestStats:
    """See the module docstring. Single-threaded (the service's event loop)."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, int, str, str]] = Counter()
        self.matched_buckets: dict[str, list[int]] = {}
        self.matched_sum: Counter[str] = Counter()
        self.prompt_tokens: Counter[str] = Counter()
        self.engine_cached: Counter[Holder] = Counter()
        self.engine_prompt: Counter[Holder] = Counter()

    def record(
        self, endpoint: str, decision: RouteDecision, prompt_tokens: int, status: int | str
    ) -> None:
        """One forwarded request and the status the engine answered."""
        self.requests[
            (endpoint, decision.worker, decision.dp_rank, decision.policy, str(status))
        ] += 1
        matched = decision.matched_tokens
        buckets = self.matched_buckets.get(endpoint)
        if buckets is None:  # not setdefault: that makes the list on every call
            buckets = self.matched_buckets[endpoint] = [0] * (len(MATCHED_TOKEN_BUCKETS) + 1)
        buckets[bisect.bisect_left(MATCHED_TOKEN_BUCKETS, matched)] += 1
        self.matched_sum[endpoint] += matched
        self.prompt_tokens[endpoint] += prompt_tokens

    def record_usage(self, holder: Holder, usage: tuple[int, int] | None) -> None:
        """The engine's own (prompt_tokens, cached_tokens) for a request, when it said."""
        if usage is None:
            return
        prompt, cached = usage
        self.engine_prompt[holder] += prompt
        self.engine_cached[holder] += cached


def engine_usage(answer: Any) -> tuple[int, int] | None:
    """``(prompt_tokens, cached_tokens)`` from an engine's JSON answer, if it reports them.

    OpenAI shape: ``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens``
    (vLLM with ``--enable-prompt-tokens-details``, our simulated engine). ``/generate``
    shape: top-level ``prompt_tokens`` and ``cached_tokens`` (SGLang's ``meta_info`` too).
    """
    if not isinstance(answer, Mapping):
        return None
    usage = answer.get("usage")
    if isinstance(usage, Mapping):
        details = usage.get("prompt_tokens_details")
        prompt = usage.get("prompt_tokens")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    else:
        meta = answer.get("meta_info")
        source = meta if isinstance(meta, Mapping) else answer
        prompt = source.get("prompt_tokens")
        cached = source.get("cached_tokens")
    if isinstance(prompt, int) and isinstance(cached, int):
        return prompt, cached
    return None


class _UsageMembers(msgspec.Struct):
    """The members of an engine's JSON answer :func:`engine_usage` reads (a missing one
    reads as None, as it does there); the others, the generated text and its logprobs,
    are skipped unread."""

    usage: Any = None
    meta_info: Any = None
    prompt_tokens: Any = None
    cached_tokens: Any = None


_USAGE_DECODER = msgspec.json.Decoder(_UsageMembers)


def engine_usage_of_json(payload: bytes) -> tuple[int, int] | None:
    """:func:`engine_usage` of an answer's JSON text, decoding only the members it reads
    (None when the text is not a JSON object)."""
    try:
        m = _USAGE_DECODER.decode(payload)
    except msgspec.DecodeError:  # also a JSON value that is not an object
        return None
    usage = m.usage
    if type(usage) is dict:  # the OpenAI shape, read without the ABC checks of Mapping
        details = usage.get("prompt_tokens_details")
        prompt = usage.get("prompt_tokens")
        cached = details.get("cached_tokens") if type(details) is dict else None
        # as engine_usage() reads it: a JSON object decodes to a dict, never another Mapping
        return (prompt, cached) if isinstance(prompt, int) and isinstance(cached, int) else None
    return engine_usage(
        {
            "usage": m.usage,
            "meta_info": m.meta_info,
            "prompt_tokens": m.prompt_tokens,
            "cached_tokens": m.cached_tokens,
        }
    )
