"""Block sizes: declared versus observed, mismatches counted, logged and (for the router) skipped."""

from __future__ import annotations

import logging

import pytest

from kvevents import (
    BlockRemoved,
    BlockStored,
    Delivery,
    Holder,
    KVEventBatch,
    PrefixIndex,
    Reset,
    Router,
)
from kvevents.subscribe.block_sizes import BlockSizes

A = Holder("http://a:1", 0)
B = Holder("http://a:1", 1)


def stored(
    tokens: list[int], size: int, first_hash: int = 1, medium: str | None = None
) -> BlockStored:
    n = len(tokens) // size if tokens else 1
    return BlockStored(
        block_hashes=list(range(first_hash, first_hash + n)),
        parent_block_hash=None,
        token_ids=tokens,
        block_size=size,
        lora_id=None,
        medium=medium,
    )


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=1.0, events=list(events), data_parallel_rank=0)  # type: ignore[arg-type]


def test_first_known_size_is_expected_and_others_are_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Shared mode: the first stored chain sets the size; a chain of another size is dropped, counted and logged once."""
    sizes = BlockSizes(shared=True)
    ok = batch(stored(list(range(8)), 4))
    assert sizes.check(A, ok) is ok and sizes.size == 4
    with caplog.at_level(logging.ERROR, logger="kvevents.subscribe.block_sizes"):
        bad = sizes.check(B, batch(stored(list(range(16)), 8, 10), BlockRemoved(block_hashes=[1])))
        sizes.check(B, batch(stored(list(range(16)), 8, 20)))
    assert [type(e).__name__ for e in bad.events] == ["BlockRemoved"]
    assert sizes.mismatch_events(B) == 2 and sizes.mismatch_events(A) == 0
    [record] = sizes.mismatches.values()
    assert (record.source, record.expected, record.observed, record.count) == ("events", 4, 8, 2)
    [line] = [r.getMessage() for r in caplog.records]
    assert "http://a:1 rank 1" in line and "block_size 8" in line and "4 is expected" in line
    assert "first events of http://a:1 rank 0" in line


def test_declarations_are_checked_against_the_expected_size() -> None:
    """A configured size becomes the expectation; a /server_info size that disagrees is a counted mismatch."""
    sizes = BlockSizes(shared=True, size=16, source="router --block-size")
    assert sizes.declare(A, 16, "configured", "configured for a")
    assert not sizes.declare(A, 32, "server_info", "/server_info of a")
    assert sizes.for_holder(A)["mismatches"] == [
        {
            "worker": A.worker,
            "dp_rank": 0,
            "source": "server_info",
            "expected": 16,
            "expected_from": "router --block-size",
            "observed": 32,
            "count": 1,
        }
    ]


def test_per_holder_mode_lets_engines_differ() -> None:
    """Unshared (watch): each holder has its own expectation, so different engines may use different sizes."""
    sizes = BlockSizes(shared=False)
    sizes.check(A, batch(stored(list(range(4)), 4)))
    sizes.check(B, batch(stored(list(range(8)), 8)))
    assert sizes.mismatches == {}
    assert sizes.expected(A) is not None and sizes.expected(B) is not None
    assert (sizes.expected(A)[0], sizes.expected(B)[0]) == (4, 8)  # type: ignore[index]


def test_offload_copies_carry_no_size_and_pass() -> None:
    """A BlockStored without tokens (a tier copy) is never counted as a mismatch."""
    sizes = BlockSizes(shared=True, size=16)
    copy = batch(stored([], 4, medium="CPU"))
    assert sizes.check(A, copy) is copy and sizes.mismatches == {}


def test_router_skips_mismatching_events_and_reports_them() -> None:
    """The router keeps blocks of the expected size only, and /workers' summary shows the mismatch."""
    router = Router(block_size=4)
    router.add_holder(A, block_size=4, source="configured")
    router.add_holder(B, block_size=8, source="server_info", origin="/server_info of b")
    router.handle(Delivery(A, 0, batch(stored(list(range(8)), 4))))
    router.handle(Delivery(B, 0, batch(stored(list(range(16)), 8, 50))))
    assert router.index.holder_size(A) == 2 and router.index.holder_size(B) == 0
    assert router.index.stats.block_size_mismatch == 0  # skipped before the index
    summary = {h["dp_rank"]: h["block_size"] for h in router.holder_summary()}
    assert summary[1]["observed"] == 8 and summary[1]["expected"] == 4
    assert {(m["source"], m["count"]) for m in summary[1]["mismatches"]} == {
        ("server_info", 1),
        ("events", 1),
    }
    decision = router.route([*range(8), 99])
    assert (decision.dp_rank, decision.matched_tokens) == (0, 8)


def test_the_router_follows_its_engines_to_a_new_block_size(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A size the engines gave (not --block-size) changes once /server_info declares a new
    one and every holder agrees: until then the new size's events are skipped; then the
    index starts over at it. Events alone never change it: one stream may carry chains
    of two sizes (vLLM with KV-cache groups of different block sizes)."""
    router = Router()
    router.add_holder(A, block_size=4, source="server_info")
    router.add_holder(B, block_size=4, source="server_info")
    router.handle(Delivery(A, 0, batch(stored(list(range(8)), 4))))
    router.handle(Delivery(B, 0, batch(stored(list(range(8)), 4, 10))))
    router.handle(Delivery(A, 1, batch(stored(list(range(16)), 8, 20))))  # a second size
    assert (router.index.block_size, router.block_sizes.changes) == (4, 0)
    router.add_holder(B, block_size=8, source="server_info")  # B restarted at 8; A not yet
    router.handle(Delivery(B, 1, batch(stored(list(range(16)), 8, 30))))
    assert (router.index.block_size, router.index.holder_size(B)) == (4, 2)
    assert router.block_sizes.mismatch_events(B) == 1
    with caplog.at_level(logging.WARNING, logger="kvevents.subscribe.block_sizes"):
        router.add_holder(A, block_size=8, source="server_info")
    assert router.index.block_size == 8 and router.block_sizes.changes == 1
    assert (router.index.holder_size(A), router.index.holder_size(B)) == (0, 0)
    assert any("block size changed from 4 to 8" in r.getMessage() for r in caplog.records)
    router.handle(Delivery(A, 2, batch(stored(list(range(16)), 8, 40))))
    decision = router.route([*range(16), 99])
    assert (decision.dp_rank, decision.matched_tokens, decision.n_blocks) == (0, 16, 2)
    router.handle(Delivery(B, 2, batch(stored(list(range(24)), 8, 50))))
    assert router.index.holder_size(B) == 3 and router.block_sizes.mismatch_events(B) == 1


def test_a_holder_known_by_its_events_holds_back_a_new_size_until_it_restarts() -> None:
    """A holder that declares nothing (a vLLM known by URL) agrees with a new size only if
    every chain it stored since its last reset had it."""
    router = Router()
    router.add_holder(A, block_size=4, source="server_info")
    router.handle(Delivery(B, 0, batch(stored(list(range(8)), 4, 10))))
    router.add_holder(A, block_size=8, source="server_info")
    assert router.index.block_size == 4
    router.handle(
        Reset(worker=B.worker, dp_rank=B.dp_rank, last_seq=0, new_seq=0, reason="restarted")
    )
    router.add_holder(A, block_size=8, source="server_info")
    assert router.index.block_size == 8 and router.block_sizes.changes == 1


def test_a_removed_holder_does_not_hold_back_a_new_block_size() -> None:
    """An engine restarted with fewer ranks drops the others; the ones left decide."""
    router = Router()
    for h in (A, B):
        router.add_holder(h, block_size=4, source="server_info")
    router.remove_holder(B)
    router.add_holder(A, block_size=8, source="server_info")
    assert router.index.block_size == 8 and router.block_sizes.mismatches == {}


def test_an_operators_block_size_is_never_changed_by_the_engines() -> None:
    """--block-size (or an engine's configured size) is the operator's word: engines that
    all say another size are mismatches, as before."""
    router = Router(block_size=4)
    router.add_holder(A, block_size=8, source="server_info")
    router.handle(Delivery(A, 0, batch(stored(list(range(8)), 8))))
    assert router.index.block_size == 4 and router.index.holder_size(A) == 0
    configured = Router()
    configured.add_holder(A, block_size=4, source="configured")
    configured.add_holder(A, block_size=8, source="server_info")
    assert configured.index.block_size == 4 and configured.block_sizes.changes == 0


def test_a_warm_start_from_a_peer_at_the_old_size_follows_the_engines_to_the_new_one() -> None:
    """No --block-size: a peer's snapshot at 4 while the engines now say 8 (a rolling
    change). The router follows the engines: it keyed requests at the snapshot's 4 while
    storing their chains at 8, and nothing matched, with nothing said."""
    peer = PrefixIndex(block_size=4)
    peer.apply(A, batch(stored(list(range(8)), 4)))
    router = Router()
    router.restore_index(PrefixIndex.from_bytes(peer.to_bytes()))
    router.add_holder(A, block_size=8, source="server_info")
    assert router.index.block_size == 8 and router.block_sizes.changes == 1
    router.handle(Delivery(A, 5, batch(stored(list(range(100, 116)), 8, 7))))
    assert router.route([*range(100, 116), 99]).matched_tokens == 16
