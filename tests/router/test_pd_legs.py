"""The legs' bodies of disaggregated serving, per protocol: pure functions, no sockets."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvevents.router.serve.pd_exchange import Whole
from kvevents.router.serve.pd_legs import (
    MAX_ROOM,
    VLLM_PREFILL_PARAMS,
    merge_input_logprobs,
    new_rooms,
    pinned_body,
    sglang_legs,
    vllm_decode_body,
    vllm_prefill_body,
)
from kvevents.router.serve.pd_sse import merged_first_event


def _counter() -> Any:
    numbers = itertools.count(100)
    return lambda bits: next(numbers)


def test_one_prompt_one_sample_gets_one_int_room() -> None:
    """A single prompt with one sample is joined by one int room, drawn from 63 bits."""
    assert new_rooms(1, 1, batched=False, draw=_counter()) == 100
    for _ in range(50):
        room = new_rooms(1, 1, batched=False)
        assert isinstance(room, int) and 0 <= room <= MAX_ROOM


def test_a_batch_gets_one_room_per_prompt_even_of_one() -> None:
    """A prompt list gets a list of rooms, one per prompt, also for a list of one."""
    assert new_rooms(3, 1, batched=True, draw=_counter()) == [100, 101, 102]
    assert new_rooms(1, 1, batched=True, draw=_counter()) == [100]


def test_n_samples_get_one_room_per_sample() -> None:
    """With n > 1 every sample of every prompt has its own room: prompts x n of them."""
    assert new_rooms(1, 3, batched=False, draw=_counter()) == [100, 101, 102]
    rooms = new_rooms(2, 2, batched=True)
    assert isinstance(rooms, list) and len(rooms) == 4 and len(set(rooms)) == 4


def test_sglang_legs_carry_the_bootstrap_fields_and_both_ranks() -> None:
    """Both legs carry host, port and room; each its own routed_dp_rank; the decode the
    prefill's rank too; the client's rank keys are dropped and its body left unchanged."""
    body = {"prompt": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True}}
    body |= {"data_parallel_rank": 5, "routed_dp_rank": 6}
    before = json.dumps(body)
    prefill, decode = sglang_legs(
        body, host="10.0.0.5", port=8998, rooms=[7, 8], prefill_rank=1, decode_rank=3
    )
    assert json.dumps(body) == before
    for leg in (prefill, decode):
        assert (leg["bootstrap_host"], leg["bootstrap_port"]) == ("10.0.0.5", 8998)
        assert leg["bootstrap_room"] == [7, 8]
        assert "data_parallel_rank" not in leg and leg["prompt"] == [1, 2, 3]
    assert prefill["routed_dp_rank"] == 1 and "disagg_prefill_dp_rank" not in prefill
    assert prefill["stream"] is False and "stream_options" not in prefill
    assert decode["routed_dp_rank"] == 3 and decode["disagg_prefill_dp_rank"] == 1
    assert decode["stream"] is True and decode["stream_options"] == {"include_usage": True}


def test_pinned_body_names_only_the_routers_rank() -> None:
    """A decode serving alone gets routed_dp_rank and no other rank key of the client's."""
    body = {"prompt": "hi", "data_parallel_rank": 2, "disagg_prefill_dp_rank": 1}
    assert pinned_body(body, 0) == {"prompt": "hi", "routed_dp_rank": 0}


def test_vllm_prefill_leg_asks_one_token_no_stream_and_a_remote_decode() -> None:
    """vLLM's prefill leg: kv_transfer_params for a remote decode, stream off, one token
    (max_completion_tokens too when given), stream_options and min_tokens removed."""
    body = {
        "messages": [],
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 4,
        "max_tokens": 64,
        "max_completion_tokens": 64,
    }
    leg = vllm_prefill_body(body)
    assert leg["kv_transfer_params"] == dict(VLLM_PREFILL_PARAMS)
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["stream"] is False and leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert "stream_options" not in leg and "min_tokens" not in leg
    assert "max_completion_tokens" not in vllm_prefill_body({"prompt": "x"})
    assert body["max_tokens"] == 64 and body["stream"] is True


def test_vllm_decode_leg_takes_the_prefills_transfer_params_or_none() -> None:
    """The decode leg carries what the prefill answered in kv_transfer_params; without
    them (shared storage) it is the client's body as sent."""
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"}
    params |= {"remote_host": "h", "remote_port": 5, "remote_request_id": "r"}
    body = {"prompt": [1], "stream": True}
    assert vllm_decode_body(body, {"kv_transfer_params": params}) == {
        **body,
        "kv_transfer_params": params,
    }
    assert vllm_decode_body(body, {"choices": []}) == body
    assert vllm_decode_body(body, {"kv_transfer_params": None}) == body


def test_the_prefills_input_logprobs_go_in_front_of_the_decodes() -> None:
    """return_logprob: the answer's input_token_logprobs are the prefill's then the
    decode's, item by item for a batch; an answer without them is left as it is."""
    prefill = {"meta_info": {"input_token_logprobs": [[-1.0, 5, None]]}}
    decode = {"text": "a", "meta_info": {"input_token_logprobs": [[-2.0, 6, None]], "x": 1}}
    merged = merge_input_logprobs(prefill, decode)
    assert merged["meta_info"] == {
        "input_token_logprobs": [[-1.0, 5, None], [-2.0, 6, None]],
        "x": 1,
    }
    assert merge_input_logprobs([prefill, prefill], [decode, {"text": "b"}])[0] == merged
    assert merge_input_logprobs({"meta_info": {}}, decode) == decode
    assert merge_input_logprobs([prefill], [decode, decode]) == [decode, decode]


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def _collect(stream: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in stream])


def _prefilled(answer: Any) -> asyncio.Future[Whole | None]:
    done: asyncio.Future[Whole | None] = asyncio.get_running_loop().create_future()
    done.set_result(None if answer is None else Whole(200, {}, json.dumps(answer).encode()))
    return done


@pytest.mark.parametrize("split", [1, 7, 1000])
def test_a_stream_gets_the_logprobs_in_its_first_event_only(split: int) -> None:
    """However the decode's stream is cut into chunks, its first data event carries the
    prefill's input logprobs and every later byte is relayed unchanged."""
    first = {"text": "a", "meta_info": {"input_token_logprobs": [[-2.0, 6, None]]}}
    later = {"text": "ab", "meta_info": {"input_token_logprobs": []}}
    raw = b"data: %s\n\ndata: %s\n\ndata: [DONE]\n\n" % (
        json.dumps(first).encode(),
        json.dumps(later).encode(),
    )
    parts = [raw[i : i + split] for i in range(0, len(raw), split)]
    prefill = {"meta_info": {"input_token_logprobs": [[-1.0, 5, None]]}}

    async def run() -> bytes:
        return await _collect(merged_first_event(_chunks(parts), _prefilled(prefill)))

    events = asyncio.run(run()).split(b"\n\n")
    assert json.loads(events[0][6:])["meta_info"]["input_token_logprobs"] == [
        [-1.0, 5, None],
        [-2.0, 6, None],
    ]
    assert events[1:] == raw.split(b"\n\n")[1:]


def test_a_stream_without_a_prefill_answer_is_unchanged() -> None:
    """When the prefill's answer failed, the decode's stream passes byte for byte."""
    raw = b'data: {"text": "a"}\n\ndata: [DONE]\n\n'

    async def run() -> bytes:
        return await _collect(merged_first_event(_chunks([raw]), _prefilled(None)))

    assert asyncio.run(run()) == raw
