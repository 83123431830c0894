"""PrefixIndex: which holder caches the longest prefix of a request, per tier.

A *holder* is one independent KV cache, ``Holder(worker, dp_rank)``. The index mirrors
what every holder caches, fed by its event stream (:meth:`PrefixIndex.apply`), and
answers :meth:`PrefixIndex.match`: for each holder, the exact number of leading blocks
of a request it holds, per tier (see :mod:`kvevents.index.types`).

Keys
----
Blocks are keyed by our own chained content key (:func:`kvevents.wire.hashing.content_keys`)
computed from the event's ``token_ids``, so requests are keyed the same way without
sharing any hash seed with an engine. A global map from engine hash to content key
resolves ``BlockRemoved`` (hashes only), tier copies (empty tokens) and parents.
A LoRA adapter or a cache salt starts the chain from its own root key
(:func:`namespace_key`), since engines never share blocks across them.

Structure and invariants
------------------------
* ``_blocks: dict[content_key, int]``: a packed bitmask per block. Holder slot ``s``
  holds the block in tier ``t`` iff bit ``s + t * W`` is set, ``W`` being the slot
  width (a multiple of 64). No value is ever 0: a block nobody holds is deleted.
* The dict's insertion order is the recency order (oldest first): a store or a match
  moves a block to the end (pop and re-insert). Chains are touched leaf first, so a
  parent is never older than its children, and pruning the oldest blocks removes
  leaves before the prefixes they hang from.
* Equal masks share one int object (``_canon``, at most 65,536 values, reset when
  full): a block costs no mask object of its own, and the few masks a match reads
  stay in cache. Values compare by value, so sharing is an optimisation only.
* ``_entries`` = number of set bits over all values = (block, holder, tier) entries;
  it stays ``<= max_entries`` after every call (pruning the oldest blocks otherwise).
* ``_refs[(key, slot, tier)] = n``: a holder holds ``n`` extra copies of a block in a
  tier (vLLM keeps duplicate physical blocks with one hash, storing and removing each
  separately). Absent means one copy. Sparse: empty in practice.
* ``_hashes: dict[engine_hash, content_key]``: engine hashes as sent (signed, unsigned
  or bytes). Entries whose block died are dropped when seen, and all at once when the
  map outgrows twice the number of live blocks (amortised O(1)). It assumes an engine
  hash names the same content for every holder (true for SGLang's and vLLM's
  SHA-256-based hashes); :meth:`holder_hashes` reports, for a block, every engine hash
  seen for its content.

Complexity
----------
``match``: O(blocks matched), one dict lookup and one AND per block, independent of
the number of holders (a mask AND is one machine word for up to 60 holders). ``store``
and ``remove``: O(blocks). ``clear_holder``: O(distinct blocks) (a scan: flushes and
resets are rare, and a per-holder key set would cost about 50 bytes per (block, holder)
for an operation that happens once per flush). Memory: about 65-80 bytes per (block,
holder) on the conversation trace, see ``benchmarks/index.py``.

Why not a radix tree
--------------------
A tree of nodes (Dynamo, SGLang's radix cache) costs a Python object per block and
pointer chasing per lookup; a per-holder set of keys makes a match O(blocks x holders).
Chained content keys make the tree implicit: block i's key already names the whole
prefix 0..i, so one flat dict answers for every holder at once. A prefix-closed mask
with binary search would need parent or child links (about 40% more memory) to stay
exact when a block is removed from the middle of a chain, which vLLM can do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import xxhash

from kvevents.index.snapshot import (
    SNAPSHOT_VERSION,
    IndexSnapshot,
    decode_snapshot,
    encode_snapshot,
    mask_bytes,
)
from kvevents.index.types import (
    DEFAULT_CREDITS,
    HolderMatch,
    IndexStats,
    PrefixMatch,
    Tier,
    TierCredits,
    iter_bits,
    normalize_medium,
)
from kvevents.types import Hash, Holder
from kvevents.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.wire.hashing import ROOT_KEY, content_keys

__all__ = ["DEFAULT_MAX_ENTRIES", "PrefixIndex", "namespace_key"]

DEFAULT_MAX_ENTRIES = 16_000_000
"""Default memory bound: (block, holder, tier) entries (about 1.3 GB at the measured size)."""

_TIERS = (Tier.GPU, Tier.CPU, Tier.DISK)
_xxh3 = xxhash.xxh3_64_intdigest
_TOUCH_LOG_LIMIT = 1024
_CANON_LIMIT = 1 << 16


def namespace_key(lora: str | int | None = None, cache_salt: str | None = None) -> int:
    """Root key of chains stored under a LoRA adapter and/or a cache salt.

    ``ROOT_KEY`` when both are None, so plain prompts need no namespace.
    """
    if lora is None and cache_salt is None:
        return ROOT_KEY
    return int(_xxh3(f"kvevents-ns\x00{lora!r}\x00{cache_salt!r}".encode()))


def _orphan_key(parent: Hash) -> int:
    """A root for a chain whose parent hash is unknown: reachable by no request."""
    raw = parent if isinstance(parent, bytes) else (parent % (1 << 64)).to_bytes(8, "big")
    return int(_xxh3(b"kvevents-orphan\x00" + raw))


class PrefixIndex:
    """Which holder caches which blocks, in which tier; longest-prefix match for requests.

    See the module docstring for the structure, invariants and complexity.

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
    ) -> None:
        if block_size is not None and block_size <= 0:
            raise ValueError(f"PrefixIndex: block_size={block_size} must be a positive int")
        if max_entries <= 0:
            raise ValueError(f"PrefixIndex: max_entries={max_entries} must be a positive int")
        self.block_size = block_size
        self.max_entries = max_entries
        self.credits = credits
        self.stats = IndexStats()
        self._blocks: dict[int, int] = {}
        self._hashes: dict[Hash, int] = {}
        self._refs: dict[tuple[int, int, int], int] = {}
        self._holders: list[Holder | None] = []
        self._slots: dict[Holder, int] = {}
        self._slot_block_size: list[int | None] = []
        self._held: list[int] = []
        self._free: list[int] = []
        self._width = 64
        self._live = 0
        self._entries = 0
        self._offloaded = 0
        self._touch_log: list[tuple[Sequence[int], int]] = []
        self._canon: dict[int, int] = {}

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
        """Registered holders, in slot order."""
        return [h for h in self._holders if h is not None]

    def slot_of(self, holder: Holder) -> int | None:
        return self._slots.get(holder)

    def holder_size(self, holder: Holder) -> int:
        """(block, tier) entries the holder has in the index."""
        slot = self._slots.get(holder)
        return 0 if slot is None else self._held[slot]

    def clear_holder(self, holder: Holder) -> int:
        """Forget every block of a holder (AllBlocksCleared, a reset, a loss); returns entries dropped.

        The holder stays registered. O(distinct blocks).
        """
        slot = self._slots.get(holder)
        if slot is None:
            return 0
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
        if self._refs:
            for rk in [rk for rk in self._refs if rk[1] == slot]:
                del self._refs[rk]
        dropped = self._held[slot]
        self._entries -= dropped
        self._held[slot] = 0
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
        del self._slots[holder]
        self._holders[slot] = None
        self._live &= ~(1 << slot)
        self._free.append(slot)
        return dropped

    # --- events ---------------------------------------------------------------------

    def apply(self, holder: Holder, batch: KVEventBatch) -> None:
        """Apply one batch of a holder's stream, event by event, in order."""
        slot = self._slots.get(holder)
        if slot is None:
            slot = self.add_holder(holder)
        for event in batch.events:
            kind = type(event)
            if kind is BlockStored:
                self._apply_stored(slot, event)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                self._apply_removed(slot, event)  # type: ignore[arg-type]
            elif kind is AllBlocksCleared:
                self.clear_holder(self._holders[slot])  # type: ignore[arg-type]
                self.stats.count_event("AllBlocksCleared", "ok")

    def _apply_stored(self, slot: int, ev: BlockStored) -> None:
        stats = self.stats
        outcome = "ok"
        tier, known = normalize_medium(ev.medium)
        if not known:
            stats.unknown_medium += 1
            outcome = "unknown_medium"
        hashes = ev.block_hashes
        tokens = ev.token_ids
        if not tokens:
            # A copy into another tier of blocks already known by engine hash.
            keys = []
            for h in hashes:
                k = self._hashes.get(h)
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
        if parent is None:
            lora = ev.lora_name if ev.lora_name is not None else ev.lora_id
            parent_key = namespace_key(lora, ev.cache_salt)
        else:
            pk = self._hashes.get(parent)
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
        self._store(slot, keys, tier, hashes)
        stats.count_event("BlockStored", outcome)

    def _apply_removed(self, slot: int, ev: BlockRemoved) -> None:
        stats = self.stats
        outcome = "ok"
        tier: Tier | None = None
        if ev.medium is not None:
            tier, known = normalize_medium(ev.medium)
            if not known:
                stats.unknown_medium += 1
                outcome = "unknown_medium"
        hashes = self._hashes
        for h in ev.block_hashes:
            k = hashes.get(h)
            if k is None or not self._remove(slot, k, tier):
                stats.unknown_hash += 1
                outcome = "unknown_hash"
            elif k not in self._blocks:
                del hashes[h]
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
        held = 0
        for k in keys:
            if self._remove(slot, k, tier):
                held += 1
        return held

    def _store(
        self, slot: int, keys: Sequence[int], tier: Tier, hashes: Sequence[Hash] | None
    ) -> None:
        if self._touch_log:
            self._flush_touches()
        blocks = self._blocks
        pop = blocks.pop
        canon = self._canon.setdefault
        bit = 1 << (slot + tier * self._width)
        added = 0
        for i in range(len(keys) - 1, -1, -1):  # leaf first: parents end up more recent
            k = keys[i]
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
        if hashes is not None:
            self._hashes.update(zip(hashes, keys, strict=True))
            if len(self._hashes) > 2 * len(blocks) + 4096:
                self._maybe_gc_hashes()
        self.stats.stored_blocks += len(keys)
        self._entries += added
        self._held[slot] += added
        if tier:
            self._offloaded += added
        if self._entries > self.max_entries:
            self._prune()

    def _remove(self, slot: int, key: int, tier: Tier | None) -> bool:
        """Drop one copy of ``key`` from a holder's tier (or each tier); True if it held one."""
        v = self._blocks.get(key)
        if v is None:
            return False
        w = self._width
        found = False
        for t in _TIERS if tier is None else (tier,):
            bit = 1 << (slot + t * w)
            if not v & bit:
                continue
            found = True
            rk = (key, slot, int(t))
            extra = self._refs.get(rk)
            if extra:
                if extra == 1:
                    del self._refs[rk]
                else:
                    self._refs[rk] = extra - 1
                continue
            v &= ~bit
            self._entries -= 1
            self._held[slot] -= 1
            if t:
                self._offloaded -= 1
        if not found:
            return False
        self.stats.removed_blocks += 1
        if v:
            self._blocks[key] = self._canon.get(v, v)
        else:
            del self._blocks[key]
        return True

    def _held_any(self, key: int, slot: int) -> bool:
        v = self._blocks.get(key, 0)
        w = self._width
        return bool((v | v >> w | v >> 2 * w) >> slot & 1)

    # --- matching -------------------------------------------------------------------

    def keys_for(
        self,
        token_ids: Sequence[int],
        *,
        lora: str | int | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """Content keys of a request's full blocks, as :meth:`match` computes them."""
        if self.block_size is None:
            raise ValueError(
                "PrefixIndex: block_size is not known yet; pass block_size= or register "
                "a holder with its advertised block size before matching tokens"
            )
        return content_keys(token_ids, self.block_size, namespace_key(lora, cache_salt))

    def match(
        self,
        token_ids: Sequence[int],
        *,
        lora: str | int | None = None,
        cache_salt: str | None = None,
    ) -> PrefixMatch:
        """Every holder's longest cached prefix of a request given as token ids."""
        return self.match_keys(self.keys_for(token_ids, lora=lora, cache_salt=cache_salt))

    def match_keys(self, keys: Sequence[int]) -> PrefixMatch:
        """Every holder's longest cached prefix of a request given as content keys.

        O(blocks matched): stops at the first block no holder has.
        """
        self.stats.lookups += 1
        if self._offloaded:
            return self._match_tiered(keys)
        get = self._blocks.get
        m = self._live
        segs: list[tuple[int, int]] = []
        i = 0
        for i, k in enumerate(keys):  # i is the matched length after a break
            nm = m & get(k, 0)
            if nm != m:
                if i:
                    segs.append((m ^ nm, i))
                if not nm:
                    break
                m = nm
        else:
            i = len(keys)
            if i:
                segs.append((m, i))
        if i and len(self._touch_log) < _TOUCH_LOG_LIMIT:
            self._touch_log.append((keys, i))
        return PrefixMatch(self._holders, (segs, segs, segs), len(keys), self.block_size)

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
        return PrefixMatch(self._holders, (sg, sc, sa), len(keys), self.block_size)

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
        return {h for h, k in self._hashes.items() if get(k, 0) & mask}

    def _tier_mask(self, slot: int, tier: Tier | None) -> int:
        w = self._width
        if tier is None:
            return (1 << slot) | (1 << (slot + w)) | (1 << (slot + 2 * w))
        return 1 << (slot + int(tier) * w)

    # --- maintenance ----------------------------------------------------------------

    def _flush_touches(self) -> None:
        """Apply deferred recency updates of matches (leaf first, so parents end newest)."""
        blocks = self._blocks
        pop = blocks.pop
        for keys, n in self._touch_log:
            for i in range(n - 1, -1, -1):
                k = keys[i]
                v = pop(k, None)
                if v is not None:
                    blocks[k] = v
        self._touch_log.clear()

    def _prune(self) -> None:
        """Drop the least recently used blocks until the bound holds, with 1% slack."""
        self._flush_touches()
        target = self.max_entries - max(1, self.max_entries // 100)
        excess = self._entries - target
        victims = []
        for k, v in self._blocks.items():
            victims.append(k)
            excess -= v.bit_count()
            if excess <= 0:
                break
        w = self._width
        held = self._held
        dropped = 0
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

    def _set_width(self, width: int) -> None:
        """Re-pack every value for a new slot width (more than ``width`` holders). O(blocks)."""
        old = self._width
        low = (1 << old) - 1
        for k, v in self._blocks.items():
            self._blocks[k] = (
                (v & low) | ((v >> old & low) << width) | ((v >> 2 * old) << 2 * width)
            )
        self._width = width

    # --- snapshot -------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The whole index as bytes (msgpack); see :mod:`kvevents.index.snapshot`."""
        self._flush_touches()
        snap = IndexSnapshot(
            version=SNAPSHOT_VERSION,
            block_size=self.block_size,
            max_entries=self.max_entries,
            credits=self.credits.as_tuple(),
            width=self._width,
            holders=[None if h is None else (h.worker, h.dp_rank) for h in self._holders],
            slot_block_size=list(self._slot_block_size),
            blocks=[(k, mask_bytes(v)) for k, v in self._blocks.items()],
            hashes=list(self._hashes.items()),
            refs=[(k, s, t, n) for (k, s, t), n in self._refs.items()],
            stats=self.stats,
        )
        return encode_snapshot(snap)

    @classmethod
    def from_bytes(cls, data: bytes) -> PrefixIndex:
        """Rebuild an index from :meth:`to_bytes` output; ValueError names what is wrong."""
        snap = decode_snapshot(data)
        gpu, cpu, disk = snap.credits
        index = cls(
            block_size=snap.block_size,
            max_entries=snap.max_entries,
            credits=TierCredits(gpu=gpu, cpu=cpu, disk=disk),
        )
        width = index._width = snap.width
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
        held = index._held
        entries = offloaded = 0
        for key, raw in snap.blocks:
            v = int.from_bytes(raw, "little")
            index._blocks[key] = v
            entries += v.bit_count()
            offloaded += (v >> width).bit_count()
            while v:
                low = v & -v
                held[(low.bit_length() - 1) % width] += 1
                v ^= low
        index._entries = entries
        index._offloaded = offloaded
        index._hashes = dict(snap.hashes)
        index._refs = {(k, s, t): n for k, s, t, n in snap.refs}
        index.stats = snap.stats
        return index
