"""Held writes leave at the end of the loop's round, in order, and never after a close.

Each test wraps the transport of a real socket pair on a real event loop (asyncio's and
uvloop's, as the router serves on uvloop) and reads the other end without blocking, so
"not yet written" is what the peer socket really has.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop

from kvevents.http.held_writes import HeldWrites

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


class _Pair:
    """One end as an asyncio transport (wrapped), the other a plain non-blocking socket."""

    def __init__(self, held: HeldWrites, peer: socket.socket) -> None:
        self.held, self.peer = held, peer

    def received(self) -> bytes:
        """Everything the peer can read now (b"" when nothing arrived)."""
        out = b""
        while True:
            try:
                chunk = self.peer.recv(65536)
            except BlockingIOError:
                return out
            if not chunk:
                return out
            out += chunk

    async def arrived(self, expected: bytes) -> bytes:
        """Read until ``expected``'s length is in (bounded: 5 s)."""
        got = b""
        deadline = asyncio.get_running_loop().time() + 5.0
        while len(got) < len(expected):
            assert asyncio.get_running_loop().time() < deadline, f"only {got!r} arrived"
            got += self.received()
            await asyncio.sleep(0.005)
        return got


_PEERS: list[socket.socket] = []
"""The plain ends of this test's pairs, closed when its loop is done (:func:`_run`)."""


async def _pair() -> _Pair:
    ours, peer = socket.socketpair()
    _PEERS.append(peer)
    peer.setblocking(False)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_connection(asyncio.Protocol, sock=ours)
    return _Pair(HeldWrites(transport, loop), peer)


def _run(which: str, test: Callable[[], Awaitable[None]]) -> None:
    try:
        with asyncio.Runner(loop_factory=LOOPS[which]) as runner:
            runner.run(test())
    finally:
        while _PEERS:
            _PEERS.pop().close()


async def _a_turn() -> None:
    """Let the loop run what is scheduled now (the end-of-round callback among it)."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


@pytest.mark.parametrize("which", LOOPS)
def test_held_data_leaves_at_the_end_of_the_round_in_one_piece(which: str) -> None:
    async def go() -> None:
        pair = await _pair()
        pair.held.hold(b"first answer|")
        pair.held.hold(b"second answer")
        assert pair.held.holding == len(b"first answer|second answer")
        assert pair.held.get_write_buffer_size() >= pair.held.holding
        await asyncio.sleep(0.05)  # the round is not over until the loop turns...
        assert pair.received() == b"first answer|second answer"  # ...and it has
        assert pair.held.holding == 0
        pair.held.close()

    _run(which, go)


@pytest.mark.parametrize("which", LOOPS)
def test_nothing_is_written_before_the_round_ends(which: str) -> None:
    async def go() -> None:
        pair = await _pair()
        pair.held.hold(b"answer")
        for _ in range(3):  # other work of this round: the peer has nothing yet
            assert pair.received() == b""
        await _a_turn()
        assert await pair.arrived(b"answer") == b"answer"
        pair.held.close()

    _run(which, go)


@pytest.mark.parametrize("which", LOOPS)
def test_a_write_after_held_data_never_overtakes_it(which: str) -> None:
    """hold, write, hold, writelines: the peer reads them in the order given."""

    async def go() -> None:
        pair = await _pair()
        pair.held.hold(b"1 held|")
        pair.held.write(b"2 written|")
        pair.held.hold(b"3 held|")
        pair.held.writelines([b"4 ", b"lines|"])
        pair.held.hold(b"5 held")
        expected = b"1 held|2 written|3 held|4 lines|5 held"
        assert await pair.arrived(expected) == expected
        pair.held.close()

    _run(which, go)


@pytest.mark.parametrize("which", LOOPS)
def test_close_writes_what_is_held_first_and_abort_drops_it(which: str) -> None:
    async def go() -> None:
        closing = await _pair()
        closing.held.hold(b"the last answer")
        closing.held.close()
        assert await closing.arrived(b"the last answer") == b"the last answer"
        await _a_turn()
        assert closing.peer.recv(1) == b""  # then the connection's end
        aborted = await _pair()
        aborted.held.hold(b"never sent")
        aborted.held.abort()
        await asyncio.sleep(0.05)
        assert aborted.received() == b""
        assert aborted.held.holding == 0

    _run(which, go)


def test_one_round_releases_every_connection_and_a_closed_one_is_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Four connections hold in one round; one is closed under it (its data goes
    nowhere, as a write to a closing transport does) and one raises when written:
    the others' answers still leave, and the failure is logged. On asyncio's loop only:
    uvloop's transport is a C type, whose ``write`` a test cannot replace."""

    async def go() -> None:
        first, gone, broken, last = [await _pair() for _ in range(4)]
        first.held.hold(b"first")
        gone.held.hold(b"dropped")
        broken.held.hold(b"raises")
        last.held.hold(b"last")
        gone.held.transport.close()  # closed by the other side of the code, not by us

        def refuse(data: Any) -> None:
            raise RuntimeError("this transport cannot write")

        broken.held.transport.write = refuse  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger="kvevents.http.held_writes"):
            await _a_turn()
        assert await first.arrived(b"first") == b"first"
        assert await last.arrived(b"last") == b"last"
        assert "writing held data failed" in caplog.text
        await asyncio.sleep(0.05)
        assert gone.received() == b""
        for pair in (first, last, broken):
            pair.held.transport.abort()

    _run("asyncio", go)


@pytest.mark.parametrize("which", LOOPS)
def test_the_wrapper_passes_the_transport_through(which: str) -> None:
    async def go() -> None:
        pair = await _pair()
        transport = pair.held.transport
        assert pair.held.get_extra_info("socket") is not None
        assert pair.held.get_extra_info("no-such-info", "default") == "default"
        assert pair.held.is_closing() is False
        pair.held.pause_reading()
        pair.held.resume_reading()
        assert pair.held.get_protocol() is transport.get_protocol()  # via __getattr__
        pair.held.close()
        assert pair.held.is_closing() is True

    _run(which, go)
