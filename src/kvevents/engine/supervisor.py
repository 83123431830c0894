"""The parent side of the rank processes: start, call, watch, restart, stop.

:class:`RankSupervisor` runs in the HTTP server's asyncio loop. It binds one ZMQ ROUTER
on loopback (port chosen by the OS), starts one process per rank
(``python -m kvevents.engine.rank``, in its own session so a terminal's Ctrl-C reaches
only the parent), and waits for each rank's hello with its bound publisher endpoints
(message layout: :mod:`kvevents.engine.rank`). :meth:`RankSupervisor.call` sends one
request to one rank and awaits its answer, any number in flight; a watchdog marks a rank
that exits unasked as dead (its calls fail, :attr:`RankSupervisor.failed` is set for
``/health``); :meth:`RankSupervisor.restart` starts a rank again on the same endpoints,
so its publisher restarts at seq 0 where consumers already listen;
:meth:`RankSupervisor.stop` shuts every rank down, then terminates and kills. No rank
outlives the supervisor.

Any local process may connect to the loopback control socket, so nothing a peer sends is
trusted: a rank proves itself with a per-engine secret token sent over its stdin (argv
shows in ``ps``); ROUTER_HANDOVER is off, so nobody takes a connected rank's identity; a
reply is taken only from the rank the call went to, and a malformed frame is counted
(:attr:`RankSupervisor.malformed`) and skipped. The receive loop never dies of a peer's
input.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvevents.engine.rank import RankSpec
from kvevents.engine.server_info import BoundPublisher
from kvevents.errors import KVEventsError
from kvevents.types import StrEnum

__all__ = ["EngineRankError", "RankState", "RankSupervisor"]

log = logging.getLogger("kvevents.engine")


class EngineRankError(KVEventsError, RuntimeError):
    """A rank process failed to start, died, or did not answer in time.

    ``status`` is the HTTP status the engine answers with (503 for an unavailable rank).
    """

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


class RankState(StrEnum):
    """The lifecycle of one rank process (members are their strings, as ``/health`` shows).

    ``STARTING`` -> ``RUNNING`` -> (``KILLING`` -> ``RESTARTING`` -> ``RUNNING``)* ->
    ``STOPPED``; a process that exits on its own, from any state but ``KILLING`` and
    ``STOPPED``, is ``DEAD``.
    """

    STARTING = "starting"
    RUNNING = "running"
    KILLING = "killing"  # a restart killed it: the watchdog ignores this exit
    RESTARTING = "restarting"
    STOPPED = "stopped"
    DEAD = "dead"


class _Malformed(Exception):
    """A control message that is skipped and counted; the text says why."""


@dataclass
class _Rank:
    spec: RankSpec
    process: subprocess.Popen[bytes] | None = None
    state: RankState = RankState.STARTING
    pid: int | None = None
    endpoint: str | None = None
    replay_endpoint: str | None = None
    snapshot: bool = False
    restarts: int = 0
    exit_code: int | None = None
    hello: asyncio.Future[dict[str, Any]] | None = None
    pending: set[int] = field(default_factory=set)


class RankSupervisor:
    """Start and talk to rank processes; see the module docstring.

    ``specs`` are the ranks' settings without the control address and token (the
    supervisor fills those in).
    """

    def __init__(
        self,
        specs: Sequence[RankSpec],
        *,
        startup_timeout: float = 30.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._context = context or zmq.asyncio.Context()
        self._own_context = context is None
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # No handover: a second peer claiming a connected rank's identity is refused,
        # instead of taking over that rank's calls.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 0)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind("tcp://127.0.0.1:0")
        control = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.control_endpoint = control
        """The control ROUTER's address (loopback, port chosen by the OS)."""
        self._token = secrets.token_hex(16)
        self._ranks = [
            _Rank(msgspec.structs.replace(s, control=control, token=self._token)) for s in specs
        ]
        self._startup_timeout = startup_timeout
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(dict[str, Any]).decode
        self.malformed = 0
        """Control frames that were not a well-formed message from a known peer."""
        self.failed = asyncio.Event()
        self._closed = False

    @property
    def dp_size(self) -> int:
        return len(self._ranks)

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start every rank and wait for all hellos; on any failure stop all and raise."""
        self._tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._watchdog()),
        ]
        try:
            for rank in self._ranks:
                self._spawn(rank)
            await asyncio.gather(*(self._await_hello(r) for r in self._ranks))
        except BaseException:
            await self.stop()
            raise

    async def restart(self, dp_rank: int, sig: int = signal.SIGKILL) -> dict[str, Any]:
        """Kill rank ``dp_rank`` with ``sig`` and start it again on the same endpoints."""
        rank = self._rank(dp_rank)
        if rank.state in (
            RankState.STARTING,
            RankState.KILLING,
            RankState.RESTARTING,
            RankState.STOPPED,
        ):
            raise EngineRankError(f"dp_rank {dp_rank} is {rank.state}; try again later", 409)
        rank.state = RankState.KILLING  # the watchdog ignores this exit
        await self._terminate(rank, sig, timeout=10.0)
        self._fail_pending(rank, f"dp_rank {dp_rank} was restarted")
        rank.spec = msgspec.structs.replace(
            rank.spec, endpoint_override=rank.endpoint, replay_override=rank.replay_endpoint
        )
        rank.restarts += 1
        self._spawn(rank)
        await self._await_hello(rank)
        return self._status(rank)

    async def stop(self, timeout: float = 5.0) -> None:
        """Shut every rank down (ask, then SIGTERM, then SIGKILL); idempotent."""
        if self._closed:
            return
        self._closed = True
        for rank in self._ranks:
            if rank.process is not None and rank.process.poll() is None:
                rank.state = RankState.STOPPED
                with contextlib.suppress(EngineRankError):
                    await self._send(rank, {"id": 0, "op": "shutdown"})
        await asyncio.gather(*(self._terminate(r, None, timeout) for r in self._ranks))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for rank in self._ranks:
            self._fail_pending(rank, "the engine is shutting down")
        self._router.close(linger=0)
        if self._own_context:
            self._context.term()

    # --- calls ---------------------------------------------------------------------------

    async def call(self, dp_rank: int, op: str, timeout: float = 30.0, **fields: Any) -> Any:
        """Send ``op`` to rank ``dp_rank`` and return its result (raises EngineRankError)."""
        rank = self._rank(dp_rank)
        if rank.state is not RankState.RUNNING:
            raise EngineRankError(f"dp_rank {dp_rank} is {rank.state}")
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        rank.pending.add(call_id)
        try:
            await self._send(rank, {"id": call_id, "op": op, **fields})
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise EngineRankError(
                f"dp_rank {dp_rank} did not answer {op!r} in {timeout:g} s", 504
            ) from None
        finally:
            self._calls.pop(call_id, None)
            rank.pending.discard(call_id)

    def live_ranks(self) -> list[int]:
        return [i for i, r in enumerate(self._ranks) if r.state is RankState.RUNNING]

    def dead_ranks(self) -> list[int]:
        return [i for i, r in enumerate(self._ranks) if r.state is RankState.DEAD]

    def status(self) -> list[dict[str, Any]]:
        return [self._status(r) for r in self._ranks]

    def bound_publishers(self) -> list[BoundPublisher]:
        """Each rank's publisher endpoints as bound (port 0 resolved); ranks without one are left out."""
        return [
            BoundPublisher(r.spec.dp_rank, r.endpoint, r.replay_endpoint, r.snapshot)
            for r in self._ranks
            if r.endpoint is not None
        ]

    # --- internals -----------------------------------------------------------------------

    def _rank(self, dp_rank: int) -> _Rank:
        if not 0 <= dp_rank < len(self._ranks):
            raise EngineRankError(
                f"dp_rank {dp_rank} is out of range: this engine has ranks 0..{len(self._ranks) - 1}",
                400,
            )
        return self._ranks[dp_rank]

    def _status(self, rank: _Rank) -> dict[str, Any]:
        return {
            "dp_rank": rank.spec.dp_rank,
            "state": rank.state.value,
            "alive": rank.state is RankState.RUNNING,
            "pid": rank.pid,
            "restarts": rank.restarts,
            "exit_code": rank.exit_code,
            "endpoint": rank.endpoint,
            "replay_endpoint": rank.replay_endpoint,
        }

    def _spawn(self, rank: _Rank) -> None:
        rank.state = RankState.STARTING if rank.restarts == 0 else RankState.RESTARTING
        rank.exit_code = None
        rank.hello = asyncio.get_running_loop().create_future()
        argv = [sys.executable, "-m", "kvevents.engine.rank"]
        # The spec (with the token) goes through the stdin pipe, not argv, which ps shows.
        rank.process = subprocess.Popen(argv, stdin=subprocess.PIPE, start_new_session=True)
        rank.pid = rank.process.pid
        assert rank.process.stdin is not None
        with rank.process.stdin as pipe, contextlib.suppress(BrokenPipeError):
            pipe.write(msgspec.msgpack.encode(rank.spec))  # msgpack: JSON has no inf

    async def _await_hello(self, rank: _Rank) -> None:
        assert rank.hello is not None
        try:
            hello = await asyncio.wait_for(asyncio.shield(rank.hello), self._startup_timeout)
        except (asyncio.TimeoutError, EngineRankError) as exc:
            rank.state = RankState.DEAD
            if rank.restarts:
                self.failed.set()
            if isinstance(exc, EngineRankError):
                raise
            raise EngineRankError(
                f"dp_rank {rank.spec.dp_rank} did not start within {self._startup_timeout:g} s"
            ) from None
        rank.endpoint = hello.get("endpoint")
        rank.replay_endpoint = hello.get("replay_endpoint")
        rank.snapshot = hello.get("snapshot") is True
        if rank.state in (
            RankState.STARTING,
            RankState.RESTARTING,
        ):  # not if stop() began meanwhile
            rank.state = RankState.RUNNING

    async def _send(self, rank: _Rank, message: dict[str, Any]) -> None:
        identity = f"rank-{rank.spec.dp_rank}".encode()
        try:
            await self._router.send_multipart([identity, self._encode(message)])
        except zmq.ZMQError as exc:
            raise EngineRankError(f"dp_rank {rank.spec.dp_rank} is not connected ({exc})") from None

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            try:
                self._on_frames(frames)
            except _Malformed as exc:
                self.malformed += 1
                if self.malformed == 1:
                    log.warning(
                        "rank control socket: skipped a malformed message (%s); "
                        "further ones are only counted",
                        exc,
                    )

    def _on_frames(self, frames: list[bytes]) -> None:
        """Handle one message ``[identity, payload]``; raises _Malformed for anything else."""
        if len(frames) != 2:
            raise _Malformed(f"{len(frames)} frames, expected [identity, payload]")
        identity, payload = frames
        try:
            message = self._decode(payload)
        except msgspec.DecodeError as exc:
            raise _Malformed(f"payload is not a msgpack map: {exc}") from None
        if message.get("op") in ("hello", "failed"):
            self._on_hello(identity, message)
            return
        call_id = message.get("id")
        if not isinstance(call_id, int) or isinstance(call_id, bool):
            raise _Malformed(f"reply id {call_id!r} is not an integer")
        rank = self._rank_of(identity)
        if rank is None:
            raise _Malformed(f"reply from unknown peer {identity[:40]!r}")
        future = self._calls.get(call_id) if call_id in rank.pending else None
        if future is None or future.done():
            return  # answer to a call that timed out or was failed, or not sent to this rank
        if message.get("ok") is True:
            future.set_result(message.get("result"))
            return
        status = message.get("status", 500)
        if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599:
            status = 500
        future.set_exception(EngineRankError(str(message.get("error"))[:2000], status))

    def _rank_of(self, identity: bytes) -> _Rank | None:
        """The rank whose DEALER identity ``identity`` is, else None."""
        prefix = b"rank-"
        number = identity[len(prefix) :]
        if not identity.startswith(prefix) or not number.isdigit() or len(number) > 6:
            return None
        dp_rank = int(number)
        if not 0 <= dp_rank < len(self._ranks) or identity != f"rank-{dp_rank}".encode():
            return None
        return self._ranks[dp_rank]

    def _on_hello(self, identity: bytes, message: dict[str, Any]) -> None:
        token = message.get("token")
        if not isinstance(token, str) or not secrets.compare_digest(token, self._token):
            raise _Malformed(f"hello from {identity[:40]!r} without the engine's token")
        dp_rank = message.get("dp_rank")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < len(self._ranks):
            raise _Malformed(f"hello with dp_rank {dp_rank!r} out of range")
        rank = self._ranks[dp_rank]
        if identity != f"rank-{dp_rank}".encode() or rank.hello is None or rank.hello.done():
            return
        if not all(
            isinstance(message.get(k), (str, type(None))) for k in ("endpoint", "replay_endpoint")
        ):
            raise _Malformed("hello whose endpoints are not strings")
        if message["op"] == "failed":
            rank.hello.set_exception(EngineRankError(str(message.get("error"))))
        else:
            rank.hello.set_result(message)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            for rank in self._ranks:
                proc = rank.process
                if proc is None or rank.state in (
                    RankState.KILLING,
                    RankState.STOPPED,
                    RankState.DEAD,
                ):
                    continue
                code = proc.poll()
                if code is None:
                    continue
                rank.exit_code = code
                was_starting = rank.state is RankState.STARTING
                rank.state = RankState.DEAD
                message = f"dp_rank {rank.spec.dp_rank} (pid {proc.pid}) exited with code {code}"
                if rank.hello is not None and not rank.hello.done():
                    rank.hello.set_exception(EngineRankError(message))
                self._fail_pending(rank, message)
                if not was_starting:
                    print(f"kvevents engine: {message}", file=sys.stderr, flush=True)
                self.failed.set()

    async def _terminate(self, rank: _Rank, sig: int | None, timeout: float) -> None:
        proc = rank.process
        if proc is None:
            return
        if sig is not None and proc.poll() is None:
            os.kill(proc.pid, sig)
        for escalate in (signal.SIGTERM, signal.SIGKILL, None):
            try:
                rank.exit_code = await asyncio.to_thread(proc.wait, timeout)
                return
            except subprocess.TimeoutExpired:
                if escalate is None:
                    raise EngineRankError(
                        f"dp_rank {rank.spec.dp_rank} (pid {proc.pid}) did not exit"
                    ) from None
                proc.send_signal(escalate)
                timeout = 5.0

    def _fail_pending(self, rank: _Rank, reason: str) -> None:
        for call_id in list(rank.pending):
            future = self._calls.get(call_id)
            if future is not None and not future.done():
                future.set_exception(EngineRankError(reason))
        rank.pending.clear()
