"""A rank's current block set, as the events it published describe it.

A publisher with snapshots on feeds every batch it sends to a :class:`BlockState`, on the
sender thread, right after the batch took its seq; the replay thread asks
:meth:`BlockState.view` for the state and its seq, and :mod:`kvevents.publish.snapshot`
turns that into the events that rebuild it. Per block it keeps what a consumer needs to
key it as it keyed the live stream: parent hash, tokens, the store's fields, extra keys,
and the tiers holding it with their count of copies, per KV-cache group.

Invariants (under the lock):

* the set is exactly what the events up to ``seq`` describe, or :meth:`BlockState.view`
  says why not;
* a main-group block held in no tier stays as a *ghost* while a kept block names it as
  parent, so the child is still stored under its real chain;
* at most ``max_blocks`` blocks, ghosts included. Past it, or after a dropped or
  unencodable batch, the set is freed until an ``AllBlocksCleared`` makes it exact again.

Layout: per group one dict per field keyed by hash, tokens in an ``array``, never a tuple
per block: tuples are tracked by the cyclic garbage collector and would set off
collections of the engine's whole heap from the sender thread. Values are never changed
in place, so :meth:`BlockState.view` copies the dicts under the lock at C speed and the sender
never waits for a snapshot being built.
"""

from __future__ import annotations

import logging
import threading
from array import array
from typing import Any, NamedTuple

from kvevents.types import Hash
from kvevents.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

log = logging.getLogger("kvevents.publish")

__all__ = ["BlockState", "GroupView", "Origin", "StateView", "Tier", "Window"]


class Origin(NamedTuple):
    """What a stored chain says of every block in it (one per event, shared)."""

    block_size: int
    lora_id: int | None
    medium: str | None
    cache_salt: str | None
    session_id: str | None
    lora_name: str | None
    group_idx: int | None
    kind: str | None
    window: int | None


class Tier(NamedTuple):
    """One tier holding a block: its name (the medium upper-cased, nil as ``GPU``), the
    medium as the engine sent it, the store's ``kv_cache_spec_kind``, and how many copies
    it holds (vLLM may store a hash twice, and removes each copy on its own)."""

    name: str
    medium: str | None
    kind: str | None
    copies: int = 1


class Window(NamedTuple):
    """A sliding-window group as its last store described it: a consumer keeps a table
    for it (which shortens hits) even when it holds no block."""

    kind: str
    window: int
    block_size: int


class GroupView(NamedTuple):
    """One group's blocks, by hash in store order: parent, tokens, origin, extra key
    (only blocks that have one), tiers (empty: a ghost)."""

    parents: dict[Hash, Hash | None]
    tokens: dict[Hash, array[int]]
    origins: dict[Hash, Origin]
    extras: dict[Hash, Any]
    tiers: dict[Hash, tuple[Tier, ...]]


class StateView(NamedTuple):
    """A copy of the state at ``seq``: its groups in order of first use, and the
    sliding-window groups' layout."""

    seq: int
    groups: dict[int | None, GroupView]
    windows: dict[int | None, Window]


def tier_name(medium: str | None) -> str:
    return "GPU" if medium is None else medium.upper()


class _Group:
    """One group's columns (see the module docstring); ``children`` counts, per hash, the
    blocks that name it as parent (main groups only)."""

    __slots__ = ("children", "extras", "origins", "parents", "tiers", "tokens")

    def __init__(self) -> None:
        self.parents: dict[Hash, Hash | None] = {}
        self.tokens: dict[Hash, array[int]] = {}
        self.origins: dict[Hash, Origin] = {}
        self.extras: dict[Hash, Any] = {}
        self.tiers: dict[Hash, tuple[Tier, ...]] = {}
        self.children: dict[Hash, int] = {}

    def view(self) -> GroupView:
        return GroupView(
            dict(self.parents),
            dict(self.tokens),
            dict(self.origins),
            dict(self.extras),
            dict(self.tiers),
        )

    def drop(self, h: Hash) -> None:
        """Forget block ``h`` (held nowhere, nobody's parent), then any ghost it leaves."""
        while True:
            parent = self.parents.pop(h)
            del self.tokens[h], self.origins[h], self.tiers[h]
            self.extras.pop(h, None)
            if parent is None or not self.release(parent):
                return
            h = parent

    def release(self, h: Hash) -> bool:
        """One child less names ``h``; True when it is now a ghost nobody keeps."""
        left = self.children.get(h, 0) - 1
        if left > 0:
            self.children[h] = left
            return False
        self.children.pop(h, None)
        return h in self.tiers and not self.tiers[h]


class BlockState:
    """The block set of one rank; :meth:`apply` on the sender thread, :meth:`view` on any."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"BlockState max_blocks={max_blocks} must be at least 1")
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._groups: dict[int | None, _Group] = {}
        self._windows: dict[int | None, Window] = {}
        self._seq = -1
        self._unavailable: str | None = None

    @property
    def blocks(self) -> int:
        """Blocks (ghosts included) the set holds now."""
        return sum(len(group.parents) for group in list(self._groups.values()))

    @property
    def exact(self) -> bool:
        """Whether the set is exactly what the published events describe."""
        return self._unavailable is None

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        """Apply the batch published as ``seq``."""
        with self._lock:
            self._seq = seq
            events = batch.events
            if self._unavailable is not None:
                cleared = [i for i, e in enumerate(events) if type(e) is AllBlocksCleared]
                if not cleared:
                    return
                events = events[cleared[-1] :]
            try:
                for event in events:
                    kind = type(event)
                    if kind is BlockStored:
                        self._stored(event)  # type: ignore[arg-type]
                    elif kind is BlockRemoved:
                        self._removed(event)  # type: ignore[arg-type]
                    elif kind is AllBlocksCleared:
                        self._clear()
            except Exception as exc:  # a bad event or a bug: the set is no longer exact
                log.debug("KV-event batch seq %d not tracked", seq, exc_info=True)
                self._give_up(f"batch seq {seq} could not be tracked ({type(exc).__name__}: {exc})")
                return
            if self.blocks > self.max_blocks:
                self._give_up(
                    f"the rank holds more than {self.max_blocks} blocks (the kv-events "
                    "config's snapshot_max_blocks)"
                )

    def invalidate(self, reason: str) -> None:
        """The set is no longer exact (a batch was dropped or not encoded): say ``reason``."""
        with self._lock:
            self._give_up(reason)

    def view(self) -> StateView | str:
        """The state and its seq, or why there is no exact state to give."""
        with self._lock:
            if self._unavailable is not None:
                return (
                    f"no exact block set since {self._unavailable}; it is exact again "
                    "after the engine clears its cache"
                )
            if self._seq < 0:
                return "nothing was published yet"
            groups = {g: group.view() for g, group in self._groups.items()}
            return StateView(self._seq, groups, dict(self._windows))

    # --- the sender thread, under the lock ----------------------------------------------

    def _give_up(self, reason: str) -> None:
        if self._unavailable is None:
            log.warning("KV-event snapshots unavailable: %s", reason)
        self._clear()
        self._unavailable = reason

    def _clear(self) -> None:
        self._groups = {g: _Group() for g in self._groups}  # the layout stays
        self._unavailable = None

    def _group(self, g: int | None) -> _Group:
        group = self._groups.get(g)
        if group is None:
            group = self._groups[g] = _Group()
        return group

    def _main(self) -> int | None:
        """The first group seen that is no sliding window (None: none, or no groups)."""
        return next((g for g in self._groups if g not in self._windows), None)

    def _stored(self, ev: BlockStored) -> None:
        g = ev.group_idx
        group = self._group(g)
        kind, window = ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window
        if kind is not None and window is not None and ev.token_ids:
            self._windows[g] = Window(kind, window, ev.block_size)
        hashes = ev.block_hashes
        if not hashes:
            return
        tier = Tier(tier_name(ev.medium), ev.medium, kind)
        tiers = group.tiers
        tokens = ev.token_ids
        if not tokens:  # a copy into another tier of blocks held (known by hash)
            for h in hashes:
                if tiers.get(h):
                    tiers[h] = _with_tier(tiers[h], tier)
            return
        size = ev.block_size
        m = len(tokens) // size if size > 0 else 0
        n = len(hashes)
        if m < n or m * size != len(tokens):
            return  # malformed: a consumer stores nothing of it either
        if tier.name != "GPU" and g is not None and all(tiers.get(h) for h in hashes):
            # vLLM's offloading connector reports copies with their tokens: the blocks
            # are the ones already held, keyed as they are
            for h in hashes:
                tiers[h] = _with_tier(tiers[h], tier)
            return
        origin = Origin(
            size, ev.lora_id, ev.medium, ev.cache_salt, ev.session_id, ev.lora_name, g, kind, window
        )
        extra = ev.extra_keys
        skipped = m - n  # a sliding window names only its last blocks
        parent = ev.parent_block_hash if not skipped else None
        main = self._main() if g in self._windows else g
        twins = self._groups[main].parents if main != g and main in self._groups else None
        parents, children, alone = group.parents, group.children, (tier,)
        for i, h in enumerate(hashes):
            p = hashes[i - 1] if i else parent
            if twins is not None and h in twins:
                # a window's block chains from the main group's parent of its hash: a
                # consumer keys it through the main group, or from there
                p = twins[h]
            old = tiers.get(h)
            if old is None:
                if p is not None and main == g:  # ghosts: the main groups' chains only
                    children[p] = children.get(p, 0) + 1
                tiers[h] = alone
            else:
                was = parents[h]
                if main == g and was != p:
                    if p is not None:
                        children[p] = children.get(p, 0) + 1
                    if was is not None and group.release(was):
                        group.drop(was)
                tiers[h] = _with_tier(old, tier)
            parents[h] = p
            start = (skipped + i) * size
            group.tokens[h] = array("q", tokens[start : start + size])
            group.origins[h] = origin
            if extra is not None and i < len(extra) and extra[i] is not None:
                group.extras[h] = extra[i]
            else:
                group.extras.pop(h, None)

    def _removed(self, ev: BlockRemoved) -> None:
        g = ev.group_idx
        groups = [self._groups[g]] if g in self._groups else []
        if g is None:
            groups = list(self._groups.values())
        name = None if ev.medium is None else tier_name(ev.medium)
        for h in ev.block_hashes:
            for group in groups:
                held = group.tiers.get(h)
                if not held:
                    continue
                left = tuple(
                    t._replace(copies=t.copies - 1) if name is None or t.name == name else t
                    for t in held
                )
                left = tuple(t for t in left if t.copies > 0)
                if left == held:
                    continue
                if left or group.children.get(h):
                    group.tiers[h] = left  # held elsewhere, or a ghost: a kept block's parent
                else:
                    group.drop(h)


def _with_tier(tiers: tuple[Tier, ...], tier: Tier) -> tuple[Tier, ...]:
    """``tiers`` holding one more copy in ``tier``."""
    for i, t in enumerate(tiers):
        if t.name == tier.name:
            return (*tiers[:i], t._replace(copies=t.copies + 1), *tiers[i + 1 :])
    return (*tiers, tier)
