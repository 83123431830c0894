"""Predictions against a plain model of them, over random operations on a shared clock.

The model keeps one deadline per (block, slot) pair in one dict and derives the masks
and the count from it; :class:`~kvevents.index.predictions.Predictions` keeps them per
slot with a running count. After every operation both must agree on the masks, the
count, every stat, the confirmations' ages and what the operation returned.
"""

from __future__ import annotations

from collections import deque
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.index import predictions as predictions_module
from kvevents.index.predictions import Predictions, PredictionStats
from native_support import native_core

TTL = 2.0


class Model:
    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.until: dict[tuple[int, int], float] = {}
        self.queue: deque[tuple[float, int, list[int]]] = deque()
        self.stats = PredictionStats()
        self.age_sum = self.age_max = 0.0

    def masks(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for k, slot in self.until:
            out[k] = out.get(k, 0) | 1 << slot
        return out

    def add(self, slot: int, keys: list[int], room: int) -> tuple[list[int], float]:
        deadline = self.clock[0] + TTL
        added: list[int] = []
        kept: list[int] = []
        for k in keys:
            if (k, slot) not in self.until:
                if len(added) >= room:
                    self.stats.dropped += 1
                    continue
                added.append(k)
            self.until[(k, slot)] = deadline
            kept.append(k)
        if kept:
            self.queue.append((deadline, slot, kept))
        self.stats.made += len(added)
        return added, deadline

    def _drop(self, slot: int, keys: list[int], deadline: float) -> int:
        n = 0
        for k in keys:
            d = self.until.get((k, slot))
            if d is not None and d <= deadline:
                del self.until[(k, slot)]
                n += 1
        return n

    def expire(self) -> int:
        n = 0
        while self.queue and self.queue[0][0] <= self.clock[0]:
            deadline, slot, keys = self.queue.popleft()
            n += self._drop(slot, keys, deadline)
        self.stats.expired += n
        return n

    def shrink(self, want: int) -> int:
        n = 0
        while self.queue and n < want:
            deadline, slot, keys = self.queue.popleft()
            n += self._drop(slot, keys, deadline)
        self.stats.dropped += n
        return n

    def confirm(self, slot: int, keys: list[int]) -> int:
        n = 0
        for k in keys:
            d = self.until.pop((k, slot), None)
            if d is not None:
                n += 1
                age = self.clock[0] - (d - TTL)
                self.age_sum += age
                self.age_max = max(self.age_max, age)
        self.stats.confirmed += n
        return n

    def withdraw(self, slot: int, keys: list[int], deadline: float) -> int:
        n = 0
        for k in keys:
            if self.until.get((k, slot)) == deadline:
                del self.until[(k, slot)]
                n += 1
        self.stats.withdrawn += n
        return n

    def clear_slot(self, slot: int) -> int:
        gone = [rk for rk in self.until if rk[1] == slot]
        for rk in gone:
            del self.until[rk]
        self.stats.cleared += len(gone)
        return len(gone)


_slot = st.integers(0, 3)
_keys = st.lists(st.integers(0, 6), max_size=6)
_OPS = {
    "add": st.tuples(st.just("add"), _slot, _keys, st.integers(0, 10)),
    "confirm": st.tuples(st.just("confirm"), _slot, _keys),
    "expire": st.tuples(st.just("expire"), st.sampled_from([0.0, 0.25, 0.5, 1.25, 2.5])),
    "withdraw": st.tuples(st.just("withdraw"), st.integers(0, 40)),
    "shrink": st.tuples(st.just("shrink"), st.integers(0, 10)),
    "clear": st.tuples(st.just("clear"), _slot),
}
# adds, confirmations and the clock's steps drawn more often: they must meet, so that
# confirmations of predictions of some age happen in most examples
_op = st.sampled_from(
    ["add"] * 3 + ["confirm"] * 3 + ["expire"] * 2 + ["withdraw", "shrink", "clear"]
).flatmap(_OPS.__getitem__)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(_op, min_size=4, max_size=60))
def test_predictions_agree_with_the_plain_model(ops: list[tuple]) -> None:
    clock = [100.0]
    real = Predictions(ttl_s=TTL, clock=lambda: clock[0])
    model = Model(clock)
    made: list[tuple[int, list[int], float]] = []
    for op in ops:
        kind = op[0]
        if kind == "add":
            _, slot, keys, room = op
            got = real.add(slot, keys, room)
            assert got == model.add(slot, keys, room)
            made.append((slot, *got))
        elif kind == "confirm":
            _, slot, keys = op
            assert real.confirm(slot, keys) == model.confirm(slot, keys)
        elif kind == "withdraw":
            if made:
                slot, keys, deadline = made[op[1] % len(made)]
                assert real.withdraw(slot, keys, deadline) == model.withdraw(slot, keys, deadline)
        elif kind == "expire":
            clock[0] += op[1]
            assert real.expire() == model.expire()
        elif kind == "shrink":
            assert real.shrink(op[1]) == model.shrink(op[1])
        else:
            assert real.clear_slot(op[1]) == model.clear_slot(op[1])
        assert real.masks == model.masks()
        assert real.count == len(model.until)
        assert real.stats == model.stats
        assert (real.confirm_age_sum_s, real.confirm_age_max_s) == (model.age_sum, model.age_max)


@settings(max_examples=200, deadline=None)
@given(st.lists(_op, min_size=4, max_size=60), st.sampled_from([2, 5, 1 << 16]))
def test_the_listed_changes_keep_a_native_mirror_equal_to_the_masks(
    ops: list[tuple], limit: int
) -> None:
    """The changes the predictions list, synced after every operation into the native
    core's mirror (rebuilt from the masks when more went unread than are listed), keep
    it equal to their masks."""
    mirror = native_core().MaskMirror(1)
    clock = [100.0]
    real = Predictions(ttl_s=TTL, clock=lambda: clock[0])
    made: list[tuple[int, list[int], float]] = []
    with mock.patch.object(predictions_module, "_CHANGED_LIMIT", limit):
        for op in ops:
            kind = op[0]
            if kind == "add":
                added = real.add(*op[1:])
                made.append((op[1], *added))
            elif kind == "confirm":
                real.confirm(op[1], op[2])
            elif kind == "withdraw" and made:
                real.withdraw(*made[op[1] % len(made)])
            elif kind == "expire":
                clock[0] += op[1]
                real.expire()
            elif kind == "shrink":
                real.shrink(op[1])
            elif kind == "clear":
                real.clear_slot(op[1])
            changes = real.take_changes()
            if changes is None:
                mirror.rebuild(real.masks)
            elif changes[0]:
                mirror.sync(*changes)
            assert sorted(mirror.items()) == sorted(real.masks.items())
            assert mirror.count == len(real.masks)
