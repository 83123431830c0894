"""What the P/D relay tells the client of a decision, and its errors in the route's shape.

:data:`PD_PATHS` are the relay's paths. :func:`pd_headers` and :func:`routed_info` say
where a request went (response headers; a ``/generate`` answer's ``router`` member,
:func:`generate_answer`), :func:`error_answer` words an error in the route's shape:
OpenAI's ``{"error": {...}}`` on ``/v1/*``, ``{"error": message}`` on ``/generate`` (the
one-pool router's shape there). What the relay reads of a request is
:mod:`kvevents.router.serve.pd_read`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from kvevents.router.decide.pd import PDDecision
from kvevents.router.decide.router import RouteDecision
from kvevents.router.serve.pd_exchange import Whole
from kvevents.router.serve.pd_legs import merge_input_logprobs
from kvevents.router.serve.relay_answer import Answer, OpenAIError
from kvevents.router.serve.relay_headers import _quoted_worker, decision_headers

__all__ = [
    "PD_PATHS",
    "Endpoint",
    "error_answer",
    "error_kind",
    "generate_answer",
    "pd_headers",
    "routed_info",
]

Endpoint = Literal["completions", "chat", "generate"]
PD_PATHS: Mapping[str, Endpoint] = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/generate": "generate",
}
"""The paths the P/D relay answers (``POST``), each with its endpoint's name."""

_ENCODER = msgspec.json.Encoder()
_JSON = (b"content-type", b"application/json")


def pd_headers(decision: PDDecision) -> list[tuple[bytes, bytes]]:
    """The decision's response headers: the decode holder's, then the prefill's."""
    shown = decision_headers(decision.decode, decision.prompt_tokens)
    prefill = decision.prefill
    shown.append((b"x-kvevents-uncached-tokens", b"%d" % decision.uncached_tokens))
    if prefill is None:
        shown.append((b"x-kvevents-prefill", b"skipped"))
        return shown
    reason = (decision.prefill_reason or "load").encode("latin-1")
    shown.append((b"x-kvevents-prefill", reason))
    shown.append((b"x-kvevents-prefill-worker", _quoted_worker(prefill.worker)))
    shown.append((b"x-kvevents-prefill-dp-rank", b"%d" % prefill.dp_rank))
    return shown


async def generate_answer(
    payload: bytes, decision: PDDecision, prefilled: asyncio.Future[Whole | None] | None
) -> bytes:
    """A decode's ``/generate`` answer (``payload``) for the client: the prefill's input
    logprobs merged in when ``prefilled`` (its answer, to come) is given, and a JSON
    object told where it went (``router``, :func:`routed_info`)."""
    try:
        answer = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return payload
    if prefilled is not None:
        prefill = await prefilled
        if prefill is not None:
            with contextlib.suppress(msgspec.DecodeError):  # then without them
                answer = merge_input_logprobs(msgspec.json.decode(prefill.body), answer)
    if isinstance(answer, dict):
        answer["router"] = routed_info(decision)
    return _ENCODER.encode(answer)


def routed_info(decision: PDDecision) -> dict[str, Any]:
    """Where a ``/generate`` answer went and why: its ``router`` member."""

    def holder(d: RouteDecision) -> dict[str, Any]:
        chosen = d.chosen
        return {
            "worker": d.worker,
            "dp_rank": d.dp_rank,
            "cost": chosen.cost,
            "cached_blocks": chosen.cached_blocks,
            "prefill_blocks": chosen.prefill_blocks,
            "pending_blocks": chosen.pending_blocks,
        }

    prefill = decision.prefill
    return {
        "decode": holder(decision.decode),
        "prefill": None if prefill is None else holder(prefill),
        "prefill_skipped": prefill is None,
        "prefill_reason": decision.prefill_reason,
        "uncached_tokens": decision.uncached_tokens,
    }


def error_answer(
    endpoint: Endpoint,
    status: int,
    message: str,
    kind: str,
    param: str | None,
    shown: list[tuple[bytes, bytes]] | None = None,
) -> Answer:
    """The client's error in the route's shape (see the module docstring)."""
    if endpoint != "generate":
        return Answer.error(OpenAIError(status, message, kind, param), shown or ())
    return Answer(status, [_JSON, *(shown or ())], _ENCODER.encode({"error": message}))


def error_kind(status: int) -> str:
    """OpenAI's error ``type`` for a status the P/D relay answers."""
    return {502: "bad_gateway", 504: "timeout"}.get(status, "invalid_request_error")
