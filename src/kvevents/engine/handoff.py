"""What a request's disaggregation fields ask, and whether a transfer matches it: no I/O.

Two protocols, told apart by their fields (both in one request is a 400):

* **SGLang**: ``bootstrap_room`` (present and not null: the request is one leg of a
  P/D pair), ``bootstrap_host`` and ``bootstrap_port`` (the prefill's bootstrap server;
  a decode needs them), ``disagg_prefill_dp_rank`` (the prefill's rank).
* **vLLM**: ``kv_transfer_params`` with ``do_remote_decode: true`` (this is the prefill
  leg) or ``do_remote_prefill: true`` (the decode leg, which names ``remote_host``,
  ``remote_port`` and ``remote_request_id``). Neither flag true: no hand-off.

Rooms follow SGLang's expansion of a request into items: ``B`` prompts with ``n``
samples are ``B * n`` items, item ``j`` being prompt ``j % B`` (SGLang repeats the batch
``n`` times). An int room gives item ``j`` the room ``room + j``, as SGLang does; a list
must hold one room per item. So each prompt has ``n`` rooms. The simulated engine
generates one sample per prompt (it has no parallel sampling), so a prefill registers a
prompt under each of its rooms and a decode takes every one of them (none is left to
expire) and decodes the prompt once. ``bootstrap_host``/``bootstrap_port`` may be
per-item lists too, but must name one server: one request has one prefill engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvevents.engine.transfer_registry import DisaggregationError, Transfer, TransferKey, describe

__all__ = ["SGLangHandoff", "VLLMHandoff", "decode_keys", "parse_handoff", "received_blocks"]

_ROOM_MAX = 2**64 - 1


@dataclass(frozen=True)
class SGLangHandoff:
    """SGLang's fields: ``rooms[i]`` are prompt i's rooms (``n`` of them)."""

    rooms: list[list[int]]
    host: str | None = None
    port: int | None = None
    prefill_dp_rank: int | None = None


@dataclass(frozen=True)
class VLLMHandoff:
    """vLLM's ``kv_transfer_params``: a prefill leg (``prefill``) or a decode leg."""

    prefill: bool
    host: str | None = None
    port: int | None = None
    request_id: str | None = None
    engine_id: str | None = None
    block_ids: list[int] | None = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one(fields: Mapping[str, Any], name: str, kind: type, items: int) -> Any:
    """A scalar field, or a per-item list of equal values; None when absent."""
    value: Any = fields.get(name)
    if isinstance(value, list) and value:
        if len(value) != items or any(v != value[0] for v in value):
            raise DisaggregationError(
                f"{name}={value!r}: a list must give one equal value per item ({items}): "
                "one request has one prefill engine"
            )
        value = value[0]
    if value is None:
        return None
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok or (kind is int and not 1 <= value <= 65535) or (kind is str and not value):
        what = "a port in 1..65535" if kind is int else "a non-empty host name"
        raise DisaggregationError(f"{name}={value!r} must be {what}")
    return value


def _rooms(value: Any, prompts: int, n: int) -> list[list[int]]:
    items = prompts * n
    if _is_int(value):
        values = [value + j for j in range(items)]
    elif isinstance(value, list):
        values = value
        if len(values) != items:
            raise DisaggregationError(
                f"bootstrap_room has {len(values)} rooms for {prompts} prompt(s) x n={n}: "
                f"give one room per item ({items}), or one int (item j gets room + j)"
            )
    else:
        raise DisaggregationError(
            f"bootstrap_room={value!r} must be an int or a list of ints (one per item)"
        )
    for room in values:
        if not _is_int(room) or not 0 <= room <= _ROOM_MAX:
            raise DisaggregationError(f"bootstrap_room {room!r} must be an int in 0..2**64-1")
    if len(set(values)) != len(values):
        raise DisaggregationError(f"bootstrap_room {values!r} repeats a room: one per item")
    return [values[p::prompts] for p in range(prompts)]


def _sglang(fields: Mapping[str, Any], prompts: int, n: Any) -> SGLangHandoff:
    if not _is_int(n) or not 1 <= n <= 1 << 16:
        raise DisaggregationError(f"n={n!r} must be an int in 1..65536")
    rank = fields.get("disagg_prefill_dp_rank")
    if rank is not None and (not _is_int(rank) or rank < 0):
        raise DisaggregationError(f"disagg_prefill_dp_rank={rank!r} must be an int >= 0")
    items = prompts * n
    return SGLangHandoff(
        rooms=_rooms(fields["bootstrap_room"], prompts, n),
        host=_one(fields, "bootstrap_host", str, items),
        port=_one(fields, "bootstrap_port", int, items),
        prefill_dp_rank=rank,
    )


def _vllm(params: Any) -> VLLMHandoff | None:
    if not isinstance(params, dict):
        raise DisaggregationError(f"kv_transfer_params must be a JSON object, not {params!r}")
    flags = {}
    for name in ("do_remote_decode", "do_remote_prefill"):
        flag = params.get(name)
        if flag is not None and not isinstance(flag, bool):
            raise DisaggregationError(f"kv_transfer_params.{name}={flag!r} must be true or false")
        flags[name] = flag is True
    if flags["do_remote_decode"] and flags["do_remote_prefill"]:
        raise DisaggregationError(
            "kv_transfer_params asks for both do_remote_decode (a prefill leg) and "
            "do_remote_prefill (a decode leg): give one"
        )
    if not any(flags.values()):
        return None
    if flags["do_remote_decode"]:
        return VLLMHandoff(prefill=True)
    got = {}
    for name, kind in (
        ("remote_host", str),
        ("remote_port", int),
        ("remote_request_id", str),
        ("remote_engine_id", str),
    ):
        value = params.get(name)
        required = name != "remote_engine_id"
        if value is None and required:
            raise DisaggregationError(
                f"kv_transfer_params.{name} is missing: a decode leg (do_remote_prefill) "
                "needs the prefill's remote_host, remote_port and remote_request_id"
            )
        if value is not None:
            ok = (_is_int(value) and 1 <= value <= 65535) if kind is int else isinstance(value, str)
            if not ok or value == "":
                raise DisaggregationError(
                    f"kv_transfer_params.{name}={value!r} must be "
                    + ("a port in 1..65535" if kind is int else "a non-empty string")
                )
        got[name] = value
    block_ids = params.get("remote_block_ids")
    if block_ids is not None and (
        not isinstance(block_ids, list) or not all(_is_int(b) for b in block_ids)
    ):
        raise DisaggregationError("kv_transfer_params.remote_block_ids must be a list of ints")
    return VLLMHandoff(
        prefill=False,
        host=got["remote_host"],
        port=got["remote_port"],
        request_id=got["remote_request_id"],
        engine_id=got["remote_engine_id"],
        block_ids=block_ids,
    )


def parse_handoff(
    fields: Mapping[str, Any], prompts: int, n: Any = 1
) -> SGLangHandoff | VLLMHandoff | None:
    """The hand-off ``fields`` (a request body) ask for ``prompts`` prompts of ``n``
    samples each (the body's ``n``, checked only for SGLang's rooms), or None (serve
    locally); raises :class:`DisaggregationError` (400)."""
    sglang = fields.get("bootstrap_room") is not None
    vllm = fields.get("kv_transfer_params") is not None
    if sglang and vllm:
        raise DisaggregationError(
            "the request has both bootstrap_room (SGLang's hand-off) and kv_transfer_params "
            "(vLLM's): give one"
        )
    if sglang:
        return _sglang(fields, prompts, n)
    if vllm:
        return _vllm(fields["kv_transfer_params"])
    return None


def decode_keys(handoff: SGLangHandoff | VLLMHandoff) -> list[TransferKey]:
    """Every key a decode leg takes: each prompt's rooms in order, or the request id."""
    if isinstance(handoff, SGLangHandoff):
        return [room for rooms in handoff.rooms for room in rooms]
    assert handoff.request_id is not None
    return [handoff.request_id]


def received_blocks(
    handoff: SGLangHandoff | VLLMHandoff,
    prompts: list[list[int]],
    transfers: Mapping[TransferKey, Transfer],
    page_size: int,
) -> list[int]:
    """Each prompt's blocks as the prefill sent them, once every transfer taken for
    ``handoff`` is checked against the request (400 on the first disagreement)."""
    received = []
    for index, prompt in enumerate(prompts):
        if isinstance(handoff, SGLangHandoff):
            keys: list[TransferKey] = [*handoff.rooms[index]]
            at = 0
        else:
            keys, at = decode_keys(handoff), index
        for key in keys:
            _check(handoff, key, transfers[key], len(prompts), page_size)
            sent = transfers[key].prompts[at]
            if sent.token_ids != prompt:
                raise DisaggregationError(
                    f"{describe(key)} was prefilled for another prompt ({len(sent.token_ids)} "
                    f"tokens) than this request's prompt {index} ({len(prompt)} tokens): "
                    "both legs must carry the same prompt"
                )
        received.append(transfers[keys[0]].prompts[at].block_count)
    return received


def _check(
    handoff: SGLangHandoff | VLLMHandoff,
    key: TransferKey,
    got: Transfer,
    prompts: int,
    page_size: int,
) -> None:
    where = f"{describe(key)} (prefill engine {got.engine_id})"
    if got.page_size != page_size:
        raise DisaggregationError(
            f"{where} has {got.page_size}-token blocks and this decode {page_size}: "
            "give both engines the same --page-size"
        )
    expected = 1 if isinstance(handoff, SGLangHandoff) else prompts
    if len(got.prompts) != expected:
        raise DisaggregationError(
            f"{where} holds {len(got.prompts)} prompt(s), this request has {expected}"
        )
    if isinstance(handoff, SGLangHandoff):
        if handoff.prefill_dp_rank is not None and handoff.prefill_dp_rank != got.dp_rank:
            raise DisaggregationError(
                f"disagg_prefill_dp_rank={handoff.prefill_dp_rank}, but {where} was "
                f"prefilled on dp_rank {got.dp_rank}: name the rank the prefill leg ran on"
            )
        return
    if handoff.engine_id is not None and handoff.engine_id != got.engine_id:
        raise DisaggregationError(
            f"kv_transfer_params.remote_engine_id={handoff.engine_id!r}, but the bootstrap "
            f"server answered for engine {got.engine_id!r}"
        )
    blocks = sum(p.block_count for p in got.prompts)
    if handoff.block_ids is not None and len(handoff.block_ids) != blocks:
        raise DisaggregationError(
            f"kv_transfer_params.remote_block_ids names {len(handoff.block_ids)} blocks, "
            f"but {where} holds {blocks}"
        )
