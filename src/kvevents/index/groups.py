"""KV-cache groups of hybrid-attention models: one mask table per group, and the reuse rule.

A hybrid model (Gemma 3, gpt-oss, ...) keeps one KV cache per *KV-cache group*
(full-attention layers in one, sliding-window layers in another), and vLLM stores and
evicts each group's copy of a block separately (``group_idx``, ``kv_cache_spec_kind``,
``kv_cache_spec_sliding_window``) under the same hash in every group. A holder's first
full-attention group (or the only group of a model without group fields) is its *main*
group and lives in the index's own mask table; every other group lives in a
:class:`GroupTable` here, one per ``(kind, group_idx, window)``, shared by every holder
with that group. A side table is itself a :class:`~kvevents.index.mask_table.MaskTable`
with the same guarantees (no zero mask, recency order, its own ``max_entries`` bound); it
shares the main table's slot numbering and width and the index's engine-hash map.

Why a table per group, not group bits in one table: group bits would widen every mask, so
a full-attention model would pay for hybrid ones on every block of every match. Side
tables leave the main table, its match loop and its invariants untouched: a model with
only full attention has none, and pays one test of an empty mask per request.

The reuse rule is vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit``: each group
in turn, full attention first, shortens the candidate hit until none does. A
full-attention group hits the longest run of leading blocks it holds; a sliding window of
``W`` tokens with blocks of ``B`` needs only the last ``ceil((W - 1) / B)`` blocks before
the hit's end (a run reaching the first block is a hit however short).
:func:`reuse_length` applies that fixed point per holder and tier set, starting, as vLLM
does, from the capped length of :mod:`kvevents.index.reusable`. Kinds map to rules
through :data:`REUSE_RULES`; a side group's offload copy without a kind goes to the table
the holder has for its ``group_idx``; a holder with only sliding windows is matched by its
window alone. Not modelled: other group kinds (Mamba state, chunked local attention),
counted as ``unsupported_group`` and not indexed, and the alignment of a hit across
groups of different block sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from typing import Any

from kvevents.index.mask_table import MaskTable, Segments
from kvevents.index.types import PrefixMatch, Tier, iter_bits
from kvevents.types import Hash

__all__ = [
    "FULL_ATTENTION",
    "REUSE_RULES",
    "SLIDING_WINDOW",
    "GroupKey",
    "GroupTable",
    "GroupedMaskTable",
    "reuse_length",
    "window_blocks",
]

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"

REUSE_RULES: dict[str | None, str] = {
    None: FULL_ATTENTION,  # a model without group fields
    FULL_ATTENTION: FULL_ATTENTION,
    "mla_attention": FULL_ATTENTION,  # DeepSeek-style latent attention: vLLM's full manager
    "sink_full_attention": FULL_ATTENTION,  # full attention with sink tokens, the same rule
    SLIDING_WINDOW: SLIDING_WINDOW,
    "sliding_window_mla": SLIDING_WINDOW,
}
"""vLLM's ``kv_cache_spec_kind`` of a group -> the reuse rule the index applies to it
(the kinds vLLM serves with its full-attention or sliding-window manager); other kinds
are not modelled."""

GroupKey = tuple[str, int | None, int | None]
"""``(kind, group_idx, sliding_window)`` of a side group."""


def window_blocks(window: int, block_size: int) -> int:
    """Blocks a sliding-window group must hold before a hit's end: ``ceil((window - 1) / block_size)``."""
    return max(1, -(-(window - 1) // block_size))


class GroupTable(MaskTable):
    """One side group's blocks: a mask table sharing the main table's slots and width."""

    def __init__(self, key: GroupKey, *, width: int, slots: int, max_entries: int) -> None:
        super().__init__(block_size=None, max_entries=max_entries)
        self.key = key
        self._width = width
        self._held = [0] * slots
        self.window_blocks_by_size: dict[int, int] = {}

    @property
    def kind(self) -> str:
        return self.key[0]

    @property
    def label(self) -> str:
        """The group as a metrics label: ``sliding_window:0:64``, ``full_attention:2``."""
        kind, idx, window = self.key
        return f"{kind}:{idx}" if window is None else f"{kind}:{idx}:{window}"

    def need(self, block_size: int) -> int:
        """Blocks this group must hold before a hit's end (every block for full attention)."""
        window = self.key[2]
        if self.kind != SLIDING_WINDOW or window is None:
            return 0
        n = self.window_blocks_by_size.get(block_size)
        if n is None:
            n = self.window_blocks_by_size[block_size] = window_blocks(window, block_size)
        return n

    def ensure_slot(self, slot: int) -> None:
        while len(self._held) <= slot:
            self._held.append(0)

    def set_width(self, width: int) -> None:
        if width != self._width:
            self._set_width(width)


def _leading(table: GroupTable, keys: Sequence[int], bits: int, limit: int) -> int:
    blocks = table._blocks
    for i in range(limit):
        if not blocks.get(keys[i], 0) & bits:
            return i
    return limit


def _window_end(table: GroupTable, keys: Sequence[int], bits: int, limit: int, need: int) -> int:
    blocks = table._blocks
    run = 0
    for i in range(limit - 1, -1, -1):
        if blocks.get(keys[i], 0) & bits:
            run += 1
            if run >= need:
                return i + need
        else:
            run = 0
    return run


def reuse_length(
    tables: Sequence[GroupTable],
    keys: Sequence[int],
    slot: int,
    tiers: int,
    length: int,
    block_size: int,
) -> int:
    """The blocks a holder can reuse given its main-group prefix ``length`` (module docstring).

    ``tiers``: how many tiers count (1: GPU, 2: GPU or CPU, 3: any). O(blocks scanned).
    """
    w = tables[0]._width if tables else 64
    bits = 0
    for t in range(tiers):
        bits |= 1 << (slot + t * w)
    while length:
        candidate = length
        for table in tables:
            need = table.need(block_size)
            if need:
                candidate = _window_end(table, keys, bits, candidate, need)
            else:
                candidate = _leading(table, keys, bits, candidate)
            if not candidate:
                return 0
        if candidate == length:
            return length
        length = candidate
    return 0


class GroupedMaskTable(MaskTable):
    """The main mask table plus the side groups of hybrid holders (the index's base class).

    Adds to :class:`MaskTable` what keeps side groups consistent with it: one
    :class:`GroupTable` per side group, which groups each slot has, the ``_hybrid`` slot
    mask, and the main table's operations that must reach the side tables too (width,
    clearing a slot, the engine-hash map's garbage collection).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._groups: dict[GroupKey, GroupTable] = {}
        self._main_group: dict[int, int | None] = {}
        """Per slot, the ``group_idx`` of its main (first full-attention) group."""
        self._slot_sides: dict[int, dict[int | None, GroupTable]] = {}
        """Per slot with side groups: its side tables by the events' ``group_idx``."""
        self._slot_tables: dict[int, list[GroupTable]] = {}
        """The same tables, full attention first (the order :func:`reuse_length` checks)."""

    def set_max_entries(self, max_entries: int) -> None:
        """:meth:`MaskTable.set_max_entries` for the main table and every side table."""
        super().set_max_entries(max_entries)
        for table in self._groups.values():
            table.set_max_entries(max_entries)

    # --- side tables ------------------------------------------------------------------

    def _side_table(self, slot: int, key: GroupKey) -> GroupTable:
        """The slot's table for side group ``key`` (created on first use)."""
        table = self._groups.get(key)
        if table is None:
            table = GroupTable(
                key, width=self._width, slots=len(self._held), max_entries=self.max_entries
            )
            self._groups[key] = table
        table.ensure_slot(slot)
        sides = self._slot_sides.setdefault(slot, {})
        if sides.get(key[1]) is not table:
            sides[key[1]] = table
            self._slot_tables[slot] = sorted(sides.values(), key=lambda t: t.kind != FULL_ATTENTION)
            self._hybrid |= 1 << slot
        return table

    def _side_holds(self, key: int) -> bool:
        return any(key in t._blocks for t in self._groups.values())

    def _side_remove(
        self, slot: int, group_idx: int | None, hashes: Sequence[Hash], tier: Tier | None
    ) -> int:
        """Remove blocks by engine hash from a side group; returns how many it did not hold."""
        table = self._slot_sides.get(slot, {}).get(group_idx)
        if table is None:
            return len(hashes)
        keys = self._keys_of(slot, hashes)
        held = table._remove_many(slot, keys, tier)
        for h, k in compress(zip(hashes, keys, strict=True), held):
            self._unmap_hash(slot, h, k)  # type: ignore[arg-type]
        return held.count(False)

    def _key_held(self, key: int) -> bool:
        return key in self._blocks or (bool(self._groups) and self._side_holds(key))

    def _slot_holds(self, key: int, slot: int) -> bool:
        return self._held_any(key, slot) or any(
            t._held_any(key, slot) for t in self._slot_tables.get(slot, ())
        )

    def _clear_sides(self, slot: int) -> None:
        for table in self._slot_tables.get(slot, ()):
            table._clear_slot(slot)

    def _drop_sides(self, slot: int) -> None:
        """Forget a slot's group layout (its holder is unregistered)."""
        self._clear_sides(slot)
        self._main_group.pop(slot, None)
        self._slot_sides.pop(slot, None)
        self._slot_tables.pop(slot, None)
        self._hybrid &= ~(1 << slot)

    def group_entries(self) -> dict[str, int]:
        """(block, holder, tier) entries per side group, by :attr:`GroupTable.label`."""
        return {t.label: t._entries for t in self._groups.values()}

    def group_counters(self) -> list[tuple[str, int, int, int, int]]:
        """Per group ``(label, entries, blocks, stored_blocks, removed_blocks)``, ``main`` first.

        ``main`` is every holder's main group (the index's own table); the others are
        the side groups by :attr:`GroupTable.label`.
        """
        main = self.stats
        rows = [("main", self._entries, len(self._blocks), main.stored_blocks, main.removed_blocks)]
        for t in self._groups.values():
            rows.append(
                (t.label, t._entries, len(t._blocks), t.stats.stored_blocks, t.stats.removed_blocks)
            )
        return rows

    # --- main-table operations that must reach the side tables ------------------------

    def _set_width(self, width: int) -> None:
        super()._set_width(width)
        for table in getattr(self, "_groups", {}).values():
            table.set_width(width)

    def _maybe_gc_hashes(self) -> None:
        if not self._groups:
            super()._maybe_gc_hashes()
            return
        if len(self._hashes) > 2 * len(self._blocks) + 4096 or not self._blocks:
            blocks = self._blocks
            sides = [t._blocks for t in self._groups.values()]
            self._hashes = {
                h: k for h, k in self._hashes.items() if k in blocks or any(k in s for s in sides)
            }
            self._slot_keys = {
                sh: k
                for sh, k in self._slot_keys.items()
                if k in blocks or any(k in s for s in sides)
            }

    # --- matching ---------------------------------------------------------------------

    def _apply_groups(self, keys: Sequence[int], segments: Segments) -> PrefixMatch:
        """Shorten each hybrid holder's lengths to what its groups can reuse (module docstring)."""
        hybrid = self._hybrid
        tables = self._slot_tables
        sizes = self._slot_block_size
        default = self.block_size or 1
        out: list[list[tuple[int, int]]] = []
        for tier, segs in enumerate(segments):
            new: list[tuple[int, int]] = []
            for mask, length in segs:
                mine = mask & hybrid
                if not mine:
                    new.append((mask, length))
                    continue
                if mask ^ mine:
                    new.append((mask ^ mine, length))
                for slot in iter_bits(mine):
                    size = sizes[slot] or default
                    n = reuse_length(tables.get(slot, ()), keys, slot, tier + 1, length, size)
                    if n:
                        new.append((1 << slot, n))
            out.append(new)
        main = self._main_group
        for slot in iter_bits(hybrid):
            if slot in main:
                continue
            # no full-attention group (every layer a sliding window): its window alone
            # decides, over the whole request
            size = sizes[slot] or default
            for tier in range(3):
                n = reuse_length(tables.get(slot, ()), keys, slot, tier + 1, len(keys), size)
                if n:
                    out[tier].append((1 << slot, n))
        return PrefixMatch(self._holders, (out[0], out[1], out[2]), len(keys), self.block_size)
