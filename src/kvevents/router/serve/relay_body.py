"""The client's body as the OpenAI relay reads and changes it: a JSON object, the prompts
of a completions request, and the rank an SGLang or kvevents engine is pinned to.

Every refusal is an :class:`~kvevents.router.serve.relay_answer.OpenAIError` 400 naming
the field. Token ids are checked by their conversion to ``array("I")``, one C-level pass,
not a Python loop per token.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any

import msgspec

from kvevents.router.serve.bodies import pinned_bytes
from kvevents.router.serve.relay_answer import OpenAIError

__all__ = ["prompts_of"]


_MAX_TOKEN_ID = 2**32 - 1
_ENCODER = msgspec.json.Encoder()


def _one_prompt(prompt: Any, where: str) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int}:
        # one C-level pass over the kinds, not a Python loop per token
        try:
            array("I", prompt)
        except OverflowError:
            raise OpenAIError(400, f"{where} token ids must be in 0..{_MAX_TOKEN_ID}") from None
        return prompt
    raise OpenAIError(
        400, f"{where} must be a string, a non-empty list of token ids, or a list of them"
    )


def prompts_of(body: Mapping[str, Any]) -> list[str | list[int]]:
    """The prompts of a completions body: one, or every prompt of a batch (OpenAIError 400 else)."""
    if "prompt" not in body:
        raise OpenAIError(400, "the body has no 'prompt' (text or a list of token ids)")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, "prompt")]


def _with_rank(raw: bytes, body: dict[str, Any] | None, rank: int, names_rank: bool) -> bytes:
    """The body for an SGLang or kvevents engine: ``routed_dp_rank: rank`` set, a client's
    ``data_parallel_rank`` removed. When the body names neither (``names_rank``, read by
    the decoder, which resolves escaped keys), the key is appended to its bytes
    (:func:`~kvevents.router.serve.bodies.pinned_bytes`); else the decoded body
    (``body``, or ``raw`` decoded now when None) is changed and encoded again (2,048 token
    ids: tens of µs). ``raw`` is a non-empty JSON object."""
    if not names_rank and body != {}:
        return pinned_bytes(raw, rank)
    if body is None:
        body = _json_object(raw, "completions")
    body.pop("data_parallel_rank", None)
    body["routed_dp_rank"] = rank
    return _ENCODER.encode(body)


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise OpenAIError(400, "the body is nested too deeply: flatten it") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the body must be a JSON object (an OpenAI {what} request)")
    return body
