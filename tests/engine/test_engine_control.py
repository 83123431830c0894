"""The rank-control socket trusts no peer: forged replies, identities and tokens change nothing."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from engine_support import Engine
from zmq.utils.monitor import recv_monitor_message

from kvevents.engine.rank import RankSpec
from kvevents.engine.supervisor import RankSupervisor
from kvevents.publish.config import KVEventsConfig

pytestmark = pytest.mark.slow  # every test starts rank processes

encode = msgspec.msgpack.Encoder().encode


def spec(dp_rank: int, decode_steps_per_s: float = 1000.0) -> RankSpec:
    return RankSpec(
        dp_rank=dp_rank,
        control="",
        token="",
        kv_events_config=KVEventsConfig.from_json(None).to_dict(),
        page_size=4,
        max_blocks=64,
        decode_steps_per_s=decode_steps_per_s,
    )


@asynccontextmanager
async def supervised(*specs: RankSpec) -> AsyncIterator[RankSupervisor]:
    sup = RankSupervisor(specs, startup_timeout=30.0)
    await sup.start()
    try:
        yield sup
    finally:
        await sup.stop()


def dealer(ctx: zmq.asyncio.Context, identity: bytes | None) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    return sock


def peer(ctx: zmq.asyncio.Context, endpoint: str, identity: bytes | None) -> zmq.asyncio.Socket:
    sock = dealer(ctx, identity)
    sock.connect(endpoint)
    return sock


async def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``check`` on the loop until true; fail naming ``what`` after ``timeout`` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def handshaken_peer(
    ctx: zmq.asyncio.Context, endpoint: str, identity: bytes, timeout: float = 10.0
) -> zmq.asyncio.Socket:
    """A :func:`peer` once its ZMTP handshake with the supervisor completed (watched from
    before it connects: a handshake done first would otherwise go unseen)."""
    sock = dealer(ctx, identity)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(endpoint)
        assert await monitor.poll(int(timeout * 1000)), "the peer never completed a handshake"
        event = await recv_monitor_message(monitor)  # type: ignore[misc]
        assert event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    except BaseException:
        monitor.close(linger=0)
        sock.close(linger=0)
        raise
    sock.disable_monitor()
    monitor.close(linger=0)
    return sock


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 60))


def test_malformed_replies_are_counted_and_the_loop_keeps_serving_calls() -> None:
    """Replies with a list id, a dict id, a string status, extra frames or garbage are skipped;
    the next call to the rank still gets its answer."""

    async def body() -> None:
        async with supervised(spec(0)) as sup:
            ctx = zmq.asyncio.Context()
            sock = peer(ctx, sup.control_endpoint, b"intruder")
            try:
                bad = [
                    [encode({"id": [1], "ok": True, "result": {}})],
                    [encode({"id": {"a": 1}, "ok": False, "status": "x"})],
                    [encode({"id": 1, "ok": False, "status": "x"}), b"extra"],
                    [b"\xc1 not msgpack"],
                    [encode(["not", "a", "map"])],
                    [encode({"op": "hello", "token": ["x"], "dp_rank": 0})],
                ]
                for frames in bad:
                    await sock.send_multipart(frames)
                await until(lambda: sup.malformed >= len(bad), 10, "every bad reply counted")
                load = await sup.call(0, "load", timeout=10.0)
                assert load["pid"] == sup.status()[0]["pid"]
            finally:
                sock.close(linger=0)
                ctx.term()

    run(body)


def test_a_second_peer_with_a_connected_ranks_identity_gets_none_of_its_calls() -> None:
    """A DEALER calling itself rank-0 connects, but calls still reach the real rank 0 and it
    receives nothing (ROUTER_HANDOVER off)."""

    async def body() -> None:
        async with supervised(spec(0)) as sup:
            real_pid = sup.status()[0]["pid"]
            ctx = zmq.asyncio.Context()
            forged = await handshaken_peer(ctx, sup.control_endpoint, b"rank-0")
            try:
                for _ in range(5):
                    load = await sup.call(0, "load", timeout=10.0)
                    assert load["pid"] == real_pid
                assert await forged.poll(200) == 0, "the forged rank-0 received a call"
            finally:
                forged.close(linger=0)
                ctx.term()

    run(body)


def test_replies_from_another_peer_do_not_answer_a_rank_call() -> None:
    """While a slow generate is in flight, another peer answers every call id with forged
    text; the caller still gets the rank's real result."""

    async def body() -> None:
        async with supervised(spec(0, decode_steps_per_s=20.0)) as sup:
            ctx = zmq.asyncio.Context()
            forged = peer(ctx, sup.control_endpoint, b"rank-1")
            try:
                call = asyncio.create_task(
                    sup.call(0, "generate", timeout=30.0, input_ids=[1, 2, 3], max_new_tokens=10)
                )
                fake = {"ok": True, "result": {"output_ids": [], "cached_tokens": 99}}
                while not call.done():
                    for call_id in range(1, 50):
                        await forged.send(encode({"id": call_id, **fake}))
                    await asyncio.sleep(0.05)
                result: dict[str, Any] = await call
                assert len(result["output_ids"]) == 10 and result["cached_tokens"] == 0
                assert sup.malformed > 0
            finally:
                forged.close(linger=0)
                ctx.term()

    run(body)


def test_the_control_token_is_not_on_any_rank_command_line() -> None:
    """The rank's argv (what ps shows) has no spec and no token: both come through stdin."""

    async def body() -> None:
        async with supervised(spec(0)) as sup:
            pid = sup.status()[0]["pid"]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            token = sup._token.encode()
            assert all(token not in arg for arg in argv), argv
            assert b"kvevents.engine.rank" in argv
            assert os.stat(f"/proc/{pid}").st_uid == os.getuid()

    run(body)


def test_a_rank_started_with_a_spec_on_argv_refuses() -> None:
    """The old argv form is refused with a usage line (exit 2), not half-started."""
    done = subprocess.run(
        [sys.executable, "-m", "kvevents.engine.rank", "{}"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "SPEC_MSGPACK" in done.stderr


def test_an_engine_without_simulated_delays_starts_and_answers() -> None:
    """`--prefill-tokens-per-s inf --decode-steps-per-s inf` ("no delay", as the help says)
    reach the ranks intact: the spec travels as msgpack, which has an infinity (JSON has
    none, and every rank used to die at start with "Expected `float`, got `null`")."""
    engine = Engine(
        ["--dp-size", "2", "--prefill-tokens-per-s", "inf", "--decode-steps-per-s", "inf"], None
    )
    try:
        answer = engine.generate(list(range(64)), rank=1)
        assert answer["dp_rank"] == 1 and answer["prompt_tokens"] == 64
    finally:
        engine.stop()
