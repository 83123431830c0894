"""Predictions against a plain model of them, over random operations on a shared clock.

The model keeps one deadline per (block, slot) pair in one dict and derives the masks
and the count from it; :class:`~kvevents.index.predictions.Predictions` keeps them per
slot with a running count. After every operation both must agree on the masks, the
count, every stat and what the operation returned.
"""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.index.predictions import Predictions, PredictionStats

TTL = 2.0


class Model:
    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.until: dict[tuple[int, int], float] = {}
        self.queue: deque[tuple[float, int, list[int]]] = deque()
        self.stats = PredictionStats()

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
        n = sum(self.until.pop((k, slot), None) is not None for k in keys)
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


_slot = st.integers(0, 5)
_keys = st.lists(st.integers(0, 12), max_size=8)
_op = st.one_of(
    st.tuples(st.just("add"), _slot, _keys, st.integers(0, 10)),
    st.tuples(st.just("confirm"), _slot, _keys),
    st.tuples(st.just("withdraw"), st.integers(0, 40)),
    st.tuples(st.just("expire"), st.floats(0.0, 1.5)),
    st.tuples(st.just("shrink"), st.integers(0, 10)),
    st.tuples(st.just("clear"), _slot),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_op, max_size=60))
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
