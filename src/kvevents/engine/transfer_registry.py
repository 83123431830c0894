"""What a prefill engine holds for decode engines to take: one simulated KV hand-off per key.

The KV transfer is simulated, so what is handed over is what a decode needs to act it
out: each prompt's token ids (to check that it decodes the prompt that was prefilled,
and to store its blocks), how many full blocks were computed, and the prefill's DP rank
(for ``disagg_prefill_dp_rank``). A key is an SGLang ``bootstrap_room`` (an int) or a
vLLM ``remote_request_id`` (a str); the types keep the two apart.

Each key moves through these states (a decode may come before its prefill)::

    absent --take--> WAITING --reserve--> RUNNING --complete--> READY --take--> TAKEN
    absent --reserve--> RUNNING --fail--> FAILED        READY --timeout--> EXPIRED

Invariants:

* a key is reserved at most once while it is known: a second :meth:`~TransferRegistry.reserve`
  raises (409), so two prefills with one room never overwrite each other;
* a key is taken at most once: a second :meth:`~TransferRegistry.take` raises (409);
* nothing outlives the timeout: READY becomes EXPIRED after ``timeout`` seconds
  unfetched; TAKEN, FAILED and EXPIRED are kept ``timeout`` seconds more (so a late or
  repeated take gets a clear answer, not a wait), then dropped; a WAITING key is dropped
  when its last waiter gives up. A waiter waits at most what it asked.

Timers are the event loop's (``call_later``): the registry lives in one asyncio loop, the
engine's, and is used only from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvevents.errors import KVEventsError
from kvevents.types import StrEnum

__all__ = ["DisaggregationError", "PromptKV", "Transfer", "TransferKey", "TransferRegistry"]

TransferKey = int | str
"""An SGLang ``bootstrap_room`` (int) or a vLLM ``remote_request_id`` (str)."""


class DisaggregationError(KVEventsError):
    """A disaggregated request refused or failed; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class PromptKV(msgspec.Struct, frozen=True):
    """One prompt as prefilled: its token ids and the full blocks computed for it."""

    token_ids: list[int]
    block_count: int


class Transfer(msgspec.Struct, frozen=True):
    """What a decode takes for one key: the prefill engine, its rank, the prompts."""

    engine_id: str
    dp_rank: int
    page_size: int
    prompts: list[PromptKV]


def describe(key: TransferKey) -> str:
    """``room 42`` or ``request id 'abc'``, as error messages name a key."""
    return f"room {key}" if isinstance(key, int) else f"request id {key!r}"


class _State(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    READY = "ready"
    TAKEN = "taken"
    FAILED = "failed"
    EXPIRED = "expired"


@dataclass(eq=False)
class _Slot:
    state: _State
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the slot leaves WAITING and RUNNING (never cleared)."""
    transfer: Transfer | None = None
    error: str = ""
    waiters: int = 0
    timer: asyncio.TimerHandle | None = None


class TransferRegistry:
    """The keys of one prefill engine (see the module docstring); ``timeout`` in seconds."""

    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"TransferRegistry: timeout={timeout!r} must be > 0 seconds")
        self.timeout = timeout
        self._slots: dict[TransferKey, _Slot] = {}

    def __len__(self) -> int:
        """Keys known now, tombstones and waiting decodes included."""
        return len(self._slots)

    def reserve(self, key: TransferKey) -> None:
        """Claim ``key`` for a prefill that is about to run; 409 if it is already known."""
        slot = self._slots.get(key)
        if slot is None:
            self._slots[key] = _Slot(_State.RUNNING)
        elif slot.state is _State.WAITING:
            slot.state = _State.RUNNING
        else:
            raise DisaggregationError(
                f"{describe(key)} is already registered on this prefill engine ({slot.state}): "
                "every request needs a new random bootstrap_room",
                409,
            )

    def complete(self, key: TransferKey, transfer: Transfer) -> None:
        """The prefill of a reserved ``key`` is done: hand ``transfer`` to its decode."""
        slot = self._running(key)
        if slot is not None:
            slot.state, slot.transfer = _State.READY, transfer
            slot.settled.set()
            self._later(key, slot, self._expire)

    def fail(self, key: TransferKey, error: str) -> None:
        """The prefill of a reserved ``key`` failed: its decode is told ``error`` at once."""
        slot = self._running(key)
        if slot is not None:
            slot.state, slot.error = _State.FAILED, error
            slot.settled.set()
            self._later(key, slot, self._drop)

    async def take(self, key: TransferKey, wait: float) -> Transfer:
        """The transfer of ``key``, waiting up to ``wait`` s for its prefill; once only.

        Raises :class:`DisaggregationError`: 404 when no prefill registered the key (or
        finished it) in time, 409 when it was taken already, 410 when it expired
        unfetched, 502 when its prefill failed.
        """
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot(_State.WAITING)
        slot.waiters += 1
        try:
            if not slot.settled.is_set():
                try:
                    await asyncio.wait_for(slot.settled.wait(), max(0.0, wait))
                except asyncio.TimeoutError:
                    what = (
                        "its prefill is still running"
                        if slot.state is _State.RUNNING
                        else "no prefill registered it"
                    )
                    raise DisaggregationError(
                        f"{describe(key)}: {what} after {wait:g} s", 404
                    ) from None
        finally:
            slot.waiters -= 1
            if slot.state is _State.WAITING and not slot.waiters and self._slots.get(key) is slot:
                del self._slots[key]
        if slot.state is _State.READY:
            transfer = slot.transfer
            assert transfer is not None
            slot.state, slot.transfer = _State.TAKEN, None
            self._later(key, slot, self._drop)
            return transfer
        if slot.state is _State.TAKEN:
            raise DisaggregationError(
                f"{describe(key)} was already taken by another decode: each is taken once",
                409,
            )
        if slot.state is _State.EXPIRED:
            raise DisaggregationError(
                f"{describe(key)} expired: nobody took it within {self.timeout:g} s of its "
                "prefill (kvevents engine --disaggregation-timeout)",
                410,
            )
        raise DisaggregationError(f"the prefill of {describe(key)} failed: {slot.error}", 502)

    def close(self) -> None:
        """Forget every key and cancel the timers (the engine is stopping)."""
        for slot in self._slots.values():
            if slot.timer is not None:
                slot.timer.cancel()
        self._slots.clear()

    def _running(self, key: TransferKey) -> _Slot | None:
        slot = self._slots.get(key)
        return slot if slot is not None and slot.state is _State.RUNNING else None

    def _later(
        self, key: TransferKey, slot: _Slot, then: Callable[[TransferKey, _Slot], None]
    ) -> None:
        if slot.timer is not None:
            slot.timer.cancel()
        slot.timer = asyncio.get_running_loop().call_later(self.timeout, then, key, slot)

    def _expire(self, key: TransferKey, slot: _Slot) -> None:
        if self._slots.get(key) is slot and slot.state is _State.READY:
            slot.state, slot.transfer = _State.EXPIRED, None
            self._later(key, slot, self._drop)

    def _drop(self, key: TransferKey, slot: _Slot) -> None:
        if self._slots.get(key) is slot:
            del self._slots[key]
