"""The bodies of disaggregated serving's two legs, per hand-off protocol: pure functions.

**SGLang** (``sglang``; also the simulated engine's default): both legs at once, each the
client's body plus ``bootstrap_host`` (the prefill's host), ``bootstrap_port`` (its
bootstrap server) and ``bootstrap_room``, a random int in ``[0, 2**63 - 1]``, new per
request, which joins the two halves. Rooms (:func:`new_rooms`): one int for one prompt
and one sample; otherwise a list, one room per sample, in the order an engine expands
a batch with ``n`` samples (every prompt once, then every prompt again per further
sample: room ``i`` is prompt ``i % prompts``). Host and port stay single values (an
engine applies them to every item). Ranks: ``routed_dp_rank`` on each leg and
``disagg_prefill_dp_rank`` (the prefill's rank) on the decode leg; a client's
``data_parallel_rank`` is dropped. The prefill leg asks for no stream: its answer is
read whole and dropped, except its ``input_token_logprobs``, which
:func:`merge_input_logprobs` puts in front of the decode's (``return_logprob``).

**vLLM** (``vllm``): prefill first, with ``kv_transfer_params`` asking for a remote
decode (:data:`VLLM_PREFILL_PARAMS`), ``stream: false``, ``max_tokens: 1`` (and
``max_completion_tokens: 1`` when given), without ``stream_options`` or ``min_tokens``;
then the decode leg, the client's body with the ``kv_transfer_params`` the prefill
answered (:func:`vllm_decode_body`), or unchanged when it answered none (a connector
that shares storage). Ranks: the ``X-data-parallel-rank`` header on each leg.

Bodies are dicts decoded from the client's JSON; each function returns new ones and
changes none it is given.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

__all__ = [
    "MAX_ROOM",
    "PROTOCOLS",
    "VLLM_PREFILL_PARAMS",
    "PDProtocol",
    "merge_input_logprobs",
    "new_rooms",
    "pinned_body",
    "sglang_legs",
    "vllm_decode_body",
    "vllm_prefill_body",
]

PDProtocol = Literal["sglang", "vllm"]
PROTOCOLS: tuple[PDProtocol, ...] = get_args(PDProtocol)

MAX_ROOM = 2**63 - 1
"""The largest ``bootstrap_room``: rooms are non-negative signed 64-bit ints."""

VLLM_PREFILL_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""The ``kv_transfer_params`` of vLLM's prefill leg: compute the prompt, keep its KV for a
remote decode, and say in the answer where to fetch it."""

_RANK_KEYS = ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank")


def new_rooms(
    prompts: int, samples: int, *, batched: bool, draw: Callable[[int], int] = random.getrandbits
) -> int | list[int]:
    """Fresh ``bootstrap_room`` values for a request of ``prompts`` prompts (``batched``:
    given as a list, even of one) and ``samples`` samples each (``n``): one int, or a
    list of one room per sample (see the module docstring). ``draw(63)`` gives a room."""
    if not batched and samples == 1:
        return draw(63)
    return [draw(63) for _ in range(prompts * samples)]


def pinned_body(body: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """``body`` for one SGLang-style engine alone: ``routed_dp_rank`` set, any other rank
    key of the client's dropped (the decode instance serving without a prefill)."""
    out = {k: v for k, v in body.items() if k not in _RANK_KEYS}
    out["routed_dp_rank"] = rank
    return out


def sglang_legs(
    body: Mapping[str, Any],
    *,
    host: str,
    port: int,
    rooms: int | list[int],
    prefill_rank: int,
    decode_rank: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefill leg's body and the decode leg's, joined by ``rooms`` at ``host:port``."""
    shared = {k: v for k, v in body.items() if k not in _RANK_KEYS}
    shared["bootstrap_host"] = host
    shared["bootstrap_port"] = port
    shared["bootstrap_room"] = rooms
    prefill = dict(shared)
    prefill["routed_dp_rank"] = prefill_rank
    prefill["stream"] = False
    prefill.pop("stream_options", None)
    decode = shared
    decode["routed_dp_rank"] = decode_rank
    decode["disagg_prefill_dp_rank"] = prefill_rank
    return prefill, decode


def vllm_prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's prefill leg: the client's body, one token, no stream, a remote decode asked."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out["kv_transfer_params"] = dict(VLLM_PREFILL_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def vllm_decode_body(body: Mapping[str, Any], prefill_answer: Any) -> dict[str, Any]:
    """vLLM's decode leg: the client's body with the prefill answer's ``kv_transfer_params``
    (unchanged when the answer carries none: nothing to fetch, the KV is shared)."""
    out = dict(body)
    params = prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
    if params is not None:
        out["kv_transfer_params"] = params
    return out


def merge_input_logprobs(prefill_answer: Any, decode_answer: Any) -> Any:
    """``decode_answer`` (a ``/generate`` answer, or a list of them for a batch) with the
    prefill's ``meta_info.input_token_logprobs`` put in front of its own, item by item;
    unchanged where either side has none."""
    if isinstance(decode_answer, list):
        if not isinstance(prefill_answer, list) or len(prefill_answer) != len(decode_answer):
            return decode_answer
        return [
            merge_input_logprobs(p, d) for p, d in zip(prefill_answer, decode_answer, strict=True)
        ]
    if not (isinstance(prefill_answer, dict) and isinstance(decode_answer, dict)):
        return decode_answer
    before = _input_logprobs(prefill_answer)
    meta = decode_answer.get("meta_info")
    if before is None or not isinstance(meta, dict):
        return decode_answer
    after = meta.get("input_token_logprobs")
    merged = before + (after if isinstance(after, list) else [])
    return {**decode_answer, "meta_info": {**meta, "input_token_logprobs": merged}}


def _input_logprobs(answer: dict[str, Any]) -> list[Any] | None:
    meta = answer.get("meta_info")
    found = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    return found if isinstance(found, list) else None
