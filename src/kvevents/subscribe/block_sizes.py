"""Block sizes: what each holder's configuration says, what its events say, and mismatches.

A consumer keys blocks by content over ``block_size`` tokens, so a stream at another size
than expected can never match a request: a wrong ``--block-size`` or two engines with
different page sizes would make every lookup a silent miss. :class:`BlockSizes` holds the
*expected* size with its source (one for all holders with ``shared=True``, the router's
case; one per holder for ``kvevents watch``; the first known wins), the sizes a
configuration, ``/server_info`` or a vLLM's ``/metrics`` *declares*
(:meth:`BlockSizes.declare`), and the ``block_size`` every stored chain *shows*
(:meth:`BlockSizes.check`).

Each disagreement is logged once per (holder, source, size), naming both sizes and
sources, and counted in :attr:`BlockSizes.mismatches`. :meth:`BlockSizes.check` returns
the batch without the mismatching ``BlockStored`` events: blocks keyed at another size
are reachable by no request. Offload copies (no tokens) carry no size and pass.

A fleet restarted at another page size is followed only when the expected size came
from the engines, not from an operator: once the engines declare the new size and every
:attr:`BlockSizes.followed` holder agrees, it becomes the expected one and ``on_change``
lets the router drop what it keyed at the old size. Events alone never change it,
because one vLLM stream may carry chains of two sizes (KV-cache groups with different
block sizes). O(events) per batch; not thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import msgspec

from kvevents.types import Holder
from kvevents.wire.events import BlockStored, KVEventBatch

__all__ = ["ENGINE_SOURCES", "BlockSizeMismatch", "BlockSizes"]

log = logging.getLogger("kvevents.subscribe.block_sizes")

ENGINE_SOURCES = frozenset({"server_info", "metrics"})
"""Declaring sources that are the engines' own word (``/server_info``; a vLLM's
``vllm:cache_config_info`` in ``/metrics``): a size first known from them is followed
when the engines change it."""


class BlockSizeMismatch(msgspec.Struct, kw_only=True):
    """One kind of disagreement for one holder, and how often it was seen.

    ``source`` is "events" (``count`` = BlockStored events skipped), or the declaring
    source ("configured", "server_info", "metrics"; ``count`` = declarations).
    """

    worker: str
    dp_rank: int
    source: str
    expected: int
    expected_from: str
    observed: int
    count: int = 0


class BlockSizes:
    """Expected, declared and observed block sizes; see the module docstring."""

    def __init__(
        self, *, shared: bool, size: int | None = None, source: str = "configured"
    ) -> None:
        if size is not None and size < 1:
            raise ValueError(f"BlockSizes: size={size} must be a positive int")
        self.shared = shared
        self._shared: tuple[int, str] | None = None if size is None else (size, source)
        self._per_holder: dict[Holder, tuple[int, str]] = {}
        self._engine_said = size is None
        """Whether the shared size came from the engines (then a fleet-wide change is
        followed) rather than from an operator."""
        self.observed: dict[Holder, int] = {}
        self.declared: dict[Holder, int] = {}
        """Per holder, the size it was last declared with (since its last reset)."""
        self._seen: dict[Holder, set[int]] = {}
        """Per holder, the sizes of the chains it stored since its last reset."""
        self.mismatches: dict[tuple[Holder, str, int], BlockSizeMismatch] = {}
        self.followed: Callable[[], Iterable[Holder]] | None = None
        """The holders a shared size must agree with before it changes (None: never changes)."""
        self.on_change: Callable[[int], None] | None = None
        """Called with the new shared size once the holders changed to it."""
        self.changes = 0
        """Times the shared size followed the holders to a new one."""

    # --- the expected size ------------------------------------------------------------

    def expected(self, holder: Holder | None = None) -> tuple[int, str] | None:
        """The expected size and its source (the shared one, or ``holder``'s)."""
        if self.shared or holder is None:
            return self._shared
        return self._per_holder.get(holder)

    @property
    def size(self) -> int | None:
        """The shared expected size (None until known)."""
        return None if self._shared is None else self._shared[0]

    def _set_expected(self, holder: Holder, size: int, source: str) -> None:
        if self.shared:
            self._shared = (size, source)
        else:
            self._per_holder[holder] = (size, source)

    # --- declarations and observations ------------------------------------------------

    def declare(self, holder: Holder, size: int, source: str, origin: str) -> bool:
        """A configuration or ``/server_info`` states ``holder``'s size; False on a mismatch.

        ``source`` is the short kind ("configured", "server_info"); ``origin`` says it in
        words ("configured for engine X").
        """
        holder = Holder(*holder)
        self.declared[holder] = size
        expected = self.expected(holder)
        if expected is None:
            self._set_expected(holder, size, origin)
            self._engine_said = source in ENGINE_SOURCES
            return True
        if size == expected[0] or self._follow(size, origin):
            return True
        self._record(holder, source, size, expected, 1)
        return False

    def forget(self, holder: Holder) -> None:
        """``holder`` is gone or restarted: what it said before no longer holds back a
        fleet-wide change."""
        holder = Holder(*holder)
        self.declared.pop(holder, None)
        self._seen.pop(holder, None)

    def assume(self, size: int, source: str) -> None:
        """Take ``size`` as the shared size if none is known yet, as the engines' (a
        peer's snapshot: the engines may since have changed, and are then followed)."""
        if self._shared is None:
            self._shared = (size, source)

    def _follow(self, size: int, origin: str) -> bool:
        """Make ``size`` the shared one if every followed holder says it (see the module
        docstring); whether it did."""
        followed = self.followed
        if not (self.shared and self._engine_said and followed is not None):
            return False
        declared, seen = self.declared, self._seen
        for h in followed():
            said = declared.get(h)
            if said is None:
                sizes = seen.get(h)
                if sizes and (len(sizes) > 1 or size not in sizes):
                    return False
            elif said != size:
                return False
        old = self._shared
        self._shared = (size, f"{origin}, every engine changed to it")
        self.changes += 1
        log.warning(
            "block size changed from %s to %d: every engine followed now says %d (last: "
            "%s); what was keyed at the old size is dropped",
            None if old is None else old[0],
            size,
            size,
            origin,
        )
        if self.on_change is not None:
            self.on_change(size)
        return True

    def check(self, holder: Holder, batch: KVEventBatch) -> KVEventBatch:
        """``batch`` without its BlockStored events of an unexpected block size.

        The first stored chain sets the expected size when none is known yet.
        """
        expected = self.expected(holder)
        bad: list[int] = []
        seen = self._seen.get(holder)
        for i, event in enumerate(batch.events):
            if type(event) is not BlockStored or not event.token_ids:
                continue
            size = event.block_size
            if size <= 0:
                continue  # malformed: the index counts it
            self.observed[holder] = size
            if seen is None:
                seen = self._seen[holder] = set()
            seen.add(size)
            if expected is None:
                expected = (size, f"first events of {holder.worker} rank {holder.dp_rank}")
                self._set_expected(holder, *expected)
            elif size != expected[0]:
                bad.append(i)
                self._record(holder, "events", size, expected, 1)
        if not bad:
            return batch
        skip = set(bad)
        kept = [e for i, e in enumerate(batch.events) if i not in skip]
        return KVEventBatch(ts=batch.ts, events=kept, data_parallel_rank=batch.data_parallel_rank)

    def _record(
        self, holder: Holder, source: str, size: int, expected: tuple[int, str], n: int
    ) -> None:
        key = (holder, source, size)
        record = self.mismatches.get(key)
        if record is None:
            record = BlockSizeMismatch(
                worker=holder.worker,
                dp_rank=holder.dp_rank,
                source=source,
                expected=expected[0],
                expected_from=expected[1],
                observed=size,
            )
            self.mismatches[key] = record
            what = (
                "sends BlockStored events with block_size"
                if source == "events"
                else f"is declared ({source}) with block_size"
            )
            consequence = (
                "; those events are skipped (their blocks could never match a request) — fix "
                "the configured block size or the engine's"
                if source == "events"
                else "; check the engine's page/block size and the configuration"
            )
            log.error(
                "block size mismatch: engine %s rank %d %s %d, but %d is expected (%s)%s",
                holder.worker,
                holder.dp_rank,
                what,
                size,
                expected[0],
                expected[1],
                consequence,
            )
        record.count += n

    # --- reading ----------------------------------------------------------------------

    def for_holder(self, holder: Holder) -> dict[str, object]:
        """Expected and last observed size, and this holder's mismatches (for /workers)."""
        expected = self.expected(holder)
        return {
            "expected": None if expected is None else expected[0],
            "expected_from": None if expected is None else expected[1],
            "observed": self.observed.get(holder),
            "mismatches": [
                msgspec.structs.asdict(m) for (h, _, _), m in self.mismatches.items() if h == holder
            ],
        }

    def mismatch_events(self, holder: Holder) -> int:
        """BlockStored events of ``holder`` skipped for their block size."""
        return sum(
            m.count for (h, src, _), m in self.mismatches.items() if h == holder and src == "events"
        )
