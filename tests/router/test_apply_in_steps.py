"""Long batches are applied in steps: the same index as one piece, the loop free between.

An engine serving long prompts publishes batches of thousands of block operations; the
router applies them in steps of a few hundred blocks and gives its event loop a turn
every half millisecond, so a request never waits for a whole batch. These tests hold
the index to be exactly what one ``apply`` makes, the pauses to leave a valid index,
and ``/dump`` to never copy half a batch.
"""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from kvevents.bench.ingest import _payloads
from kvevents.errors import SubscriberStateError
from kvevents.index.prefix_index import PrefixIndex
from kvevents.index.snapshot import decode_snapshot
from kvevents.router.decide.router import Router
from kvevents.router.fleet.warm_start import dump_bytes
from kvevents.router.serve.service import RouterService
from kvevents.subscribe.items import Delivery
from kvevents.types import Holder
from kvevents.wire.codec import decode_batch
from kvevents.wire.events import BlockRemoved, BlockStored, KVEventBatch

H = Holder("http://engine", 0)
H2 = Holder("http://engine", 1)


@pytest.fixture(scope="module")
def trace_batches() -> list[KVEventBatch]:
    """The ingest benchmark's batches: the Mooncake trace through a small cache, so long
    chains are stored and evicted (hundreds to thousands of blocks per event)."""
    return [decode_batch(payload) for payload, _ in _payloads(120, 2048)]


def _chain(blocks: int, block_size: int, *, seed: int) -> BlockStored:
    """One stored chain of ``blocks`` blocks of random tokens, hashes 1..blocks."""
    rng = random.Random(seed)
    return BlockStored(
        block_hashes=list(range(1, blocks + 1)),
        parent_block_hash=None,
        token_ids=[rng.randrange(50_000) for _ in range(block_size * blocks)],
        block_size=block_size,
        lora_id=None,
        medium=None,
    )


@pytest.mark.slow
@pytest.mark.parametrize("step", [1, 7, 256])
@pytest.mark.parametrize("max_entries", [None, 3000])
def test_steps_make_the_index_one_apply_makes(
    trace_batches: list[KVEventBatch], step: int, max_entries: int | None
) -> None:
    """Also at the memory bound (3,000 entries: pruned on most batches), with two holders
    sharing chains: pieces settle once, after the last, as one store does."""
    bound = {} if max_entries is None else {"max_entries": max_entries}
    whole, stepped = PrefixIndex(block_size=16, **bound), PrefixIndex(block_size=16, **bound)
    pauses = 0
    for i, batch in enumerate(trace_batches):
        for holder in (H, H2) if i % 3 == 0 else (H,):
            whole.apply(holder, batch)
            for _ in stepped.apply_steps(holder, batch, step):
                pauses += 1
    assert pauses > len(trace_batches)  # long chains did pause
    if max_entries is not None:
        assert whole.stats.pruned_entries > 0  # the bound was reached
    one, steps = decode_snapshot(whole.to_bytes()), decode_snapshot(stepped.to_bytes())
    # the engine-hash map is the same map, filled in another order (its order is unused)
    assert dict(zip(steps.hashes, steps.hash_keys, strict=True)) == dict(
        zip(one.hashes, one.hash_keys, strict=True)
    )
    same = msgspec.structs.replace(steps, hashes=one.hashes, hash_keys=one.hash_keys)
    assert same == one  # every block in the same order (recency), refs, stats, seqs


def test_each_pause_leaves_a_prefix_of_the_chain_matchable() -> None:
    """A stored chain's later blocks come first, so a match in a pause finds either
    nothing of the new chain or a prefix that the finished store also holds."""
    index = PrefixIndex(block_size=4)
    stored = _chain(1000, 4, seed=3)
    keys = index.keys_for(stored.token_ids)
    seen = []
    for _ in index.apply_steps(H, KVEventBatch(ts=0.0, events=[stored]), 300):
        seen.append(index.match_keys(keys).by_holder().get(H))
    assert len(seen) == 3  # pieces of 300, 300, 300, 100: a pause between each
    assert all(m is None for m in seen)  # the root block is stored last
    assert index.match_keys(keys).by_holder()[H].gpu == 1000
    removed = BlockRemoved(block_hashes=list(range(1000, 0, -1)))  # leaves first
    lengths = []
    for _ in index.apply_steps(H, KVEventBatch(ts=0.0, events=[removed]), 300):
        lengths.append(index.match_keys(keys).by_holder()[H].gpu)
    assert lengths == [700, 400, 100]
    assert H not in index.match_keys(keys).by_holder()


class _Feed:
    """Hands the service's consumer a list of items, then reports itself closed (the
    subscriber's ``aget``, without the sockets: the scheduling is what is tested)."""

    def __init__(self, items: list[Delivery]) -> None:
        self.items = items

    async def aget(self, timeout: float | None = None) -> Delivery | None:
        if not self.items:
            raise SubscriberStateError("the feed is closed")
        return self.items.pop(0)


def test_the_loop_answers_between_steps_and_dump_never_copies_half_a_batch() -> None:
    big = _chain(20_000, 16, seed=5)
    items = [Delivery(H, seq, KVEventBatch(ts=0.0, events=[big])) for seq in range(2)]
    router = Router(block_size=16)
    router.add_holder(H)
    service = RouterService(router, [])

    async def main() -> tuple[int, list[int]]:
        consumer = asyncio.create_task(service._consume(_Feed(items)))  # type: ignore[arg-type]
        turns_mid_batch, dumped = 0, []
        while not consumer.done():
            if 0 < router.index.holder_size(H) < 20_000 and router.batches_applied == 0:
                turns_mid_batch += 1
                if turns_mid_batch == 2:  # then wait for a copy: it waits for the batch
                    copy = PrefixIndex.from_bytes(await dump_bytes(router.index, service.applying))
                    dumped.append(copy.holder_size(H))
                    dumped.append(copy.applied_seqs.get(H, -1))
            await asyncio.sleep(0)
        await consumer
        return turns_mid_batch, dumped

    turns, dumped = asyncio.run(asyncio.wait_for(main(), 60))
    assert turns >= 2  # the loop ran other work while the first batch was applied
    assert dumped == [20_000, 0]  # the copy waited for the batch and its seq
    assert router.batches_applied == 2 and router.index.applied_seqs[H] == 1
