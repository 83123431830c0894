"""PrefixIndex: which holder caches the longest prefix of a request, per tier.

A *holder* is one independent KV cache, ``Holder(worker, dp_rank)``. The index mirrors
what every holder caches, fed by its event stream (:meth:`PrefixIndex.apply`), and
answers :meth:`PrefixIndex.match`: for each holder, the exact number of leading blocks
of a request it holds, per tier (see :mod:`kvevents.index.types`).

Blocks are keyed by our own chained content key (:func:`kvevents.wire.hashing.content_keys`)
computed from the event's ``token_ids``, so requests are keyed the same way without
sharing any hash seed with an engine. A map from engine hash to content key resolves
``BlockRemoved`` (hashes only), tier copies (empty tokens) and parents; it assumes an
engine hash names the same content for every holder (true of SGLang's and vLLM's
SHA-256 hashes). A LoRA adapter or a cache salt starts the chain from its own root key
(:func:`namespace_key`), since engines never share blocks across them. The storage, its
invariants and why it is not a radix tree: :mod:`kvevents.index.mask_table`.

Complexity: ``match`` is O(blocks), one dict lookup and one AND per block, independent
of the number of holders; ``store`` and ``remove`` O(blocks); ``clear_holder``
O(distinct blocks), a scan, because flushes are rare and a per-holder key set would cost
memory on every (block, holder) entry. ``benchmarks/index.py`` measures memory per entry.
This module is the index's whole public API on one class; the storage mechanics live in
the base class.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import compress, repeat
from operator import or_
from typing import Any, cast

import msgspec
import xxhash

from kvevents.index.extra_keys import keys_with_extras, split_extra_keys
from kvevents.index.groups import (
    FULL_ATTENTION,
    REUSE_RULES,
    SLIDING_WINDOW,
    GroupedMaskTable,
    GroupTable,
)
from kvevents.index.mask_table import MaskTable
from kvevents.index.predictions import DEFAULT_PREDICTION_TTL_S, Predictions
from kvevents.index.reusable import reusable_blocks
from kvevents.index.snapshot import (
    SNAPSHOT_VERSION,
    GroupSnapshot,
    IndexSnapshot,
    MaskColumns,
    decode_snapshot,
    encode_snapshot,
)
from kvevents.index.types import (
    DEFAULT_CREDITS,
    HolderMatch,
    PrefixMatch,
    Tier,
    TierCredits,
    iter_bits,
    normalize_medium,
)
from kvevents.types import Hash, Holder
from kvevents.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.wire.hashing import ROOT_KEY, content_key_array, content_keys

__all__ = ["DEFAULT_MAX_ENTRIES", "PrefixIndex", "namespace_key"]

_SYNC_AFTER = 256
"""A batch that changed this many blocks brings the native match's mirror up to date
at once (``MaskMirror``, :mod:`kvevents.kernels`), so the next match does not pay for it."""

DEFAULT_MAX_ENTRIES = 16_000_000
"""Default memory bound: (block, holder, tier) entries (``benchmarks/index.py`` measures
the bytes an entry costs)."""

_xxh3 = xxhash.xxh3_64_intdigest


def namespace_key(lora: str | int | None = None, cache_salt: str | None = None) -> int:
    """Root key of chains stored under a LoRA adapter and/or a cache salt.

    ``ROOT_KEY`` when both are None, so plain prompts need no namespace. An empty salt
    is no salt, as vLLM hashes it (it adds the salt only when it is non-empty).
    """
    if not cache_salt:
        cache_salt = None
    if lora is None and cache_salt is None:
        return ROOT_KEY
    return int(_xxh3(f"kvevents-ns\x00{lora!r}\x00{cache_salt!r}".encode()))


def _orphan_key(parent: Hash) -> int:
    """A root for a chain whose parent hash is unknown: reachable by no request."""
    raw = parent if isinstance(parent, bytes) else (parent % (1 << 64)).to_bytes(8, "big")
    return int(_xxh3(b"kvevents-orphan\x00" + raw))


class PrefixIndex(GroupedMaskTable):
    """Which holder caches which blocks, in which tier; longest-prefix match for requests.

    See the module docstring for the complexity, and :mod:`kvevents.index.mask_table`
    for the structure and its invariants.

    ``block_size``: tokens per block for :meth:`match` on tokens and the advertised size
    events are checked against (learned from the first stored chain when None).
    ``max_entries``: the memory bound in (block, holder, tier) entries.
    ``credits``: per-tier worth of a cached block, used by the router's scoring.
    """

    def __init__(
        self,
        *,
        block_size: int | None = None,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        credits: TierCredits = DEFAULT_CREDITS,
        prediction_ttl_s: float = DEFAULT_PREDICTION_TTL_S,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if block_size is not None and block_size <= 0:
            raise ValueError(f"PrefixIndex: block_size={block_size} must be a positive int")
        if max_entries <= 0:
            raise ValueError(f"PrefixIndex: max_entries={max_entries} must be a positive int")
        predictions = (
            Predictions(ttl_s=prediction_ttl_s)
            if clock is None
            else Predictions(ttl_s=prediction_ttl_s, clock=clock)
        )
        super().__init__(block_size=block_size, max_entries=max_entries, predictions=predictions)
        self.credits = credits
        self._slots: dict[Holder, int] = {}
        self._holder_list: list[Holder] | None = None
        """:meth:`holders`, kept until a holder is added or removed."""
        self.applied_seqs: dict[Holder, int] = {}
        """Per holder, the seq of the last batch whose effect the index holds; kept by the
        caller that applies batches (the router), carried by the snapshot, dropped with the
        holder."""

    # --- holders --------------------------------------------------------------------

    def add_holder(self, holder: Holder, *, block_size: int | None = None) -> int:
        """Register a holder (idempotent) and its advertised block size; returns its slot."""
        holder = Holder(*holder)
        slot = self._slots.get(holder)
        if slot is None:
            if self._free:
                slot = self._free.pop()
                self._holders[slot] = holder
                self._slot_block_size[slot] = None
                self._held[slot] = 0
            else:
                slot = len(self._holders)
                self._holders.append(holder)
                self._slot_block_size.append(None)
                self._held.append(0)
                if slot >= self._width:
                    self._set_width(self._width + 64)
            self._slots[holder] = slot
            self._live |= 1 << slot
            self._holder_list = None
        if block_size is not None:
            if block_size <= 0:
                raise ValueError(
                    f"PrefixIndex.add_holder: block_size={block_size} for {holder} "
                    "must be a positive int"
                )
            self._slot_block_size[slot] = block_size
            if self.block_size is None:
                self.block_size = block_size
        return slot

    def holders(self) -> list[Holder]:
        """Registered holders, in slot order.

        The same list until a holder is added or removed (then a new one): do not change
        it. A caller may keep it and compare by identity to learn that nothing changed.
        """
        found = self._holder_list
        if found is None:
            found = self._holder_list = [h for h in self._holders if h is not None]
        return found

    def slot_of(self, holder: Holder) -> int | None:
        return self._slots.get(holder)

    def holder_size(self, holder: Holder) -> int:
        """(block, tier) entries the holder has in the index."""
        slot = self._slots.get(holder)
        return 0 if slot is None else self._held[slot]

    def clear_holder(self, holder: Holder, *, predictions: bool = True) -> int:
        """Forget every block of a holder (AllBlocksCleared, a reset, a loss); returns entries dropped.

        ``predictions=False`` keeps the holder's predicted entries: a loss says events
        were missed, not that the requests just sent there will store nothing. The
        holder stays registered. O(distinct blocks).
        """
        slot = self._slots.get(holder)
        if slot is None:
            return 0
        dropped = self._clear_slot(slot, predictions=predictions)
        if self._hybrid:
            self._clear_sides(slot)
        self.stats.cleared += 1
        self._maybe_gc_hashes()
        return dropped

    def remove_holder(self, holder: Holder) -> int:
        """Clear a holder and unregister it (its slot is reused); returns entries dropped."""
        slot = self._slots.get(holder)
        if slot is None:
            return 0
        dropped = self.clear_holder(holder)
        self.stats.cleared -= 1  # a removal is not a clear event
        self.applied_seqs.pop(holder, None)
        self._drop_sides(slot)
        del self._slots[holder]
        self._holders[slot] = None
        self._holder_list = None
        self._live &= ~(1 << slot)
        self._free.append(slot)
        return dropped

    # --- events ---------------------------------------------------------------------

    def apply(self, holder: Holder, batch: KVEventBatch) -> None:
        """Apply one batch of a holder's stream, event by event, in order."""
        for _ in self.apply_steps(holder, batch, 0):
            pass

    def apply_steps(self, holder: Holder, batch: KVEventBatch, step: int) -> Iterator[None]:
        """:meth:`apply`, pausing (a ``yield``) after each ``step`` blocks of a long
        chain stored or removed (side groups of hybrid models: between events once
        ``step`` blocks are in); ``step`` 0 never pauses.

        A router applies a batch of thousands of blocks this way so that its event loop
        answers requests in between: at each pause the index holds a valid state, the
        batch's earlier events and part of the current one (a stored chain's later
        blocks come first, as one store ranks them: parents most recent; removals in
        order). The result is exactly :meth:`apply`'s. Do not apply anything else to
        this index until the generator is exhausted.
        """
        slot = self._slots.get(holder)
        if slot is None:
            slot = self.add_holder(holder)
        later: list[BlockStored | BlockRemoved] = []
        main = self._main_group
        for event in batch.events:
            kind = type(event)
            if kind is BlockStored:
                # Side groups (hybrid models) wait until the main group's events of the
                # batch are applied: their stores resolve keys through its hashes.
                g = event.group_idx  # type: ignore[union-attr]
                spec = event.kv_cache_spec_kind  # type: ignore[union-attr]
                if spec is not None:
                    side = REUSE_RULES.get(spec) != FULL_ATTENTION or (
                        g is not None and main.setdefault(slot, g) != g
                    )
                elif g is None or slot in main:
                    side = g is not None and main[slot] != g
                else:
                    # a store without a kind (vLLM's offloading connector copies a side
                    # group's blocks so) never makes its group the main one: it goes to
                    # the side table of its group if the holder has one
                    side = g in self._slot_sides.get(slot, ())
                if side:
                    later.append(event)  # type: ignore[arg-type]
                else:
                    yield from self._apply_stored(slot, event, step)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                g = event.group_idx  # type: ignore[union-attr]
                if g is not None and (
                    main.get(slot, g) != g
                    # no main group yet: a group it has a side table for (sliding only)
                    or (slot not in main and g in self._slot_sides.get(slot, ()))
                ):
                    later.append(event)  # type: ignore[arg-type]
                else:
                    yield from self._apply_removed(slot, event, step)  # type: ignore[arg-type]
            elif kind is AllBlocksCleared:
                if later:
                    yield from self._apply_side_events(slot, later, step)
                    later = []
                self.clear_holder(self._holders[slot])  # type: ignore[arg-type]
                self.stats.count_event("AllBlocksCleared", "ok")
        if later:
            yield from self._apply_side_events(slot, later, step)
        changed = self._changed
        if self._mirror is not None and changed is not None and len(changed) >= _SYNC_AFTER:
            self._synced_mirror()  # now, not on the next request's path

    def _apply_side_events(
        self, slot: int, events: list[BlockStored | BlockRemoved], step: int
    ) -> Iterator[None]:
        """The side groups' events of a batch, in order, pausing between two events once
        ``step`` blocks (0: never) have been applied since the last pause. An event is
        applied in one piece: at each pause the side groups hold whole events, as between
        two batches (a hybrid request's match is shortened by what they lack)."""
        done = 0
        for event in events:
            if step and done >= step:
                yield
                done = 0
            if isinstance(event, BlockStored):
                self._apply_side_stored(slot, event)
            else:
                self._apply_side_removed(slot, event)
            done += len(event.block_hashes)

    def _apply_stored(self, slot: int, ev: BlockStored, step: int) -> Iterator[None]:
        stats = self.stats
        outcome = "ok"
        tier, known = normalize_medium(ev.medium)
        if not known:
            stats.unknown_medium += 1
            outcome = "unknown_medium"
        hashes = ev.block_hashes
        tokens = ev.token_ids
        if tokens and tier is not Tier.GPU and ev.group_idx is not None:
            copied = self._copied_keys(slot, hashes)
            if copied is not None:
                self._store(slot, copied, tier, None)
                stats.count_event("BlockStored", outcome)
                return
        if not tokens:
            # A copy into another tier of blocks already known by engine hash.
            keys = []
            for k in self._keys_of(slot, hashes):
                if k is None:
                    stats.unknown_hash += 1
                    outcome = "unknown_hash"
                    continue
                keys.append(k)
            self._store(slot, keys, tier, None)
            stats.count_event("BlockStored", outcome)
            return
        n = len(hashes)
        size = ev.block_size
        if n == 0 or size <= 0 or len(tokens) != n * size:
            stats.malformed += 1
            stats.count_event("BlockStored", "malformed")
            return
        advertised = self._slot_block_size[slot] or self.block_size
        if advertised is None:
            self.block_size = size
        elif size != advertised:
            stats.block_size_mismatch += 1
            outcome = "block_size_mismatch"
        parent = ev.parent_block_hash
        extra = ev.extra_keys
        if extra is not None and extra.count(None) != len(extra):
            self._apply_stored_extra(slot, ev, tier, outcome)
            return
        if parent is None:
            lora = ev.lora_name if ev.lora_name is not None else ev.lora_id
            parent_key = namespace_key(lora, ev.cache_salt)
        else:
            pk = self._key_of(slot, parent)
            if pk is None or not self._held_any(pk, slot):
                stats.unknown_parent += 1
                outcome = "unknown_parent"
            parent_key = pk if pk is not None else _orphan_key(parent)
        try:
            keys = content_keys(tokens, size, parent_key)
        except (OverflowError, TypeError):
            stats.malformed += 1
            stats.count_event("BlockStored", "malformed")
            return
        if 0 < step < n:
            # the last piece first: the blocks end in the order one store leaves them
            for end in range(n, 0, -step):
                start = max(0, end - step)
                self._store(slot, keys[start:end], tier, hashes[start:end], settle=not start)
                if start:
                    yield
        else:
            self._store(slot, keys, tier, hashes)
        stats.count_event("BlockStored", outcome)

    def _copied_keys(self, slot: int, hashes: Sequence[Hash]) -> list[int] | None:
        """The keys of a store into another tier whose every hash names a block the
        holder already has (a copy, keyed as the blocks it copies), else None.

        vLLM's offloading connector reports its CPU copies with their tokens but without
        their extra keys (salt, adapter, images): keyed from the tokens they would land
        in the plain namespace and take the engine hashes with them. Only for vLLM's
        events (they name a ``group_idx``): its hashes cover the extra keys, so a known
        hash names the very block; SGLang's cover tokens alone, and its events carry
        their namespace, so the same tokens plain are another block under the same hash.
        """
        keys = []
        for k in self._keys_of(slot, hashes):
            if k is None or not self._held_any(k, slot):
                return None
            keys.append(k)
        return keys

    def _removal_tier(self, ev: BlockRemoved) -> tuple[Tier | None, str]:
        """The tier a removal names (None: every tier) and its outcome so far."""
        if ev.medium is None:
            return None, "ok"
        tier, known = normalize_medium(ev.medium)
        if known:
            return tier, "ok"
        self.stats.unknown_medium += 1
        return tier, "unknown_medium"

    def _apply_removed(self, slot: int, ev: BlockRemoved, step: int) -> Iterator[None]:
        stats = self.stats
        tier, outcome = self._removal_tier(ev)
        removed = ev.block_hashes
        piece = step if 0 < step < len(removed) else max(1, len(removed))
        for start in range(0, len(removed), piece):
            if start:
                yield
            some = removed[start : start + piece]
            keys = self._keys_of(slot, some)
            held = self._remove_many(slot, keys, tier)
            missed = held.count(False)
            if missed:
                stats.unknown_hash += missed
                outcome = "unknown_hash"
            blocks, own = self._blocks, self._slot_keys
            for h, k in compress(zip(some, keys, strict=True), held):
                if own:
                    self._unmap_hash(slot, h, k)  # type: ignore[arg-type]
                elif k not in blocks and not (self._groups and self._side_holds(k)):  # type: ignore[arg-type]
                    # its key came from the shared map (one event may name a hash twice)
                    self._hashes.pop(h, None)
        stats.count_event("BlockRemoved", outcome)

    # --- events with extra keys, and side KV-cache groups (kvevents.index.groups) --------

    def _chain_root(
        self, slot: int, ev: BlockStored, salt: str | None, check_held: bool
    ) -> tuple[int, bool]:
        """The key a stored chain hangs from, and whether its parent was known."""
        parent = ev.parent_block_hash
        if parent is None:
            lora = ev.lora_name if ev.lora_name is not None else ev.lora_id
            return namespace_key(lora, ev.cache_salt or salt), True
        pk = self._key_of(slot, parent)
        if pk is None:
            return _orphan_key(parent), False
        return pk, not check_held or self._held_any(pk, slot)

    def _extra_chain(
        self, slot: int, ev: BlockStored, skipped: int, check_held: bool
    ) -> tuple[list[int], bool]:
        """Content keys of a stored chain whose first ``skipped`` blocks carry no hash.

        Raises OverflowError / TypeError for token ids or extra keys that cannot be keyed.
        """
        lora = ev.lora_name if ev.lora_name is not None else ev.lora_id
        first = ev.parent_block_hash is None and skipped == 0
        salt, per_block = split_extra_keys(ev.extra_keys, lora=lora, first_block=first)
        root, parent_ok = self._chain_root(slot, ev, salt, check_held)
        if per_block is None:
            keys = content_keys(ev.token_ids, ev.block_size, root)
        else:
            keys = keys_with_extras(ev.token_ids, ev.block_size, root, [None] * skipped + per_block)
        return keys[skipped:], parent_ok

    def _apply_stored_extra(self, slot: int, ev: BlockStored, tier: Tier, outcome: str) -> None:
        """A main-group chain with extra keys (salt, adapter, images), already validated."""
        stats = self.stats
        try:
            keys, parent_ok = self._extra_chain(slot, ev, 0, True)
        except (OverflowError, TypeError, ValueError):
            stats.malformed += 1
            stats.count_event("BlockStored", "malformed")
            return
        if not parent_ok:
            stats.unknown_parent += 1
            outcome = "unknown_parent"
        self._store(slot, keys, tier, ev.block_hashes)
        stats.count_event("BlockStored", outcome)

    def _apply_side_stored(self, slot: int, ev: BlockStored) -> None:
        """A chain of a side group: a second full-attention group, or a sliding window.

        A sliding-window chain carries the tokens of every block it covers but hashes only
        for the blocks vLLM caches in that group: its block pool skips null blocks (those
        that left the window) and those the window's mask leaves out (no hit could use
        them, a block-aligned prompt's recomputed last block among them). So a store may
        name fewer blocks than its tokens cover, or none at all: a valid store of nothing
        new in that group (counted ``ok``). Where the named blocks sit in the chain is not
        on the wire: their keys come from the main group's stores of the same hashes (one
        hash names one block in every group, and those stores also saw the salt on the
        sequence's first block); only hashes never seen are keyed from the tokens, taken
        as the chain's last blocks.
        """
        stats = self.stats
        spec = ev.kv_cache_spec_kind
        sides = self._slot_sides.get(slot) if spec is None else None
        known = sides.get(ev.group_idx) if sides else None
        kind: str | None
        if known is not None:  # an offload copy naming only its group (vLLM's connector)
            kind, window = known.kind, known.key[2]
        else:
            kind, window = REUSE_RULES.get(spec), ev.kv_cache_spec_sliding_window
        if kind is None:
            stats.unsupported_group += 1
            stats.count_event("BlockStored", "unsupported_group")
            return
        tier, known_medium = normalize_medium(ev.medium)
        outcome = "ok" if known_medium else "unknown_medium"
        if not known_medium:
            stats.unknown_medium += 1
        hashes = ev.block_hashes
        size = ev.block_size
        n = len(hashes)
        table: GroupTable
        if not ev.token_ids:
            keys = []
            for k in self._keys_of(slot, hashes):
                if k is None:
                    stats.unknown_hash += 1
                    outcome = "unknown_hash"
                else:
                    keys.append(k)
            table = self._side_table(slot, (kind, ev.group_idx, window))
            table._store(slot, keys, tier, None)
            stats.count_event("BlockStored", outcome)
            return
        m = len(ev.token_ids) // size if size > 0 else 0
        # a sliding window must say how wide it is, and may name no block
        bad = (
            (window is None or window <= 0 or m < n) if kind == SLIDING_WINDOW else n == 0 or m != n
        )
        if bad or m == 0 or m * size != len(ev.token_ids):
            stats.malformed += 1
            stats.count_event("BlockStored", "malformed")
            return
        advertised = self._slot_block_size[slot] or self.block_size
        if advertised is None:
            self.block_size = size
        elif size != advertised:
            stats.block_size_mismatch += 1
            outcome = "block_size_mismatch"
        if not n:  # every block skipped in this group: its tokens store nothing here
            self._side_table(slot, (kind, ev.group_idx, window))
            stats.count_event("BlockStored", outcome)
            return
        keys = self._keys_of(slot, hashes)  # type: ignore[assignment]
        if None in keys:
            try:
                keys, parent_ok = self._extra_chain(slot, ev, m - n, kind == FULL_ATTENTION)
            except (OverflowError, TypeError, ValueError):
                stats.malformed += 1
                stats.count_event("BlockStored", "malformed")
                return
            if not parent_ok:
                stats.unknown_parent += 1
                outcome = "unknown_parent"
            self._map_hashes(slot, hashes, keys)
        table = self._side_table(slot, (kind, ev.group_idx, window))
        table._store(slot, keys, tier, None)
        stats.count_event("BlockStored", outcome)

    def _apply_side_removed(self, slot: int, ev: BlockRemoved) -> None:
        stats = self.stats
        tier, outcome = self._removal_tier(ev)
        missed = self._side_remove(slot, ev.group_idx, ev.block_hashes, tier)
        if missed:
            stats.unknown_hash += missed
            outcome = "unknown_hash"
        stats.count_event("BlockRemoved", outcome)

    # --- lower-level API: precomputed content keys -------------------------------------

    def store_keys(
        self,
        holder: Holder,
        keys: Sequence[int],
        *,
        tier: Tier = Tier.GPU,
        hashes: Sequence[Hash] | None = None,
    ) -> None:
        """Record that ``holder`` stores blocks ``keys`` (a chain, parents first) in ``tier``.

        ``hashes``, when given, are the engines' hashes of the same blocks, so later
        removals by hash resolve. O(len(keys)).
        """
        if hashes is not None and len(hashes) != len(keys):
            raise ValueError(
                f"PrefixIndex.store_keys: {len(hashes)} hashes for {len(keys)} keys; "
                "give one engine hash per block, or none"
            )
        slot = self._slots.get(holder)
        if slot is None:
            slot = self.add_holder(holder)
        self._store(slot, keys, Tier(tier), hashes)

    def remove_keys(self, holder: Holder, keys: Iterable[int], *, tier: Tier | None = None) -> int:
        """Remove blocks from a holder (one tier, or every tier when None); returns how many were held."""
        slot = self._slots.get(holder)
        if slot is None:
            return 0
        return self._remove_many(slot, keys, tier).count(True)

    # --- matching -------------------------------------------------------------------

    def keys_for(
        self,
        token_ids: Sequence[int],
        *,
        lora: str | int | None = None,
        cache_salt: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> list[int]:
        """Content keys of a request's full blocks, as :meth:`match` computes them
        (:meth:`request_keys` as a list)."""
        keys = self.request_keys(token_ids, lora=lora, cache_salt=cache_salt, extra_keys=extra_keys)
        if isinstance(keys, array):
            return keys.tolist()
        return keys if isinstance(keys, list) else list(keys)

    def request_keys(
        self,
        token_ids: Sequence[int],
        *,
        lora: str | int | None = None,
        cache_salt: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> Sequence[int]:
        """Content keys of a request's full blocks, as :meth:`match_keys` reads them best:
        an ``array("Q")`` when the native core keys them, else a list
        (:func:`~kvevents.wire.hashing.content_key_array`).

        ``extra_keys``: per block, nil or a list of the keys an engine adds to the block's
        hash (vLLM's ``BlockStored.extra_keys`` shape, :mod:`kvevents.index.extra_keys`):
        image identifiers with offsets, and optionally the adapter name and, on the first
        block, the salt. ValueError when a salt there contradicts ``cache_salt``.
        """
        if self.block_size is None:
            raise ValueError(
                "PrefixIndex: block_size is not known yet; pass block_size= or register "
                "a holder with its advertised block size before matching tokens"
            )
        cache_salt = cache_salt or None  # an empty salt is no salt (namespace_key)
        if not extra_keys:
            return content_key_array(token_ids, self.block_size, namespace_key(lora, cache_salt))
        salt, per_block = split_extra_keys(extra_keys, lora=lora, first_block=True)
        if salt is not None and cache_salt is not None and salt != cache_salt:
            raise ValueError(
                f"extra_keys name the salt {salt!r} on the first block but cache_salt is "
                f"{cache_salt!r}; give the salt once"
            )
        root = namespace_key(lora, cache_salt if cache_salt is not None else salt)
        if per_block is None:
            return content_key_array(token_ids, self.block_size, root)
        try:
            return keys_with_extras(token_ids, self.block_size, root, per_block)
        except TypeError as exc:
            raise ValueError(f"extra_keys cannot be keyed: {exc}") from None

    def match(
        self,
        token_ids: Sequence[int],
        *,
        lora: str | int | None = None,
        cache_salt: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> PrefixMatch:
        """Every holder's longest cached prefix of a request given as token ids.

        At most the blocks an engine reuses of it count: a block-aligned prompt's last
        block is recomputed (:mod:`kvevents.index.reusable`).
        """
        keys = self.request_keys(token_ids, lora=lora, cache_salt=cache_salt, extra_keys=extra_keys)
        size = cast(int, self.block_size)  # known: request_keys raised otherwise
        return self.match_keys(keys, reusable=reusable_blocks(len(token_ids), size))

    # --- predictions (kvevents.index.predictions) ------------------------------------

    def predict(self, holder: Holder, keys: Sequence[int]) -> tuple[list[int], float]:
        """Predict that ``holder`` will store blocks ``keys`` soon.

        Blocks the holder already holds (any tier) are skipped. The memory bound counts
        predictions: the oldest ones make room, and what still does not fit is not
        predicted (the request's leading blocks first). Returns the keys newly predicted
        and their deadline, for :meth:`withdraw`. O(len(keys)).
        """
        slot = self._slots.get(holder)
        if slot is None:
            return [], 0.0
        pred = self.predictions
        pred.expire()
        new = self._not_held(keys, slot)
        room = self.max_entries - self._entries - pred.count
        if len(new) > room:
            pred.shrink(len(new) - room)
            room = self.max_entries - self._entries - pred.count
        return pred.add(slot, new, max(0, room))

    def withdraw(self, holder: Holder, keys: Sequence[int], deadline: float) -> int:
        """Take back what :meth:`predict` returned (its request failed); returns entries dropped."""
        slot = self._slots.get(holder)
        return 0 if slot is None else self.predictions.withdraw(slot, keys, deadline)

    def predicted(self, keys: Sequence[int], confirmed: PrefixMatch) -> dict[Holder, int]:
        """Per holder, the blocks predictions add to its ``confirmed`` prefix of ``keys``.

        A holder's prefix with predictions is the longest run of leading blocks each held
        in some tier *or* predicted; the answer is that length minus the confirmed one,
        for holders where it is positive. Only the blocks ``confirmed`` looked at count
        (a match capped at what an engine reuses, ``match_keys(..., reusable=)``, does not
        count a recomputed last block as predicted). Expires predictions first; ``{}`` at
        once when there are none. O(blocks matched).
        """
        if not self._predicted or not keys:
            return {}
        if len(keys) > confirmed.n_blocks:
            keys = keys[: confirmed.n_blocks]
        self.predictions.expire()
        if not self._predicted:
            return {}
        pget = self._predicted.get
        bget = self._blocks.get
        if self._offloaded:  # a block held in any tier counts: fold the tiers' bits
            w = self._width
            low = (1 << w) - 1
            masks: Iterable[int] = (
                ((v | v >> w | v >> 2 * w) & low) | pget(k, 0)
                for k, v in ((k, bget(k, 0)) for k in keys)
            )
        else:  # GPU bits only: held or predicted is one OR, in C
            masks = map(or_, map(bget, keys, repeat(0)), map(pget, keys, repeat(0)))
        segs, _ = self._segments(masks, len(keys))
        out: dict[Holder, int] = {}
        holders = self._holders
        hybrid = self._hybrid
        for mask, length in segs:
            for slot in iter_bits(mask):
                holder = holders[slot]
                if hybrid >> slot & 1 and slot in self._main_group:
                    # its confirmed length is shortened by its side groups, which hold no
                    # predictions: only what predictions add past its main group counts
                    extra = length - self._held_run(keys, slot, length)
                else:
                    extra = length - confirmed._cumulative(2, slot)
                if holder is not None and extra > 0:
                    out[holder] = extra
        return out

    def _held_run(self, keys: Sequence[int], slot: int, limit: int) -> int:
        """How many leading ``keys`` (at most ``limit``) ``slot`` holds in some tier."""
        held = self._held_any
        for i in range(limit):
            if not held(keys[i], slot):
                return i
        return limit

    def holder_match(self, result: PrefixMatch, holder: Holder) -> HolderMatch:
        """One holder's lengths from a match result (zeros for an unknown holder)."""
        slot = self._slots.get(holder)
        return HolderMatch(0, 0, 0) if slot is None else result.for_slot(slot)

    # --- inspection -----------------------------------------------------------------

    def __len__(self) -> int:
        """(block, holder, tier) entries."""
        return self._entries

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held by at least one holder."""
        return len(self._blocks)

    def holder_keys(self, holder: Holder, tier: Tier | None = None) -> set[int]:
        """Content keys a holder holds in ``tier`` (any tier when None). O(distinct blocks)."""
        slot = self._slots.get(holder)
        if slot is None:
            return set()
        mask = self._tier_mask(slot, tier)
        return {k for k, v in self._blocks.items() if v & mask}

    def held_by_group(self, holder: Holder, keys: Sequence[int]) -> dict[str, list[bool]]:
        """Per KV-cache group of the holder (``main`` first), which of ``keys`` it holds in any tier.

        For inspection and tests: a hybrid holder's groups may hold different blocks of
        one prefix (:mod:`kvevents.index.groups`). O(blocks x groups).
        """
        slot = self._slots.get(holder)
        if slot is None:
            return {}
        out = {"main": [self._held_any(k, slot) for k in keys]}
        for table in self._slot_tables.get(slot, ()):
            out[table.label] = [table._held_any(k, slot) for k in keys]
        return out

    def holder_hashes(self, holder: Holder, tier: Tier | None = Tier.GPU) -> set[Hash]:
        """Engine hashes of the blocks a holder holds in ``tier`` (GPU by default).

        This is what an engine reports as its cached blocks (``/kv_blocks``).
        O(engine hashes known).
        """
        slot = self._slots.get(holder)
        if slot is None:
            return set()
        mask = self._tier_mask(slot, tier)
        get = self._blocks.get
        own = self._slot_keys
        found = {h for h, k in self._hashes.items() if get(k, 0) & mask and (slot, h) not in own}
        found.update(h for (s, h), k in own.items() if s == slot and get(k, 0) & mask)
        return found

    # --- snapshot -------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The whole index as bytes (msgpack); see :mod:`kvevents.index.snapshot`.

        O(blocks + hashes), in C-level passes (no Python loop per block).
        """
        return self.freeze()()

    def freeze(self) -> Callable[[], bytes]:
        """Copy the index's state now; the function returned encodes that copy.

        The copy is a few C-level dict copies (milliseconds at a few hundred thousand
        blocks); the encoding, the longer part, touches only the copy, so it may run on
        another thread while this index goes on changing (the router's ``/dump``).
        """
        self._flush_touches()
        blocks = self._blocks.copy()
        hashes = self._hashes.copy()
        snap = IndexSnapshot(
            version=SNAPSHOT_VERSION,
            block_size=self.block_size,
            max_entries=self.max_entries,
            credits=self.credits.as_tuple(),
            width=self._width,
            holders=[None if h is None else (h.worker, h.dp_rank) for h in self._holders],
            slot_block_size=list(self._slot_block_size),
            blocks=MaskColumns([], [], []),
            hashes=[],
            hash_keys=[],
            refs=[(k, s, t, n) for (k, s, t), n in self._refs.items()],
            stats=msgspec.structs.replace(self.stats, events=dict(self.stats.events)),
            seqs=[(h.worker, h.dp_rank, seq) for h, seq in self.applied_seqs.items()],
            groups=[],
            main_groups=list(self._main_group.items()),
            slot_groups=[],
            slot_keys=[(s, h, k) for (s, h), k in self._slot_keys.items()],
        )
        sides: list[tuple[GroupSnapshot, dict[int, int]]] = []
        if self._groups:
            tables = list(self._groups.values())
            number = {id(t): i for i, t in enumerate(tables)}
            for t in tables:
                t._flush_touches()
                group = GroupSnapshot(
                    kind=t.key[0],
                    group_idx=t.key[1],
                    sliding_window=t.key[2],
                    blocks=MaskColumns([], [], []),
                    refs=[(k, s, r, n) for (k, s, r), n in t._refs.items()],
                )
                sides.append((group, t._blocks.copy()))
            snap.groups = [group for group, _ in sides]
            snap.slot_groups = [
                (slot, number[id(t)]) for slot, ts in self._slot_tables.items() for t in ts
            ]

        def encode() -> bytes:
            snap.blocks = MaskColumns.pack(blocks)
            snap.hashes = list(hashes)
            snap.hash_keys = list(hashes.values())
            for group, copied in sides:
                group.blocks = MaskColumns.pack(copied)
            return encode_snapshot(snap)

        return encode

    @staticmethod
    def _load_columns(table: MaskTable, columns: MaskColumns) -> None:
        """Fill ``table``'s blocks and counters from snapshot columns (per distinct mask)."""
        width = table._width
        blocks, masks, counts = columns.unpack(width)
        table._blocks = blocks
        table._unlist_changes()  # not listed key by key: the native match's mirror rebuilds
        held = table._held
        entries = offloaded = 0
        for number, n in counts.items():
            v = masks[number]
            entries += n * v.bit_count()
            offloaded += n * (v >> width).bit_count()
            for bitpos in iter_bits(v):
                slot = bitpos % width
                if slot >= len(held):
                    raise ValueError(
                        f"PrefixIndex.from_bytes: a mask names slot {slot} of "
                        f"{len(held)}; the snapshot is damaged"
                    )
                held[slot] += n
        table._entries = entries
        table._offloaded = offloaded
        table._canon = {v: v for v in masks}  # later stores share these ints

    @classmethod
    def from_bytes(cls, data: bytes) -> PrefixIndex:
        """Rebuild an index from :meth:`to_bytes` output; ValueError names what is wrong.

        O(blocks + hashes), in C-level passes: see :mod:`kvevents.index.snapshot`.
        """
        snap = decode_snapshot(data)
        gpu, cpu, disk = snap.credits
        index = cls(
            block_size=snap.block_size,
            max_entries=snap.max_entries,
            credits=TierCredits(gpu=gpu, cpu=cpu, disk=disk),
        )
        width = index._width = snap.width
        if len(snap.slot_block_size) != len(snap.holders):
            raise ValueError(
                f"PrefixIndex.from_bytes: {len(snap.holders)} holder slots but "
                f"{len(snap.slot_block_size)} block sizes; the snapshot is damaged"
            )
        for slot, pair in enumerate(snap.holders):
            holder = None if pair is None else Holder(*pair)
            index._holders.append(holder)
            index._slot_block_size.append(snap.slot_block_size[slot])
            index._held.append(0)
            if holder is None:
                index._free.append(slot)
            else:
                index._slots[holder] = slot
                index._live |= 1 << slot
        index._holder_list = None
        cls._load_columns(index, snap.blocks)
        index._hashes = dict(zip(snap.hashes, snap.hash_keys, strict=True))
        index._slot_keys = {(s, h): k for s, h, k in snap.slot_keys}
        index._refs = {(k, s, t): n for k, s, t, n in snap.refs}
        index.stats = snap.stats
        index.applied_seqs = {Holder(w, r): seq for w, r, seq in snap.seqs}
        index._main_group = dict(snap.main_groups)
        tables = []
        for g in snap.groups:
            table = GroupTable(
                (g.kind, g.group_idx, g.sliding_window),
                width=width,
                slots=len(index._holders),
                max_entries=index.max_entries,
            )
            table._refs = {(k, s, t): n for k, s, t, n in g.refs}
            cls._load_columns(table, g.blocks)
            index._groups[table.key] = table
            tables.append(table)
        for slot, number in snap.slot_groups:
            if not 0 <= number < len(tables) or not 0 <= slot < len(index._holders):
                raise ValueError(
                    f"PrefixIndex.from_bytes: slot group ({slot}, {number}) is inconsistent"
                )
            index._side_table(slot, tables[number].key)
        return index
