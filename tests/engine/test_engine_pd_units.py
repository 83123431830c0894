"""The pieces of disaggregated serving without processes: the transfer registry's states and
timeouts, the parsing of a request's P/D fields, and a decode's received blocks in the scheduler."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator

import pytest

from kvevents import BlockStored
from kvevents.engine.cache import PrefixCache
from kvevents.engine.handoff import (
    SGLangHandoff,
    VLLMHandoff,
    parse_handoff,
    received_blocks,
)
from kvevents.engine.scheduler import Scheduler
from kvevents.engine.transfer_registry import (
    DisaggregationError,
    PromptKV,
    Transfer,
    TransferRegistry,
)
from kvevents.wire.events import KVEventBatch

T = Transfer(engine_id="e", dp_rank=1, page_size=4, prompts=[PromptKV([1, 2, 3, 4, 5], 1)])


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 20))


@contextlib.contextmanager
def raises(status: int, *words: str) -> Iterator[None]:
    """The block must raise a DisaggregationError with ``status`` whose text has ``words``."""
    with pytest.raises(DisaggregationError) as info:
        yield
    assert info.value.status == status, (info.value.status, str(info.value))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# --- the registry ----------------------------------------------------------------------


def test_a_decode_that_comes_first_gets_the_transfer_once_its_prefill_completes() -> None:
    """take() waits for a key no prefill has reserved yet and returns the transfer once it is complete."""

    async def test() -> None:
        registry = TransferRegistry(timeout=5)
        waiting = asyncio.ensure_future(registry.take(42, wait=5))
        await asyncio.sleep(0.01)
        registry.reserve(42)
        await asyncio.sleep(0.01)
        assert not waiting.done()
        registry.complete(42, T)
        assert await waiting == T
        registry.close()

    run(test)


def test_a_key_is_registered_once_and_taken_once() -> None:
    """A second reserve of a known key and a second take are both 409 errors naming the key."""

    async def test() -> None:
        registry = TransferRegistry(timeout=5)
        registry.reserve(7)
        with raises(409, "room 7", "already registered"):
            registry.reserve(7)
        registry.complete(7, T)
        assert await registry.take(7, wait=0) == T
        with raises(409, "room 7", "already taken"):
            await registry.take(7, wait=1)
        with raises(409, "room 7"):
            registry.reserve(7)
        registry.close()

    run(test)


def test_a_key_that_never_comes_ends_in_404_after_the_wait_and_leaves_nothing() -> None:
    """take() of a key nobody registers raises 404 naming the key and the wait, and forgets the key."""

    async def test() -> None:
        registry = TransferRegistry(timeout=5)
        with raises(404, "request id 'abc'", "no prefill registered it", "0.05 s"):
            await registry.take("abc", wait=0.05)
        assert len(registry) == 0

    run(test)


def test_a_failed_prefill_tells_its_waiting_decode_at_once() -> None:
    """A decode waiting on a key whose prefill fails gets a 502 carrying the prefill's error."""

    async def test() -> None:
        registry = TransferRegistry(timeout=5)
        registry.reserve(3)
        waiting = asyncio.ensure_future(registry.take(3, wait=5))
        await asyncio.sleep(0.01)
        registry.fail(3, "dp_rank 1 is dead")
        with raises(502, "room 3", "dp_rank 1 is dead"):
            await waiting
        registry.close()

    run(test)


def test_an_unfetched_registration_expires_then_is_dropped() -> None:
    """A completed key nobody takes answers 410 once the timeout passes, and is gone after another."""

    async def test() -> None:
        registry = TransferRegistry(timeout=0.05)
        registry.reserve(9)
        registry.complete(9, T)
        await asyncio.sleep(0.08)
        with raises(410, "room 9", "expired"):
            await registry.take(9, wait=1)
        await asyncio.sleep(0.08)
        assert len(registry) == 0

    run(test)


def test_taken_and_failed_keys_are_dropped_after_the_timeout() -> None:
    """Tombstones of taken and failed keys leave the registry one timeout later."""

    async def test() -> None:
        registry = TransferRegistry(timeout=0.05)
        registry.reserve(1)
        registry.complete(1, T)
        await registry.take(1, wait=0)
        registry.reserve(2)
        registry.fail(2, "boom")
        assert len(registry) == 2
        await asyncio.sleep(0.1)
        assert len(registry) == 0

    run(test)


def test_two_decodes_of_one_room_one_gets_it_the_other_409() -> None:
    """Two decodes waiting on one room: the first served takes it, the other is told it was taken."""

    async def test() -> None:
        registry = TransferRegistry(timeout=5)
        first = asyncio.ensure_future(registry.take(5, wait=5))
        second = asyncio.ensure_future(registry.take(5, wait=5))
        await asyncio.sleep(0.01)
        registry.reserve(5)
        registry.complete(5, T)
        done = await asyncio.gather(first, second, return_exceptions=True)
        assert done[0] == T
        assert isinstance(done[1], DisaggregationError) and done[1].status == 409
        registry.close()

    run(test)


# --- the request's fields ----------------------------------------------------------------


def test_no_fields_or_no_flag_is_no_handoff() -> None:
    """A body without bootstrap_room or with kv_transfer_params whose flags are false is served locally."""
    assert parse_handoff({"prompt": "x"}, 1) is None
    assert parse_handoff({"bootstrap_room": None, "bootstrap_host": "h"}, 1) is None
    params = {"do_remote_decode": False, "do_remote_prefill": False}
    assert parse_handoff({"kv_transfer_params": params}, 1) is None


def test_an_int_room_gives_item_j_room_plus_j_in_sglang_order() -> None:
    """Two prompts with n=2 are four items; item j is prompt j % 2 with room + j."""
    handoff = parse_handoff(
        {"bootstrap_room": 100, "bootstrap_host": "h", "bootstrap_port": 8998}, 2, 2
    )
    assert handoff == SGLangHandoff(rooms=[[100, 102], [101, 103]], host="h", port=8998)


def test_a_room_list_needs_one_room_per_item() -> None:
    """A list of rooms must have prompts x n distinct rooms; else a 400 names the count."""
    handoff = parse_handoff({"bootstrap_room": [5, 6, 7, 8]}, 2, 2)
    assert isinstance(handoff, SGLangHandoff) and handoff.rooms == [[5, 7], [6, 8]]
    with raises(400, "2 rooms", "n=2", "(4)"):
        parse_handoff({"bootstrap_room": [5, 6]}, 2, 2)
    with raises(400, "repeats"):
        parse_handoff({"bootstrap_room": [5, 5]}, 2)
    with raises(400, "bootstrap_room"):
        parse_handoff({"bootstrap_room": "5"}, 1)
    with raises(400, "n=0"):
        parse_handoff({"bootstrap_room": 5}, 1, 0)


def test_per_item_hosts_must_name_one_server() -> None:
    """bootstrap_host/bootstrap_port may be per-item lists of one value; two servers are refused."""
    handoff = parse_handoff(
        {"bootstrap_room": [1, 2], "bootstrap_host": ["h", "h"], "bootstrap_port": [9, 9]}, 2
    )
    assert isinstance(handoff, SGLangHandoff) and (handoff.host, handoff.port) == ("h", 9)
    with raises(400, "bootstrap_host", "one prefill engine"):
        parse_handoff({"bootstrap_room": [1, 2], "bootstrap_host": ["h", "g"]}, 2)
    with raises(400, "bootstrap_port", "1..65535"):
        parse_handoff({"bootstrap_room": 1, "bootstrap_port": 0}, 1)


def test_vllm_params_tell_the_leg() -> None:
    """do_remote_decode is a prefill leg; do_remote_prefill a decode leg that needs host, port and id."""
    assert parse_handoff({"kv_transfer_params": {"do_remote_decode": True}}, 1) == VLLMHandoff(
        prefill=True
    )
    params = {
        "do_remote_prefill": True,
        "remote_host": "h",
        "remote_port": 9,
        "remote_request_id": "r",
        "remote_block_ids": [0, 1],
    }
    decode = parse_handoff({"kv_transfer_params": params}, 1)
    assert decode == VLLMHandoff(prefill=False, host="h", port=9, request_id="r", block_ids=[0, 1])
    with raises(400, "remote_request_id is missing"):
        parse_handoff({"kv_transfer_params": {**params, "remote_request_id": None}}, 1)
    with raises(400, "both"):
        parse_handoff({"kv_transfer_params": {**params, "do_remote_decode": True}}, 1)
    with raises(400, "give one"):
        parse_handoff({"kv_transfer_params": params, "bootstrap_room": 1}, 1)


def test_received_blocks_checks_rank_and_prompt() -> None:
    """A transfer from another rank than disagg_prefill_dp_rank, or of another prompt, is a 400."""
    handoff = SGLangHandoff(rooms=[[1]], host="h", port=9, prefill_dp_rank=1)
    assert received_blocks(handoff, [[1, 2, 3, 4, 5]], {1: T}, 4) == [1]
    with raises(400, "disagg_prefill_dp_rank=0", "dp_rank 1"):
        received_blocks(SGLangHandoff([[1]], "h", 9, 0), [[1, 2, 3, 4, 5]], {1: T}, 4)
    with raises(400, "another prompt"):
        received_blocks(handoff, [[1, 2, 3, 4, 6]], {1: T}, 4)
    with raises(400, "--page-size"):
        received_blocks(handoff, [[1, 2, 3, 4, 5]], {1: T}, 8)


# --- the scheduler ---------------------------------------------------------------------


class _Sink:
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)


def test_received_blocks_are_stored_published_and_counted_as_cached() -> None:
    """A decode's received blocks are stored with one BlockStored and reported as cached, not prefilled."""
    sink = _Sink()
    sched = Scheduler(0, PrefixCache(4, 64), sink, prefill_tokens_per_s=10.0)
    sched.submit("r", list(range(1, 11)), 2, received_blocks=2)
    step = sched.step()
    assert step.duration_s == pytest.approx(2 / 10.0)  # only the 2-token tail is prefilled
    stored = [e for b in sink.batches for e in b.events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [2]
    assert stored[0].token_ids == list(range(1, 9))
    (done,) = sched.step().finished
    assert (done.cached_tokens, done.prompt_tokens, done.completion_tokens) == (8, 10, 2)


def test_received_blocks_of_a_block_aligned_prompt_count_all_but_the_last_as_cached() -> None:
    """A decode given every block of a prompt ending on a block boundary stores them all,
    and reports every block but the last as cached (it computes the last token, as vLLM's
    decode reports it); one token more, every received block is cached."""
    sink = _Sink()
    sched = Scheduler(0, PrefixCache(4, 64), sink, prefill_tokens_per_s=10.0)
    sched.submit("r", list(range(1, 13)), 1, received_blocks=3)
    step = sched.step()
    assert step.duration_s == pytest.approx(4 / 10.0)  # the last block is computed again
    stored = [e for b in sink.batches for e in b.events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [3]
    (done,) = step.finished
    assert (done.cached_tokens, done.prompt_tokens) == (8, 12)
    sched.submit("s", list(range(101, 114)), 1, received_blocks=3)
    (longer,) = sched.step().finished
    assert (longer.cached_tokens, longer.prompt_tokens) == (12, 13)
