"""A rank's steps keep the simulated hardware's pace however late its process wakes up.

The rank's loop (``kvevents.engine.rank._RankServer``) is driven here with a clock of the
test's and a control socket stand-in whose every wait ends later than asked, as a loaded
host's does: a request's answer must still leave when its steps' simulated time is over,
not one late wake-up per step later.
"""

from __future__ import annotations

import math
import os
from collections import deque
from typing import Any

import msgspec
import zmq

from kvevents.engine.rank import RankSpec, _RankServer

STEP_S = 0.001  # --decode-steps-per-s 1000
LATE_S = 0.0004  # each wait on the control socket ends this much after it should


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Dealer:
    """The control socket as the rank uses it: ``poll`` waits on the test's clock until a
    message is due (at its time) or, none being due, for the time asked and ``LATE_S``
    more; answers are recorded with their time. Once request ``last`` is answered, a
    shutdown is queued."""

    def __init__(self, clock: _Clock, messages: list[tuple[float, dict[str, Any]]], last: int):
        self.clock = clock
        self.queued = deque((at, msgspec.msgpack.encode(m)) for at, m in messages)
        self.last = last
        self.sent: list[tuple[float, dict[str, Any]]] = []

    def poll(self, timeout_ms: int) -> bool:
        clock = self.clock
        if self.queued and self.queued[0][0] <= clock.now + timeout_ms / 1000:
            clock.now = max(clock.now, self.queued[0][0])
            return True
        clock.now += timeout_ms / 1000 + (LATE_S if timeout_ms else 0.0)
        return False

    def recv(self, flags: int = 0) -> bytes:
        if not self.queued or self.queued[0][0] > self.clock.now:
            raise zmq.Again
        return self.queued.popleft()[1]

    def send(self, frame: bytes) -> None:
        message = msgspec.msgpack.decode(frame)
        self.sent.append((self.clock.now, message))
        if message.get("id") == self.last:
            shutdown = msgspec.msgpack.encode({"id": 0, "op": "shutdown"})
            self.queued.append((self.clock.now, shutdown))

    def answered(self, request: int) -> float:
        """When request ``request`` was answered (it must have been, once, 200)."""
        (at, message), *more = [(at, m) for at, m in self.sent if m.get("id") == request]
        assert not more and message["ok"] is True
        return at


class _Publisher:
    def publish(self, batch: Any) -> None:
        pass


def _rank(clock: _Clock, dealer: _Dealer) -> _RankServer:
    spec = RankSpec(
        dp_rank=0,
        control="inproc://unused",
        token="t",
        kv_events_config={"publisher": "null"},
        page_size=16,
        max_blocks=1024,
        prefill_tokens_per_s=math.inf,
        decode_steps_per_s=1 / STEP_S,
    )
    return _RankServer(spec, dealer, _Publisher(), clock=clock)  # type: ignore[arg-type]


def _generate(request: int, tokens: int) -> dict[str, Any]:
    prompt = list(range(request * 100, request * 100 + 64))
    return {"id": request, "op": "generate", "input_ids": prompt, "max_new_tokens": tokens}


def test_a_request_decodes_in_its_steps_simulated_time_though_every_wake_up_is_late() -> None:
    """A 100-token request at 1,000 steps/s is answered 99 simulated steps after it was
    admitted (its first token comes with its admission), within one late wake-up, though
    every wait of the loop ended late: the lateness does not add up step after step."""
    clock = _Clock()
    began = clock.now
    dealer = _Dealer(clock, [(began, _generate(1, 100))], last=1)
    rank = _rank(clock, dealer)
    rank.serve(os.getppid())
    at = dealer.answered(1)
    decoding = 99 * STEP_S
    assert began + decoding <= at <= began + decoding + STEP_S + LATE_S + 1e-9
    assert rank.running is False


def test_a_rank_that_went_idle_starts_its_next_request_when_it_arrives() -> None:
    """A request arriving while the rank is idle is answered no sooner than its own steps'
    simulated time after its arrival: the schedule of the earlier work, which ended
    before, is not caught up on."""
    clock = _Clock()
    began = clock.now
    second = began + 0.030  # the first one is done by then
    dealer = _Dealer(clock, [(began, _generate(1, 2)), (second, _generate(2, 100))], last=2)
    _rank(clock, dealer).serve(os.getppid())
    assert dealer.answered(1) < second
    decoding = 99 * STEP_S
    assert second + decoding <= dealer.answered(2) <= second + decoding + STEP_S + LATE_S + 1e-9
