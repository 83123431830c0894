"""A paged radix prefix cache that records the KV events a real engine would send.

Structure
---------
The cache holds pages (blocks) of ``page_size`` tokens. Each cached page is a node of a
radix tree whose root-to-node path is the token prefix the page completes. Because the
engine's page hash is a chain (a page's digest depends on every page before it, see
:mod:`kvevents.wire.hashing`), the digest alone names the whole path, so the tree's child
lookup is one dict probe: ``_nodes[digest]``. Each node keeps its parent and a child
count, which is all eviction needs.

Invariants (checked by :meth:`PrefixCache.check_invariants`)
------------------------------------------------------------
1. A node's parent is cached: every cached page's whole prefix is cached.
2. ``node.refs`` counts the running admissions that pin it. An admission pins a
   root-anchored path, so ``refs(parent) >= refs(child)``: a pinned node's ancestors are
   pinned, and an unpinned node has only unpinned descendants.
3. ``_evictable`` holds exactly the unpinned nodes, ordered so that every node comes
   before its ancestors. Nodes enter it at the end when their last pin is released,
   released leaf first; so the order is least recently released first, and the first
   entry is always an unpinned *leaf* (its descendants would precede it). Eviction of
   the least-recently-used unpinned leaf is therefore ``popitem(last=False)``, O(1),
   with no scan, heap or timestamp. (A heap of leaves keyed by access time, the obvious
   choice, costs O(log n) per touch and needs lazy deletion; a single recency list
   over all nodes would have to skip pinned and inner nodes.)
4. ``len(_nodes) <= capacity``.

Events
------
Every change is recorded in order, as a real engine reports it: one ``BlockStored``
per newly inserted chain (all its hashes, the parent's hash, its tokens, ``block_size``,
``medium="GPU"``), one ``BlockRemoved`` per eviction pass (the run of pages evicted to
make room for one admission, leaf first), ``AllBlocksCleared`` on :meth:`flush`.
Replaying the recorded events into an empty set of hashes reproduces exactly the pages
the cache holds.

LoRA adapters
-------------
A request run under an adapter (``admit(..., lora_name=, lora_id=)``) has its own
namespace: its pages chain from a root of their own, so the same tokens under another
adapter, or under the base model, never share a page. With the vLLM scheme the
adapter's name is hashed into every block as vLLM does (``extra_keys=(name,)``); with
SGLang's, the first page chains from a digest of the name. The adapter's
``BlockStored`` events carry ``lora_name`` and ``lora_id`` (SGLang and vLLM both send
them), and with the vLLM scheme ``extra_keys``, one ``[name]`` per block, as vLLM does.

Complexity
----------
``admit`` is O(tokens) in C (one conversion to bytes, one hash call per page) plus
O(pages) dict operations in Python; ``release`` is O(pages pinned); each evicted page
is O(1); ``flush`` is O(1) plus freeing the dicts.

When every page is pinned and the cache is full, an admission caches only the pages
that fit (possibly none); the request still runs. A simulated engine needs no
admission control for memory.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
    ) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"PrefixCache: page_size={page_size!r} must be an int >= 1")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"PrefixCache: capacity={capacity!r} must be an int >= 1 (blocks)")
        self.page_size = page_size
        self.capacity = capacity
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

    def __len__(self) -> int:
        """Pages cached now."""
        return len(self._nodes)

    @property
    def pinned(self) -> int:
        """Pages pinned by running admissions."""
        return len(self._nodes) - len(self._evictable)

    def match(self, token_ids: Sequence[int], lora_name: str | None = None) -> int:
        """Tokens of the longest cached prefix of ``token_ids``, in whole pages; no side effects."""
        scheme, root = self._namespace(lora_name)
        digests = scheme.page_digests(tokens_to_array(token_ids), self.page_size, root)
        matched = 0
        for digest in digests:
            if digest not in self._nodes:
                break
            matched += 1
        return matched * self.page_size

    def admit(
        self, token_ids: Sequence[int], lora_name: str | None = None, lora_id: int | None = None
    ) -> Admission:
        """Match the longest cached prefix, pin it, insert the remaining full pages and pin them.

        Evicts least-recently-used unpinned leaves when room is needed, recording one
        ``BlockRemoved`` for them, then one ``BlockStored`` for the inserted chain.
        ``lora_name`` runs the request under that adapter (see the module docstring).
        """
        tokens = tokens_to_array(token_ids)
        page = self.page_size
        scheme, root = self._namespace(lora_name)
        digests = scheme.page_digests(tokens, page, root)
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
        if new:
            self._insert_chain(
                new,
                pinned,
                tokens[matched * page : (matched + len(new)) * page],
                lora_name,
                lora_id,
            )
        stats = self.stats
        stats.admissions += 1
        stats.prompt_tokens += len(tokens)
        stats.cached_tokens += matched * page
        return Admission(len(tokens), matched * page, len(new), pinned, self._epoch)

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
        while len(removed) < count and evictable:
            digest, node = evictable.popitem(last=False)
            assert node.children == 0, "evictable order broken: first entry is not a leaf"
            del nodes[digest]
            if node.parent is not None:
                node.parent.children -= 1
            removed.append(node.event_hash)
        if removed:
            self.stats.blocks_evicted += len(removed)
            self._events.append(BlockRemoved(block_hashes=list(removed), medium=self.medium))

    def _insert_chain(
        self,
        digests: list[bytes],
        pinned: list[_Node],
        tokens: array[int],
        lora_name: str | None = None,
        lora_id: int | None = None,
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
        extra: list[Any] | None = None
        if lora_name is not None and isinstance(self.scheme, VLLMSha256CborHash):
            extra = [[lora_name] for _ in digests]  # vLLM: each block's extra keys
        self._events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None if first_parent is None else first_parent.event_hash,
                token_ids=tokens.tolist(),
                block_size=self.page_size,
                lora_id=lora_id,
                medium=self.medium,
                lora_name=lora_name,
                extra_keys=extra,
            )
        )
