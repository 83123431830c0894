"""The prefix index: which holder caches which blocks, in which tier.

* :mod:`~kvevents.index.prefix_index`: :class:`PrefixIndex` (apply events, match
  requests) and :func:`namespace_key`;
* :mod:`~kvevents.index.mask_table`: its storage, a flat dict of per-block holder
  bitmasks, and the hot loops over it;
* :mod:`~kvevents.index.predictions`: predicted entries, a side table of blocks a
  holder is expected to store soon (the router's sibling bursts);
* :mod:`~kvevents.index.types`: tiers, credits, counters and match results;
* :mod:`~kvevents.index.reusable`: the most blocks an engine reuses of a prompt (a
  block-aligned prompt's last block is recomputed);
* :mod:`~kvevents.index.snapshot`: the index's state as bytes and back (``/dump``).

The index knows events and holders, never sockets: it imports ``wire`` and ``types``
only.
"""

from kvevents.index.prefix_index import DEFAULT_MAX_ENTRIES, PrefixIndex, namespace_key
from kvevents.index.types import HolderMatch, IndexStats, PrefixMatch, Tier, TierCredits

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "HolderMatch",
    "IndexStats",
    "PrefixIndex",
    "PrefixMatch",
    "Tier",
    "TierCredits",
    "namespace_key",
]
