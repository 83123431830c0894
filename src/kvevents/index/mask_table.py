"""The mask table: the flat dict of per-block holder bitmasks behind ``PrefixIndex``.

:class:`MaskTable` is the storage and its mechanics, addressed by content key and
holder *slot* (a small int); :class:`~kvevents.index.prefix_index.PrefixIndex` derives
from it and adds what names things: holders, events, tokens, snapshots. It is a base
class rather than a member so that the hot paths (``match_keys``, ``_store``) run with
no extra call or attribute hop: their loops below are the index's inner loops, kept
tight (method-local aliases, one dict lookup and one AND per block, helpers inlined), and
they stay in one module with the storage invariants they keep.

Structure and invariants
------------------------
* ``_blocks: dict[content_key, int]``: a packed bitmask per block. Holder slot ``s``
  holds the block in tier ``t`` iff bit ``s + t * W`` is set, ``W`` being the slot
  width (a multiple of 64). No value is ever 0: a block nobody holds is deleted.
* The dict's insertion order is the recency order (oldest first): a store or a match
  moves a block to the end (pop and re-insert). Chains are touched leaf first, so a
  parent is never older than its children, and pruning the oldest blocks removes
  leaves before the prefixes they hang from. Matches defer the move to ``_touch_log``
  (at most ``_TOUCH_LOG_LIMIT`` entries), applied before the next write.
* Equal masks share one int object (``_canon``, at most ``_CANON_LIMIT`` values, reset
  when full): a block costs no mask object of its own, and the few masks a match reads
  stay in cache. Values compare by value, so sharing is an optimisation only.
* ``_entries`` = number of set bits over all values = (block, holder, tier) entries;
  ``_entries + predictions.count <= max_entries`` after every call (pruning the oldest
  predictions, then the oldest blocks, otherwise).
* ``predictions``: the side table of predicted entries (:mod:`kvevents.index.predictions`);
  ``_predicted`` is its ``masks`` dict, tested for emptiness where a store may confirm one.
* ``_refs[(key, slot, tier)] = n``: a holder holds ``n`` extra copies of a block in a
  tier (vLLM keeps duplicate physical blocks with one hash, storing and removing each
  separately). Absent means one copy. Sparse: empty in practice.
* ``_hashes: dict[engine_hash, content_key]``: engine hashes as sent (signed, unsigned
  or bytes). Entries whose block died are dropped when seen, and all at once when the
  map outgrows twice the number of live blocks (amortised O(1)).
* ``_slot_keys[(slot, engine_hash)] = content_key``: where a holder's block under a hash
  is not the one ``_hashes`` names. SGLang hashes tokens alone, so the same tokens under
  two salts or adapters (two content keys) share a hash; the first keeps the shared
  entry, the other holders' keys go here, and every lookup for a holder reads here first
  (:meth:`MaskTable._key_of`). Empty unless an engine's hashes collide like that.
* ``_hybrid``: the slots that also have blocks in side KV-cache groups (hybrid-attention
  models, :mod:`kvevents.index.groups`); a match shortens only their lengths, after the
  loop, so with no such slot the loops below are exactly the full-attention ones.
* ``_holders[slot]`` (None for a free slot), ``_held[slot]`` (the slot's entries) and
  ``_live`` (a mask of the registered slots) are per-slot arrays.

Why a flat dict of masks, not a radix tree
------------------------------------------
A tree of nodes (Dynamo, SGLang's radix cache) costs a Python object per block and
pointer chasing per lookup; a per-holder set of keys makes a match O(blocks x holders).
Chained content keys make the tree implicit: block i's key already names the whole
prefix 0..i, so one flat dict answers for every holder at once. A prefix-closed mask
with binary search would need parent or child links (more memory per block) to stay
exact when a block is removed from the middle of a chain, which vLLM can do.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from itertools import accumulate, compress, repeat
from operator import and_, ne, not_
from typing import TYPE_CHECKING

from kvevents import kernels
from kvevents.index.predictions import Predictions
from kvevents.index.types import IndexStats, PrefixMatch, Tier, iter_bits
from kvevents.types import Hash, Holder

if TYPE_CHECKING:
    from kvevents.kernels import MaskMirror

__all__ = ["MaskTable"]


def compiled_keys(keys: Sequence[int]) -> array[int] | None:
    """``keys`` when the native match can read them in place (an ``array("Q")``, as
    the native core keys a request), else None."""
    return keys if type(keys) is array and keys.typecode == "Q" else None


_TIERS = (Tier.GPU, Tier.CPU, Tier.DISK)
_GPU_ONLY = (Tier.GPU,)
Segments = tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]
_TOUCH_LOG_LIMIT = 1024
_CANON_LIMIT = 1 << 16
_CHANGED_LIMIT = 1 << 16


class MaskTable:
    """Per-block holder bitmasks by content key and slot; see the module docstring."""

    def __init__(
        self, *, block_size: int | None, max_entries: int, predictions: Predictions | None = None
    ) -> None:
        self.block_size = block_size
        self.max_entries = max_entries
        self.stats = IndexStats()
        self.predictions = predictions if predictions is not None else Predictions()
        self._predicted = self.predictions.masks
        self._blocks: dict[int, int] = {}
        self._hashes: dict[Hash, int] = {}
        self._slot_keys: dict[tuple[int, Hash], int] = {}
        self._refs: dict[tuple[int, int, int], int] = {}
        self._holders: list[Holder | None] = []
        self._slot_block_size: list[int | None] = []
        self._held: list[int] = []
        self._free: list[int] = []
        self._width = 64
        self._live = 0
        self._entries = 0
        self._offloaded = 0
        self._touch_log: list[tuple[Sequence[int], int]] = []
        self._canon: dict[int, int] = {}
        self._hybrid = 0
        """Slots with side KV-cache groups (:mod:`kvevents.index.groups`); 0 for models
        with full attention only, so their match pays one test per request."""
        self._mirror: MaskMirror | None = None
        """The native match's flat copy of ``_blocks`` (``MaskMirror``, :mod:`kvevents.kernels`),
        made on the first match."""
        self._changed: list[int] | None = []
        """Keys written since the mirror last synced, in order; None when not listed (the
        mirror then rebuilds from the dict)."""
        self._changed_ops: array[int] = array("q")
        """What happened to each of ``_changed``, for the mirror's sync
        (``MaskMirror.sync``): ``slot + 1`` where a holder's GPU bit was set, ``-(slot +
        1)`` cleared, 0 dropped."""
        self._mirror_off = False
        self._predicted_mirror: MaskMirror | None = None
        """The predictions' masks in a flat table, for the native choice
        (:meth:`native_mirrors`); made on its first use."""

    # --- writing ----------------------------------------------------------------------

    def _store(
        self,
        slot: int,
        keys: Sequence[int],
        tier: Tier,
        hashes: Sequence[Hash] | None,
        *,
        settle: bool = True,
    ) -> None:
        """Store a chain's keys for a holder, leaf first (parents end up more recent).

        ``settle`` False leaves the memory bound and the hash map's collection to a later
        store: a chain stored in pieces (``PrefixIndex.apply_steps``) settles once, after
        its last piece, as one store of it would, so pruning never takes the chain's own
        older blocks between two pieces.
        """
        if self._touch_log:
            self._flush_touches()
        blocks = self._blocks
        pop = blocks.pop
        canon = self._canon.setdefault
        bit = 1 << (slot + tier * self._width)
        added = 0
        for k in reversed(keys):  # leaf first: parents end up more recent
            v = pop(k, 0)
            if v & bit:
                rk = (k, slot, int(tier))
                self._refs[rk] = self._refs.get(rk, 0) + 1
            else:
                v |= bit
                added += 1
            blocks[k] = canon(v, v)
        if len(self._canon) > _CANON_LIMIT:
            self._canon.clear()
        changed = self._changed
        if changed is not None and not tier:  # the mirror holds the GPU tier alone
            changed.extend(keys)
            self._changed_ops.extend(repeat(slot + 1, len(keys)))
            if len(changed) > _CHANGED_LIMIT:
                self._unlist_changes()  # a rebuild costs less than syncing this many
        if hashes is not None:
            self._map_hashes(slot, hashes, keys)
            if settle and len(self._hashes) > 2 * len(blocks) + 4096:
                self._maybe_gc_hashes()
        if self._predicted:
            self.predictions.confirm(slot, keys)
        self.stats.stored_blocks += len(keys)
        self._entries += added
        self._held[slot] += added
        if tier:
            self._offloaded += added
        if settle and self._entries + self.predictions.count > self.max_entries:
            self._prune()

    def _remove_many(self, slot: int, keys: Iterable[int | None], tier: Tier | None) -> list[bool]:
        """Drop one copy of each of ``keys`` from a holder's tier (or each tier), in order;
        per key, whether the holder held one (None, an unknown key: False). One call per
        removal event rather than per block: a removal is half of an engine's events."""
        blocks = self._blocks
        get = blocks.get
        refs = self._refs
        canon = self._canon
        w = self._width
        if tier is not None:
            tiers: tuple[Tier, ...] = (tier,)
        else:  # every tier; with nothing offloaded anywhere, only the GPU's bits are set
            tiers = _TIERS if self._offloaded else _GPU_ONLY
        bits = [(int(t), 1 << (slot + t * w)) for t in tiers]
        gpu = 1 << slot
        changed = self._changed
        ops = self._changed_ops
        held: list[bool] = []
        dropped = offloaded = 0
        for key in keys:
            if key is None or (v := get(key)) is None:
                held.append(False)
                continue
            found = False
            for t, bit in bits:
                if not v & bit:
                    continue
                found = True
                if refs:
                    rk = (key, slot, t)
                    extra = refs.get(rk)
                    if extra:
                        if extra == 1:
                            del refs[rk]
                        else:
                            refs[rk] = extra - 1
                        continue
                v &= ~bit
                dropped += 1
                if t:
                    offloaded += 1
            held.append(found)
            if not found:
                continue
            if v:
                blocks[key] = canon.get(v, v)
            else:
                del blocks[key]
            if changed is not None and not v & gpu:  # its GPU bit went
                changed.append(key)
                ops.append(-slot - 1)
        self.stats.removed_blocks += held.count(True)
        self._entries -= dropped
        self._held[slot] -= dropped
        self._offloaded -= offloaded
        return held

    # --- engine hashes ------------------------------------------------------------------

    def _map_hashes(self, slot: int, hashes: Sequence[Hash], keys: Sequence[int]) -> None:
        """Remember that ``slot``'s blocks ``keys`` go by the engine's ``hashes``."""
        known = self._hashes
        if self._slot_keys or any(map(ne, map(known.get, hashes, keys), keys)):
            self._map_hashes_apart(slot, hashes, keys)
        else:  # the usual case, in C: no hash names another key
            known.update(zip(hashes, keys, strict=True))

    def _map_hashes_apart(self, slot: int, hashes: Sequence[Hash], keys: Sequence[int]) -> None:
        known, own = self._hashes, self._slot_keys
        for h, k in zip(hashes, keys, strict=True):
            shared = known.get(h)
            if shared is None or shared == k or not self._key_held(shared):
                known[h] = k
                own.pop((slot, h), None)
            else:  # another block (another namespace) holds the shared entry
                own[(slot, h)] = k

    def _key_of(self, slot: int, h: Hash) -> int | None:
        """The content key of ``slot``'s block under engine hash ``h`` (None: unknown)."""
        own = self._slot_keys
        if own:
            k = own.get((slot, h))
            if k is not None:
                return k
        return self._hashes.get(h)

    def _keys_of(self, slot: int, hashes: Iterable[Hash]) -> list[int | None]:
        """:meth:`_key_of` of each hash."""
        if not self._slot_keys:
            return list(map(self._hashes.get, hashes))
        return [self._key_of(slot, h) for h in hashes]

    def _unmap_hash(self, slot: int, h: Hash, k: int) -> None:
        """``slot`` removed a copy of its block ``k`` under ``h``: forget its own key once
        it holds ``k`` nowhere, the shared entry once nobody does (one event may name a
        hash twice: a duplicated block)."""
        own = self._slot_keys
        if own and own.get((slot, h)) == k and not self._slot_holds(k, slot):
            del own[(slot, h)]
        if not self._key_held(k) and self._hashes.get(h) == k:
            del self._hashes[h]

    def _slot_holds(self, key: int, slot: int) -> bool:
        """Whether ``slot`` has ``key`` in some tier (of some group, in the index)."""
        return self._held_any(key, slot)

    def _key_held(self, key: int) -> bool:
        """Whether any holder has ``key`` (side groups too, in the index)."""
        return key in self._blocks

    def _held_any(self, key: int, slot: int) -> bool:
        v = self._blocks.get(key, 0)
        w = self._width
        return bool((v | v >> w | v >> 2 * w) >> slot & 1)

    def _not_held(self, keys: Sequence[int], slot: int) -> list[int]:
        """The ``keys`` that ``slot`` holds in no tier, in order: :meth:`_held_any` for each
        key, but in one native call over the mirror (or iterated in C) when nothing is
        offloaded. A relayed request predicts its blocks through this, one per block of
        its prompt, so a Python call per key would be a visible share of the relay."""
        if self._offloaded:
            return [k for k in keys if not self._held_any(k, slot)]
        words = compiled_keys(keys)
        mirror = None if words is None or slot >= self._width else self._synced_mirror()
        if mirror is not None and words is not None:  # (the mirror reads a bit of the row)
            return mirror.not_held(words, slot)
        held = map(and_, map(self._blocks.get, keys, repeat(0)), repeat(1 << slot))
        return list(compress(keys, map(not_, held)))

    def _clear_slot(self, slot: int, *, predictions: bool = True) -> int:
        """Drop every block of a slot, every tier, and (``predictions``) its predicted
        entries; returns the confirmed entries dropped. O(distinct blocks)."""
        self._flush_touches()
        w = self._width
        mask = (1 << slot) | (1 << (slot + w)) | (1 << (slot + 2 * w))
        upper = mask >> w << w
        hit = [k for k, v in self._blocks.items() if v & mask]
        blocks = self._blocks
        for k in hit:
            v = blocks[k]
            self._offloaded -= (v & upper).bit_count()
            nv = v & ~mask
            if nv:
                blocks[k] = self._canon.get(nv, nv)
            else:
                del blocks[k]
        if self._changed is not None:
            self._changed.extend(hit)
            self._changed_ops.extend(repeat(-slot - 1, len(hit)))
        if self._refs:
            for rk in [rk for rk in self._refs if rk[1] == slot]:
                del self._refs[rk]
        if self._slot_keys:
            for sk in [sk for sk in self._slot_keys if sk[0] == slot]:
                del self._slot_keys[sk]
        if predictions and self._predicted:
            self.predictions.clear_slot(slot)
        dropped = self._held[slot]
        self._entries -= dropped
        self._held[slot] = 0
        return dropped

    # --- matching ---------------------------------------------------------------------

    def match_keys(self, keys: Sequence[int], *, reusable: int | None = None) -> PrefixMatch:
        """Every holder's longest cached prefix of a request given as content keys.

        ``reusable``: the most blocks an engine reuses of the request
        (:func:`~kvevents.index.reusable.reusable_blocks` of its token count: a
        block-aligned prompt's last block is recomputed); only that many leading keys are
        matched, before hybrid holders' groups shorten their lengths. None: every key.

        One dict lookup per block, all of them in C (no Python step per block), then
        O(distinct matched lengths); the tiered match stops at the first block no holder has.
        """
        if reusable is not None and reusable < len(keys):
            keys = keys[: max(0, reusable)]
        self.stats.lookups += 1
        if self._offloaded:
            return self._match_tiered(keys)
        mirror = None
        if type(keys) is array and keys.typecode == "Q":
            mirror = self._synced_mirror()  # compiled_keys(), spelled out on the hot path
        if mirror is not None:
            segs, i = mirror.match(keys, self._live)  # type: ignore[arg-type]
        else:
            segs, i = self._segments(map(self._blocks.get, keys, repeat(0)), len(keys))
        if i and len(self._touch_log) < _TOUCH_LOG_LIMIT:
            self._touch_log.append((keys, i))
        if self._hybrid:
            return self._apply_groups(keys, (segs, segs, segs))
        return PrefixMatch(self._holders, (segs, segs, segs), len(keys), self.block_size)

    def native_mirrors(self, *, keyed: bool) -> tuple[MaskMirror, MaskMirror | None] | None:
        """The mirrors the native calls read (:mod:`kvevents.kernels.native`), synced: the
        blocks' GPU masks and the predictions' (None when there are none); None when this
        index's matches are not plain: offloaded tiers, side groups (hybrid models),
        more than 64 slots, or the native core off. ``keyed``: the request has a full block,
        so predictions past their deadline are expired first, as
        :meth:`~kvevents.index.prefix_index.PrefixIndex.predicted` does for it. A match
        made from them is reported with :meth:`note_plain_match`."""
        if self._offloaded or self._hybrid:
            return None
        mirror = self._synced_mirror()
        if mirror is None or mirror.words != 1:
            return None
        if not keyed or not self._predicted:
            return mirror, None
        self.predictions.expire()
        if not self._predicted:
            return mirror, None
        predicted = self._synced_predictions()
        return None if predicted is None else (mirror, predicted)

    def _synced_predictions(self) -> MaskMirror | None:
        """The predictions' masks in a flat mirror, brought up to date with their listed
        changes (rebuilt when those were not all listed); None when the core is off."""
        mirror = self._predicted_mirror
        if mirror is None:
            compiled = kernels.loaded()
            if compiled is None:
                return None
            mirror = self._predicted_mirror = compiled.MaskMirror(1)
            self.predictions.unlist_changes()  # a new mirror is built from the dict
        changes = self.predictions.take_changes()
        try:
            if changes is None:
                mirror.rebuild(self._predicted)
            elif changes[0]:
                mirror.sync(*changes)
        except (OverflowError, ValueError):  # a key past uint64 (a caller's own keys), or a
            # slot past 63 (predictions of a wider index): not mirrored, rebuilt next time
            self._predicted_mirror = None
            return None
        return mirror

    def note_plain_match(self, keys: bytes, longest: int) -> None:
        """What :meth:`match_keys` records of a match made elsewhere from
        :meth:`native_mirrors`: a lookup, and the recency of the ``longest`` blocks matched
        (``keys``: the request's keys as uint64 bytes)."""
        self.stats.lookups += 1
        if longest and len(self._touch_log) < _TOUCH_LOG_LIMIT:
            self._touch_log.append((keys, longest))

    def sync_mirror(self) -> None:
        """Build or update the native match's mirror now, instead of on the next match: a
        router does once it serves (a warm-started index's first request copies nothing)."""
        self._synced_mirror()

    def _synced_mirror(self) -> MaskMirror | None:
        """The mirror brought up to date with ``_blocks``; None while the core is off.
        A mirror is as wide as the slots (:meth:`_set_width` makes the next one wider)."""
        mirror = self._mirror
        if mirror is None or mirror.words != self._width >> 6:
            compiled = kernels.loaded()
            if compiled is None or self._mirror_off:
                return None
            try:
                mirror = self._mirror = compiled.MaskMirror(self._width >> 6)
            except ValueError:  # past the mirror's 65,536 holder slots: the dict answers
                self._mirror_off = True
                return None
            self._unlist_changes()
        changed = self._changed
        if changed is not None and not changed:
            return mirror  # nothing written since the last match: the usual case
        try:
            if changed is None:
                mirror.rebuild(self._blocks)
            else:
                mirror.sync(changed, self._changed_ops)
        except (OverflowError, ValueError):  # a key past uint64 (a caller's own store_keys),
            # or a slot past the mirror's: the dict answers
            self._mirror, self._mirror_off = None, True
            return None
        if changed is None:
            self._changed = []
        else:
            changed.clear()
        self._changed_ops = array("q")
        return mirror

    def _unlist_changes(self) -> None:
        """Stop listing changes: the next match rebuilds the mirror from the dict."""
        self._changed = None
        self._changed_ops = array("q")

    def _segments(self, masks: Iterable[int], n: int) -> tuple[list[tuple[int, int]], int]:
        """``(slot_mask, length)`` pairs (the holders in ``slot_mask`` have exactly
        ``length`` leading blocks) from each block's holder mask, and the longest length.

        The running AND is computed in C: ``prefix[j]`` holds the holders that have
        blocks ``0..j-1``. It changes at few places (one per distinct length), found by
        C-level scans too, so no Python step runs per block.
        """
        prefix = list(accumulate(masks, and_, initial=self._live))
        segs: list[tuple[int, int]] = []
        before = prefix[0]
        for mask in dict.fromkeys(prefix):
            if mask == before:
                continue
            length = prefix.index(mask) - 1  # the holders dropped here hold exactly this
            if length:
                segs.append((before ^ mask, length))
            if not mask:
                return segs, length
            before = mask
        if n and before:
            segs.append((before, n))
            return segs, n
        return segs, 0

    def _match_tiered(self, keys: Sequence[int]) -> PrefixMatch:
        get = self._blocks.get
        w = self._width
        low = (1 << w) - 1
        g = c = a = self._live
        sg: list[tuple[int, int]] = []
        sc: list[tuple[int, int]] = []
        sa: list[tuple[int, int]] = []
        i = 0
        for k in keys:
            v = get(k, 0)
            vg = v & low
            vc = vg | (v >> w & low)
            va = vc | (v >> 2 * w)
            ng, nc, na = g & vg, c & vc, a & va
            if i:
                if ng != g:
                    sg.append((g ^ ng, i))
                if nc != c:
                    sc.append((c ^ nc, i))
                if na != a:
                    sa.append((a ^ na, i))
            g, c, a = ng, nc, na
            if not a:
                break
            i += 1
        else:
            if i:
                for seg, mask in ((sg, g), (sc, c), (sa, a)):
                    if mask:
                        seg.append((mask, i))
        if i and len(self._touch_log) < _TOUCH_LOG_LIMIT:
            self._touch_log.append((keys, i))
        if self._hybrid:
            return self._apply_groups(keys, (sg, sc, sa))
        return PrefixMatch(self._holders, (sg, sc, sa), len(keys), self.block_size)

    def _apply_groups(self, keys: Sequence[int], segments: Segments) -> PrefixMatch:
        """Shorten the matches of holders with side groups (overridden by the index)."""
        return PrefixMatch(self._holders, segments, len(keys), self.block_size)

    def _tier_mask(self, slot: int, tier: Tier | None) -> int:
        w = self._width
        if tier is None:
            return (1 << slot) | (1 << (slot + w)) | (1 << (slot + 2 * w))
        return 1 << (slot + int(tier) * w)

    # --- maintenance -----------------------------------------------------------------

    def set_max_entries(self, max_entries: int) -> None:
        """Change the memory bound; an index over the new one is pruned now, as a store
        past it would be (least recently used blocks first)."""
        if max_entries <= 0:
            raise ValueError(f"max_entries={max_entries} must be a positive int")
        self.max_entries = max_entries
        if self._entries + self.predictions.count > max_entries:
            self._prune()

    def _flush_touches(self) -> None:
        """Apply deferred recency updates of matches (leaf first, so parents end newest)."""
        blocks = self._blocks
        pop = blocks.pop
        for logged, n in self._touch_log:
            # a native match logs its keys as bytes (note_plain_match)
            keys = memoryview(logged).cast("Q") if type(logged) is bytes else logged
            for i in range(n - 1, -1, -1):
                k = keys[i]
                v = pop(k, None)
                if v is not None:
                    blocks[k] = v
        self._touch_log.clear()

    def _prune(self) -> None:
        """Drop predictions, then the least recently used blocks, until the bound holds (1% slack)."""
        self._flush_touches()
        target = self.max_entries - max(1, self.max_entries // 100)
        excess = self._entries - target
        if self._predicted:
            excess += self.predictions.count
            excess -= self.predictions.shrink(excess)
            if excess <= 0:
                return
        victims = []
        for k, v in self._blocks.items():
            victims.append(k)
            excess -= v.bit_count()
            if excess <= 0:
                break
        w = self._width
        held = self._held
        dropped = 0
        if self._changed is not None:
            self._changed.extend(victims)
            self._changed_ops.extend(repeat(0, len(victims)))
        for k in victims:
            v = self._blocks.pop(k)
            dropped += v.bit_count()
            self._offloaded -= (v >> w).bit_count()
            for bitpos in iter_bits(v):
                held[bitpos % w] -= 1
        if self._refs:
            dead = set(victims)
            for rk in [rk for rk in self._refs if rk[0] in dead]:
                del self._refs[rk]
        self._entries -= dropped
        self.stats.pruned_entries += dropped

    def _maybe_gc_hashes(self) -> None:
        if len(self._hashes) > 2 * len(self._blocks) + 4096 or not self._blocks:
            blocks = self._blocks
            self._hashes = {h: k for h, k in self._hashes.items() if k in blocks}
            self._slot_keys = {sh: k for sh, k in self._slot_keys.items() if k in blocks}

    def _set_width(self, width: int) -> None:
        """Re-pack every value for a new slot width (more than ``width`` holders). O(blocks)."""
        old = self._width
        low = (1 << old) - 1
        self._unlist_changes()  # every value moves: the mirror rebuilds (or is not used)
        for k, v in self._blocks.items():
            self._blocks[k] = (
                (v & low) | ((v >> old & low) << width) | ((v >> 2 * old) << 2 * width)
            )
        self._width = width
