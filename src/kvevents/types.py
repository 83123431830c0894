"""The two small value types every layer shares: who holds a cache, and an engine hash.

They live at the bottom so that the index and the router can name a holder without
knowing about sockets, and the wire can name a hash without knowing about holders.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Hash", "Holder"]

Hash = int | bytes
"""An engine block hash: int (signed or unsigned 64-bit) or 32 raw bytes."""


class Holder(NamedTuple):
    """One KV cache: the engine (URL or given name) and the data-parallel rank."""

    worker: str
    dp_rank: int
