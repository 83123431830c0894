"""The demo's SIGINT/SIGTERM handling: a signal never lands inside a running event loop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import anyio
import pytest

from kvevents.demo.signals import Interrupts


async def _signal_inside_a_task_group(sig: int, reached: list[str]) -> None:
    """Send ``sig`` to this process from a child task of an anyio task group, then wait."""

    async def child() -> None:
        reached.append("child")
        os.kill(os.getpid(), sig)  # the handler runs at the next bytecode, in this task
        await anyio.sleep(5)
        reached.append("not cancelled")

    async with anyio.create_task_group() as tg:
        tg.start_soon(child)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_inside_an_anyio_task_group_cancels_and_raises_keyboard_interrupt(
    sig: signal.Signals, caplog: pytest.LogCaptureFixture
) -> None:
    """A signal arriving in an anyio task group cancels the loop and surfaces as a plain KeyboardInterrupt, with nothing logged by asyncio."""
    reached: list[str] = []
    before = signal.getsignal(sig)
    with (
        caplog.at_level(logging.DEBUG, logger="asyncio"),
        Interrupts() as interrupts,
        pytest.raises(KeyboardInterrupt) as info,
    ):
        interrupts.run(_signal_inside_a_task_group(sig, reached))
    assert type(info.value) is KeyboardInterrupt  # not a BaseExceptionGroup wrapping one
    assert reached == ["child"] and interrupts.received == [sig]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert signal.getsignal(sig) is before  # restored on exit


def test_run_returns_the_result_when_no_signal_comes() -> None:
    """Without a signal, run() is asyncio.run(): it returns the coroutine's result."""

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    with Interrupts() as interrupts:
        assert interrupts.run(answer()) == 42
    assert interrupts.received == []


def test_in_synchronous_code_only_the_first_signal_raises() -> None:
    """Outside the loop the first signal raises KeyboardInterrupt where the code is; a second one is only recorded."""
    with Interrupts() as interrupts:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # not reached: the handler raises at the next bytecode
        os.kill(os.getpid(), signal.SIGTERM)
    assert interrupts.received == [signal.SIGTERM, signal.SIGTERM]


def test_signals_during_cleanup_are_deferred_to_its_end() -> None:
    """Inside deferred() a signal does not cut the block short; KeyboardInterrupt follows the block."""
    done: list[str] = []
    with Interrupts() as interrupts:
        with pytest.raises(KeyboardInterrupt), interrupts.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("cleanup finished")
        assert done == ["cleanup finished"]
        with interrupts.deferred():  # no new signal: nothing raised
            done.append("again")
    assert interrupts.received == [signal.SIGINT, signal.SIGTERM]
