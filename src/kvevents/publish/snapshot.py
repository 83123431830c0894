"""A rank's block set as the events that rebuild it: what a snapshot answer carries.

:func:`snapshot_events` turns a :class:`~kvevents.publish.block_state.StateView` into
the events which, applied in order to an empty holder, leave what the live stream left:

* ``AllBlocksCleared`` first, so the list stands alone whatever the consumer held;
* a store naming no block for each sliding-window group, so a consumer has the group's
  table (which shortens hits) even when the window holds nothing;
* per group, in the order the groups first appeared, the sliding windows last (a
  consumer takes the first full-attention group as its main one, and keys a window's
  blocks through its hashes), every block stored with its tokens after its
  parent (a parent is re-learnt first, so the child is keyed under its real chain), as
  chains of up to :data:`CHAIN_BLOCKS` blocks; then the copies into other tiers, by hash;
* last, a ``BlockRemoved`` of every ghost (a parent held in no tier).

A consumer applies a batch's sliding-window events after its main group's, so a
window's block whose full-attention twin is a ghost (or gone) is keyed from its own
tokens under its main parent, as a consumer does when it sees a hash for the first time:
exact when that parent is held, otherwise under a key no request reaches, until the
window stores it again. Its chain is cut from the window's other blocks, so their keys
still come through the main group's hashes.

A block held in several tiers is stored once with its tokens (its GPU tier first) and
copied into the others, as the engine reported it; a tier holding several copies of it
gets as many. :func:`snapshot_parts` cuts the list
into parts of at most :data:`PART_BLOCKS` blocks, each one batch on the wire
(:mod:`kvevents.wire.frames`), so no frame grows with the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from kvevents.publish.block_state import GroupView, Origin, StateView
from kvevents.types import Hash
from kvevents.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)

__all__ = ["CHAIN_BLOCKS", "PART_BLOCKS", "snapshot_events", "snapshot_parts"]

CHAIN_BLOCKS = 256
"""Most blocks one stored chain of a snapshot carries."""
PART_BLOCKS = 4096
"""Most blocks one part (one frame) of a snapshot names."""


class _Chain:
    """A stored chain being built: blocks that follow each other with the same origin."""

    __slots__ = ("extras", "hashes", "medium", "origin", "parent", "tokens", "twinned")

    def __init__(self, group: GroupView, block: Hash, medium: str | None, twinned: bool) -> None:
        self.origin: Origin = group.origins[block]
        self.medium = medium
        self.twinned = twinned
        self.parent = group.parents[block]
        self.hashes: list[Hash] = [block]
        self.tokens: list[int] = group.tokens[block].tolist()
        self.extras: list[Any] = [group.extras.get(block)]

    def takes(self, group: GroupView, block: Hash, medium: str | None, twinned: bool) -> bool:
        return (
            group.parents[block] == self.hashes[-1]
            and group.origins[block] == self.origin
            and medium == self.medium
            and twinned == self.twinned
            and len(self.hashes) < CHAIN_BLOCKS
        )

    def add(self, group: GroupView, block: Hash) -> None:
        self.hashes.append(block)
        self.tokens.extend(group.tokens[block].tolist())
        self.extras.append(group.extras.get(block))

    def event(self) -> BlockStored:
        o = self.origin
        extras = self.extras if any(e is not None for e in self.extras) else None
        return BlockStored(
            block_hashes=self.hashes,
            parent_block_hash=self.parent,
            token_ids=self.tokens,
            block_size=o.block_size,
            lora_id=o.lora_id,
            medium=self.medium,
            cache_salt=o.cache_salt,
            session_id=o.session_id,
            lora_name=o.lora_name,
            extra_keys=extras,
            group_idx=o.group_idx,
            kv_cache_spec_kind=o.kind,
            kv_cache_spec_sliding_window=o.window,
        )


def _in_order(parents: dict[Hash, Hash | None]) -> list[Hash]:
    """The blocks of ``parents`` (in store order), each after its parent when held."""
    done: set[Hash] = set()
    out: list[Hash] = []
    for block in parents:
        if block in done:
            continue
        path = [block]
        on_path = {block}
        parent = parents[block]
        while parent is not None and parent in parents:
            if parent in done or parent in on_path:
                break
            path.append(parent)
            on_path.add(parent)
            parent = parents[parent]
        for b in reversed(path):
            done.add(b)
            out.append(b)
    return out


def _window_tables(view: StateView) -> list[Event]:
    """A store naming no block per sliding-window group: the consumer's table for it."""
    return [
        BlockStored(
            block_hashes=[],
            parent_block_hash=None,
            token_ids=[0] * w.block_size,
            block_size=w.block_size,
            lora_id=None,
            medium=None,
            group_idx=g,
            kv_cache_spec_kind=w.kind,
            kv_cache_spec_sliding_window=w.window,
        )
        for g, w in view.windows.items()
    ]


def snapshot_events(view: StateView) -> Iterator[Event]:
    """The events that rebuild ``view`` on an empty holder (see the module docstring),
    produced as they are built."""
    windowed = [g for g in view.groups if g in view.windows]
    order = [g for g in view.groups if g not in view.windows] + windowed
    main = view.groups[order[0]] if order and order[0] not in view.windows else None
    yield AllBlocksCleared()
    yield from _window_tables(view)
    ghosts: dict[int | None, list[Hash]] = {}
    for g in order:
        group = view.groups[g]
        twins = main.tiers if main is not None and g in view.windows else None
        chain: _Chain | None = None
        copies: dict[tuple[str | None, str | None], list[Hash]] = {}
        origins: dict[tuple[str | None, str | None], Origin] = {}
        for block in _in_order(group.parents):
            tiers = sorted(group.tiers[block], key=lambda t: t.name != "GPU")
            medium = tiers[0].medium if tiers else group.origins[block].medium
            if not tiers:
                ghosts.setdefault(g, []).append(block)
            for i, t in enumerate(tiers):
                extra = t.copies - 1 if i == 0 else t.copies  # the first is stored whole
                if extra:
                    copies.setdefault((t.medium, t.kind), []).extend([block] * extra)
                    origins.setdefault((t.medium, t.kind), group.origins[block])
            # a window's block whose main twin is held is keyed through its hash; one
            # whose twin is not, from its tokens: never both in one event, which a
            # consumer would key whole from the tokens
            twinned = twins is not None and bool(twins.get(block))
            if chain is not None and chain.takes(group, block, medium, twinned):
                chain.add(group, block)
                continue
            if chain is not None:
                yield chain.event()
            chain = _Chain(group, block, medium, twinned)
        if chain is not None:
            yield chain.event()
        for (medium, kind), blocks in copies.items():
            o = origins[(medium, kind)]
            for i in range(0, len(blocks), CHAIN_BLOCKS):
                yield BlockStored(
                    block_hashes=blocks[i : i + CHAIN_BLOCKS],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=o.block_size,
                    lora_id=None,
                    medium=medium,
                    group_idx=g,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=o.window if kind is not None else None,
                )
    for g, blocks in ghosts.items():
        for i in range(0, len(blocks), CHAIN_BLOCKS):
            yield BlockRemoved(block_hashes=blocks[i : i + CHAIN_BLOCKS], group_idx=g)


def snapshot_parts(
    view: StateView,
    rank: int,
    encode: Callable[[KVEventBatch], bytes],
    clock: Callable[[], float] = time.time,
) -> Iterator[bytes]:
    """The snapshot of ``view`` as encoded batches of at most :data:`PART_BLOCKS` blocks,
    each as soon as it is full (so the first goes out before the last is built)."""
    ts = clock()
    part: list[Event] = []
    size = 0
    for event in snapshot_events(view):
        n = 0 if type(event) is AllBlocksCleared else len(event.block_hashes)  # type: ignore[union-attr]
        if part and size + n > PART_BLOCKS:
            yield encode(KVEventBatch(ts=ts, events=part, data_parallel_rank=rank))
            part, size = [], 0
        part.append(event)
        size += n
    yield encode(KVEventBatch(ts=ts, events=part, data_parallel_rank=rank))
