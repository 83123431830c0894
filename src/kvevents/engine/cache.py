"""A paged radix prefix cache that records the KV events a real engine would send.

The cache holds pages (blocks) of ``page_size`` tokens, each a node of a radix tree whose
root-to-node path is the prefix the page completes. The engine's page hash is a chain
(:mod:`kvevents.wire.hashing`), so a digest names the whole path and the tree's child
lookup is one dict probe, ``_nodes[digest]``; a node keeps its parent and a child count,
which is all eviction needs.

Invariants (checked by :meth:`PrefixCache.check_invariants`):

1. A node's parent is cached: every cached page's whole prefix is cached.
2. ``node.refs`` counts the running admissions that pin it; an admission pins a
   root-anchored path, so ``refs(parent) >= refs(child)``.
3. ``_evictable`` holds exactly the unpinned nodes, every node before its ancestors
   (pins are released leaf first, appended at the end), so its first entry is always the
   least recently released unpinned *leaf*: eviction is ``popitem(last=False)``, O(1). A
   heap of leaves by access time, the obvious choice, costs O(log n) per touch and lazy
   deletion; one recency list over all nodes would have to skip pinned and inner nodes.
4. ``len(_nodes) <= capacity``. When every page is pinned, an admission caches what fits
   (possibly nothing) and still runs: a simulated engine needs no memory admission control.

Every change is recorded in order, as an engine reports it: one ``BlockStored`` per newly
inserted chain, one ``BlockRemoved`` per eviction pass (leaf first), ``AllBlocksCleared``
on :meth:`PrefixCache.flush`; replaying them into an empty set reproduces exactly the pages held.
``admit`` is O(tokens) in C plus O(pages) dict operations.

Namespaces follow the engines: an adapter (``lora_name``, ``lora_id``) or a ``cache_salt``
gives a request a chain of its own, and ``extra_keys`` (e.g. an image's
``[identifier, offset]`` per page) fold into each page's digest, as vLLM hashes them, so
stored chains carry vLLM's ``extra_keys``. ``sliding_window=W`` simulates vLLM's hybrid
model: group 1 (full attention) is the tree above, group 0 (sliding window) holds the
last ``ceil((W - 1) / page_size)`` pages of each prompt; events carry ``group_idx`` and
``kv_cache_spec_kind``, an eviction leaves both groups, and a hit is what vLLM's hybrid
coordinator accepts (:mod:`kvevents.index.groups`).

A hit is what an engine reuses, not all it holds: at most every page but a page-aligned
prompt's last (:mod:`kvevents.index.reusable`; vLLM and SGLang compute a prompt's last
token), the cap applied before the window rule, as vLLM does. Storing is not capped.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvevents.index.reusable import reusable_blocks
from kvevents.wire.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvevents.wire.hashing import HashScheme, SGLangPageHash, VLLMSha256CborHash, tokens_to_array

__all__ = ["Admission", "CacheEvent", "CacheStats", "PrefixCache"]

CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
"""An event the cache records (the members of ``KVEventBatch.events``)."""


class _Node:
    __slots__ = ("children", "digest", "event_hash", "parent", "refs")

    def __init__(self, digest: bytes, event_hash: int, parent: _Node | None) -> None:
        self.digest = digest
        self.event_hash = event_hash
        self.parent = parent
        self.children = 0
        self.refs = 0


@dataclass(slots=True)
class Admission:
    """What :meth:`PrefixCache.admit` did for one request; hand it back to :meth:`~PrefixCache.release`."""

    prompt_tokens: int
    cached_tokens: int
    inserted_blocks: int
    _pinned: list[_Node] = field(repr=False)
    _epoch: int = field(repr=False)


@dataclass(slots=True)
class CacheStats:
    """Cumulative figures since the cache was created (a flush does not reset them)."""

    admissions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    blocks_stored: int = 0
    blocks_evicted: int = 0
    flushes: int = 0

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens (0.0 before any admission)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixCache:
    """Paged radix prefix cache with pinning, LRU eviction and event recording.

    ``page_size`` tokens per page, at most ``capacity`` pages. ``scheme`` names the pages
    (SGLang's page hash by default). See the module docstring for invariants and costs.
    """

    def __init__(
        self,
        page_size: int,
        capacity: int,
        scheme: HashScheme | None = None,
        medium: str = "GPU",
        sliding_window: int | None = None,
    ) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"PrefixCache: page_size={page_size!r} must be an int >= 1")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"PrefixCache: capacity={capacity!r} must be an int >= 1 (blocks)")
        if sliding_window is not None and (
            not isinstance(sliding_window, int) or sliding_window < 1
        ):
            raise ValueError(
                f"PrefixCache: sliding_window={sliding_window!r} must be an int >= 1 (tokens)"
            )
        self.page_size = page_size
        self.capacity = capacity
        self.sliding_window = sliding_window
        self.window_pages = (
            0 if sliding_window is None else max(1, -(-(sliding_window - 1) // page_size))
        )
        self._window: set[bytes] = set()
        """Digests the sliding-window group holds (hybrid mode)."""
        self.scheme: HashScheme = scheme if scheme is not None else SGLangPageHash()
        self.medium = medium
        self.stats = CacheStats()
        self._nodes: dict[bytes, _Node] = {}
        self._evictable: OrderedDict[bytes, _Node] = OrderedDict()
        self._events: list[CacheEvent] = []
        self._epoch = 0
        self._namespaces: dict[str, tuple[HashScheme, bytes | None]] = {}

    def _namespace(self, lora_name: str | None) -> tuple[HashScheme, bytes | None]:
        """The scheme and chain root of an adapter's pages (the cache's own for None)."""
        if lora_name is None:
            return self.scheme, None
        found = self._namespaces.get(lora_name)
        if found is None:
            scheme = self.scheme
            if isinstance(scheme, VLLMSha256CborHash):
                adapter = VLLMSha256CborHash(seed=scheme.seed, extra_keys=(lora_name,))
                adapter.none_hash = scheme.none_hash  # one NONE_HASH per engine, as in vLLM
                found = (adapter, None)
            else:
                found = (scheme, hashlib.sha256(f"kvevents-lora\x00{lora_name}".encode()).digest())
            self._namespaces[lora_name] = found
        return found

    def _event_extras(
        self, per_page: list[Any] | None, pages: int, lora_name: str | None
    ) -> list[Any] | None:
        """Each page's ``extra_keys`` as vLLM publishes them: the adapter's name first."""
        if lora_name is None or not isinstance(self.scheme, VLLMSha256CborHash):
            return per_page
        own = per_page if per_page is not None else [None] * pages
        return [[lora_name, *(keys or [])] for keys in own]

    def __len__(self) -> int:
        """Pages cached now."""
        return len(self._nodes)

    @property
    def pinned(self) -> int:
        """Pages pinned by running admissions."""
        return len(self._nodes) - len(self._evictable)

    def match(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        lora_name: str | None = None,
    ) -> int:
        """Tokens of the longest cached prefix of ``token_ids`` the engine reuses, in whole
        pages (at most every page but a page-aligned prompt's last); no side effects."""
        tokens = tokens_to_array(token_ids)
        digests, _ = self._digests(tokens, cache_salt, extra_keys, lora_name)
        matched = 0
        for digest in digests:
            if digest not in self._nodes:
                break
            matched += 1
        return self._hit(digests, matched, len(tokens)) * self.page_size

    def _hit(self, digests: Sequence[bytes], matched: int, n_tokens: int) -> int:
        """Pages reused of a prompt of ``n_tokens`` tokens whose first ``matched`` pages are
        cached: at most the reusable ones (:mod:`kvevents.index.reusable`), then a hybrid
        model's window rule from that capped length, as vLLM applies them."""
        return self._window_hit(digests, min(matched, reusable_blocks(n_tokens, self.page_size)))

    def _digests(
        self,
        tokens: array[int],
        salt: str | None,
        extra_keys: Sequence[Any] | None,
        lora_name: str | None = None,
    ) -> tuple[list[bytes], list[Any] | None]:
        """The pages' digests and, when any page has extra keys, each page's (vLLM's order;
        the adapter's name is not among them: it picks the namespace, :meth:`_namespace`)."""
        page = self.page_size
        scheme, root = self._namespace(lora_name)
        salt = salt or None  # vLLM adds a salt to the first block only when it is non-empty
        if salt is None and not extra_keys:
            return scheme.page_digests(tokens, page, root), None
        n = len(tokens) // page
        per_page: list[Any] = [
            list(extra_keys[i]) if extra_keys and i < len(extra_keys) and extra_keys[i] else None
            for i in range(n)
        ]
        if salt is not None and n:
            per_page[0] = [*(per_page[0] or []), salt]
        digests: list[bytes] = []
        parent: bytes | None = root
        for i in range(n):
            block = tokens[i * page : (i + 1) * page]
            if isinstance(scheme, VLLMSha256CborHash):
                # vLLM hashes a block's extra keys inside its tuple: (adapter, *images, salt)
                keys = (*(scheme.extra_keys or ()), *(per_page[i] or ()))
                d = scheme.block_digest(block, parent, keys or None)
            else:
                d = scheme.page_digests(block, page, parent)[0]
                if per_page[i]:
                    d = hashlib.sha256(d + msgspec.msgpack.encode(per_page[i])).digest()
            digests.append(d)
            parent = d
        return digests, per_page

    def _window_hit(self, digests: Sequence[bytes], matched: int) -> int:
        """Pages a hybrid model reuses of a full-attention prefix of ``matched`` pages."""
        need = self.window_pages
        if not need:
            return matched
        window = self._window
        run = 0
        for i in range(matched - 1, -1, -1):
            if digests[i] in window:
                run += 1
                if run >= need:
                    return i + need
            else:
                run = 0
        return run

    def admit(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        lora_name: str | None = None,
        lora_id: int | None = None,
    ) -> Admission:
        """Match the longest cached prefix, pin it, insert the remaining full pages and pin them.

        The admission's ``cached_tokens`` are the pages reused (:meth:`match`): a
        page-aligned prompt's last page is computed again, though cached and pinned.

        Evicts least-recently-used unpinned leaves when room is needed, recording one
        ``BlockRemoved`` for them, then one ``BlockStored`` for the inserted chain (and,
        in hybrid mode, the sliding-window group's stores; see the module docstring).
        ``cache_salt`` and ``extra_keys`` (one entry per page) name the pages as vLLM's do;
        ``lora_name`` runs the request under that adapter (see the module docstring).
        """
        tokens = tokens_to_array(token_ids)
        page = self.page_size
        digests, per_page = self._digests(tokens, cache_salt, extra_keys, lora_name)
        per_page = self._event_extras(per_page, len(digests), lora_name)
        lora = (lora_name, lora_id)
        nodes = self._nodes
        pinned: list[_Node] = []
        for digest in digests:
            node = nodes.get(digest)
            if node is None:
                break
            self._pin(node)
            pinned.append(node)
        matched = len(pinned)
        wanted = len(digests) - matched
        if wanted > self.capacity - len(nodes):
            self._evict(wanted - (self.capacity - len(nodes)))
        new = digests[matched : matched + min(wanted, self.capacity - len(nodes))]
        hit = self._hit(digests, matched, len(tokens))
        if new:
            extras = None if per_page is None else per_page[matched : matched + len(new)]
            self._insert_chain(
                new, pinned, tokens[matched * page : (matched + len(new)) * page], extras, lora
            )
        if self.window_pages:
            self._store_window(digests[: matched + len(new)], hit, tokens, per_page, lora)
        stats = self.stats
        stats.admissions += 1
        stats.prompt_tokens += len(tokens)
        stats.cached_tokens += hit * page
        return Admission(len(tokens), hit * page, len(new), pinned, self._epoch)

    def _store_window(
        self,
        digests: list[bytes],
        hit: int,
        tokens: array[int],
        per_page: list[Any] | None,
        lora: tuple[str | None, int | None] = (None, None),
    ) -> None:
        """The sliding-window group stores the prompt's last window pages it lacks.

        One ``BlockStored`` per run of missing pages; the first run's tokens start at the
        first page the request computed (``hit``), as vLLM's do, so it may carry more
        pages of tokens than hashes (the pages that already left the window).
        """
        end = len(digests)
        window = self._window
        page = self.page_size
        start = max(hit, end - self.window_pages)
        i = start
        first = True
        while i < end:
            if digests[i] in window:
                i += 1
                first = False
                continue
            j = i
            while j < end and digests[j] not in window:
                j += 1
            tokens_from = hit if first else i
            parent = None if tokens_from == 0 else self._nodes[digests[tokens_from - 1]].event_hash
            run = digests[i:j]
            window.update(run)
            self._events.append(
                BlockStored(
                    block_hashes=[self._nodes[d].event_hash for d in run],
                    parent_block_hash=parent,
                    token_ids=tokens[tokens_from * page : j * page].tolist(),
                    block_size=page,
                    lora_id=lora[1],
                    lora_name=lora[0],
                    medium=self.medium,
                    extra_keys=None if per_page is None else per_page[i:j],
                    group_idx=0,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=self.sliding_window,
                )
            )
            first = False
            i = j

    def release(self, admission: Admission) -> None:
        """Unpin an admission's pages (leaf first). Idempotent; a no-op after a flush."""
        if admission._epoch != self._epoch:
            admission._pinned = []
            return
        evictable = self._evictable
        for node in reversed(admission._pinned):
            node.refs -= 1
            if node.refs == 0:
                evictable[node.digest] = node
        admission._pinned = []

    def flush(self) -> None:
        """Drop every page, pinned or not, and record ``AllBlocksCleared``.

        Admissions made before the flush release nothing afterwards.
        """
        self._nodes = {}
        self._evictable = OrderedDict()
        self._window = set()
        self._epoch += 1
        self.stats.flushes += 1
        self._events.append(AllBlocksCleared())

    def take_events(self) -> list[CacheEvent]:
        """The events recorded since the last call, in order; the record is emptied."""
        events, self._events = self._events, []
        return events

    def block_hashes(self) -> list[int]:
        """The engine hash of every cached page (the events' ``block_hashes`` values)."""
        return [node.event_hash for node in self._nodes.values()]

    def check_invariants(self) -> None:
        """Assert invariants 1-4 of the module docstring. O(pages); for tests."""
        nodes = self._nodes
        assert len(nodes) <= self.capacity, "more pages than capacity"
        children: dict[bytes, int] = dict.fromkeys(nodes, 0)
        for node in nodes.values():
            if node.parent is not None:
                assert nodes.get(node.parent.digest) is node.parent, "parent not cached"
                assert node.parent.refs >= node.refs, "child pinned more than its parent"
                children[node.parent.digest] += 1
        assert self._window <= nodes.keys(), "sliding-window page not cached"
        for digest, node in nodes.items():
            assert node.children == children[digest], "child count out of date"
            assert (node.refs == 0) == (digest in self._evictable), "evictable set out of date"
        seen: set[bytes] = set()
        for digest, node in self._evictable.items():
            assert nodes.get(digest) is node, "evictable page not cached"
            parent = node.parent
            while parent is not None:
                assert parent.digest not in seen, "evictable order puts an ancestor first"
                parent = parent.parent
            seen.add(digest)

    # --- internals ---------------------------------------------------------------------

    def _pin(self, node: _Node) -> None:
        if node.refs == 0:
            del self._evictable[node.digest]
        node.refs += 1

    def _evict(self, count: int) -> None:
        evictable, nodes = self._evictable, self._nodes
        removed: list[int] = []
        window_removed: list[int | bytes] = []
        window = self._window
        while len(removed) < count and evictable:
            digest, node = evictable.popitem(last=False)
            assert node.children == 0, "evictable order broken: first entry is not a leaf"
            del nodes[digest]
            if node.parent is not None:
                node.parent.children -= 1
            removed.append(node.event_hash)
            if digest in window:
                window.discard(digest)
                window_removed.append(node.event_hash)
        if window_removed:
            self._events.append(
                BlockRemoved(block_hashes=list(window_removed), medium=self.medium, group_idx=0)
            )
        if removed:
            self.stats.blocks_evicted += len(removed)
            self._events.append(
                BlockRemoved(
                    block_hashes=list(removed),
                    medium=self.medium,
                    group_idx=1 if self.window_pages else None,
                )
            )

    def _insert_chain(
        self,
        digests: list[bytes],
        pinned: list[_Node],
        tokens: array[int],
        extras: list[Any] | None = None,
        lora: tuple[str | None, int | None] = (None, None),
    ) -> None:
        parent = pinned[-1] if pinned else None
        event_hash = self.scheme.event_hash
        nodes = self._nodes
        hashes: list[int | bytes] = []
        for digest in digests:
            node = _Node(digest, event_hash(digest), parent)
            node.refs = 1
            nodes[digest] = node
            if parent is not None:
                parent.children += 1
            pinned.append(node)
            hashes.append(node.event_hash)
            parent = node
        first_parent = pinned[-len(digests) - 1] if len(pinned) > len(digests) else None
        self.stats.blocks_stored += len(digests)
        self._events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None if first_parent is None else first_parent.event_hash,
                token_ids=tokens.tolist(),
                block_size=self.page_size,
                lora_id=lora[1],
                lora_name=lora[0],
                medium=self.medium,
                extra_keys=extras,
                group_idx=1 if self.window_pages else None,
                kv_cache_spec_kind="full_attention" if self.window_pages else None,
            )
        )
