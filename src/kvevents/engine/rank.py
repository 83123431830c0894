"""One data-parallel rank of the simulated engine, run as its own process.

``python -m kvevents.engine.rank`` with the spec as msgpack on stdin (started by
:class:`~kvevents.engine.supervisor.RankSupervisor`, never by hand) builds the rank's
prefix cache, scheduler and KV-event publisher, then serves the parent over a control
channel while stepping the scheduler at its simulated speed.

Control channel
---------------
A ZMQ DEALER (identity ``rank-{dp_rank}``) connected to the parent's ROUTER on
loopback. Every message is one msgpack frame holding a map:

* rank -> parent, once at start: ``{"op": "hello", "token", "dp_rank", "pid",
  "endpoint", "replay_endpoint", "snapshot"}`` with the endpoints as bound (port 0
  resolved) and whether the replay socket serves snapshots, or
  ``{"op": "failed", "token", "dp_rank", "error"}`` when the publisher cannot start;
* parent -> rank: ``{"id", "op", ...}`` with op ``generate`` (``input_ids``,
  ``max_new_tokens``, optional ``lora_name`` and ``lora_id``, ``cache_salt``,
  ``extra_keys``, and ``received_blocks``: leading blocks a prefill engine sent, for a
  disaggregated decode), ``flush``, ``load``, ``kv_blocks``, ``shutdown``;
* rank -> parent: ``{"id", "ok": true, "result"}`` or ``{"id", "ok": false, "error",
  "status"}``. A ``generate`` is answered when the request finishes, at the end of the
  simulated step that finished it.

The rank's publisher serves snapshots (:mod:`kvevents.publish.block_state`) unless its
kv-events config says ``"snapshot": false`` or has no replay endpoint: a router that starts
after the replay buffer wrapped then rebuilds every rank whole. Its bound is what the
cache can hold (:func:`engine_kv_events_config`).

A malformed control message is counted and skipped. The process exits when told to
shut down, on SIGTERM, or when its parent disappears; SIGINT is ignored (the parent
owns Ctrl-C and shuts the ranks down in order).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import msgspec
import zmq

from kvevents.engine.cache import PrefixCache
from kvevents.engine.scheduler import Completion, QueueFullError, Scheduler
from kvevents.errors import KVEventsError
from kvevents.publish.config import KVEventsConfig
from kvevents.transport.endpoints import Endpoint
from kvevents.wire.hashing import get_hash_scheme

__all__ = ["RankSpec", "engine_kv_events_config", "main"]

_IDLE_POLL_S = 0.25
_MAX_LAG_S = 0.05
"""How late a busy rank's step may begin and still keep the simulated hardware's pace
(see :meth:`_RankServer.serve`); a later one (the host stalled the process) begins anew."""


class RankSpec(msgspec.Struct, kw_only=True, frozen=True):
    """Everything a rank process needs, passed as msgpack on its stdin (it holds the
    control token, which must not show in ``ps``)."""

    dp_rank: int
    control: str
    token: str
    kv_events_config: dict[str, Any]
    page_size: int
    max_blocks: int
    hash_scheme: str = "sglang"
    hash_seed: str | None = "0"
    prefill_tokens_per_s: float = 1_000_000.0
    decode_steps_per_s: float = 1_000.0
    max_running: int = 64
    max_waiting: int = 10_000
    sliding_window: int | None = None
    # Exact endpoints to bind again after a restart (an earlier start resolved port 0).
    endpoint_override: str | None = None
    replay_override: str | None = None


class _Stop(Exception):
    """Raised by the SIGTERM handler to leave the loop through its cleanup."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def _base_for(exact: str | None, configured: str | None, rank: int) -> str | None:
    """The base endpoint that lands exactly on ``exact`` once the publisher offsets it by ``rank``."""
    if exact is None or configured is None:
        return configured
    ep = Endpoint.parse(exact)
    if not ep.is_tcp or ep.port is None or ep.port - rank < 1:
        return configured
    host = Endpoint.parse(configured).host
    return str(Endpoint(scheme="tcp", host=host, port=ep.port - rank))


def engine_kv_events_config(
    config: KVEventsConfig, max_blocks: int, sliding_window: int | None = None
) -> KVEventsConfig:
    """``config`` as a rank publishes with it: snapshots on unless the config decides.

    On when publishing with a replay endpoint and neither snapshot key is given; the set
    is then bounded by twice what the cache holds per KV-cache group (room for the
    parents a sliding window no longer holds but still chains from).
    """
    if (
        not config.enabled
        or config.replay_endpoint is None
        or config.snapshot is not None
        or config.snapshot_max_blocks is not None
    ):
        return config
    groups = 2 if sliding_window else 1
    return msgspec.structs.replace(
        config, snapshot=True, snapshot_max_blocks=2 * groups * max_blocks
    )


def _make_publisher(spec: RankSpec) -> Any:
    from kvevents.publish.zmq_publisher import EventPublisherFactory

    config = engine_kv_events_config(
        KVEventsConfig.from_dict(spec.kv_events_config), spec.max_blocks, spec.sliding_window
    )
    if config.enabled and (spec.endpoint_override or spec.replay_override):
        config = msgspec.structs.replace(
            config,
            endpoint=_base_for(spec.endpoint_override, config.endpoint, spec.dp_rank),
            replay_endpoint=_base_for(spec.replay_override, config.replay_endpoint, spec.dp_rank),
        )
    return EventPublisherFactory.create(config, attn_dp_rank=spec.dp_rank)


class _RankServer:
    """The rank's loop: the control channel on ``dealer`` and the scheduler's steps.
    ``clock`` (monotonic seconds) is what the steps are timed by; tests give their own."""

    def __init__(
        self,
        spec: RankSpec,
        dealer: zmq.Socket[bytes],
        publisher: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self._clock = clock
        self.dealer = dealer
        self.publisher = publisher
        cache = PrefixCache(
            spec.page_size,
            spec.max_blocks,
            get_hash_scheme(spec.hash_scheme, seed=spec.hash_seed),
            sliding_window=spec.sliding_window,
        )
        self.scheduler = Scheduler(
            spec.dp_rank,
            cache,
            publisher,
            prefill_tokens_per_s=spec.prefill_tokens_per_s,
            decode_steps_per_s=spec.decode_steps_per_s,
            max_running=spec.max_running,
            max_waiting=spec.max_waiting,
        )
        self.malformed = 0
        self.running = True
        self._due: list[tuple[float, list[Completion]]] = []
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(dict[str, Any]).decode

    def send(self, message: dict[str, Any]) -> None:
        self.dealer.send(self._encode(message))

    def serve(self, parent_pid: int) -> None:
        """Step the scheduler at its simulated pace while serving the control channel.

        A step begins when the one before ends on the simulated hardware (its
        ``duration_s`` after that one began), not when this process wakes up to run it:
        the wait is in whole milliseconds and the host runs other processes, so counted
        from the wake-up each step came out up to a millisecond or more long, and the
        pace drifted with the host's load. A step later than that by under
        :data:`_MAX_LAG_S` keeps the schedule (the next ones follow at once), so a
        request decodes in its steps' simulated time; a rank that went idle, or one
        later than that, begins when it runs. No answer leaves before its step's end.
        """
        sched = self.scheduler
        clock = self._clock
        next_step = clock()
        busy = False  # the scheduler had work when its last step ended
        while self.running:
            now = clock()
            self._send_due(now)
            wait = max(0.0, next_step - now) if sched.has_work else _IDLE_POLL_S
            if self._due:
                wait = min(wait, max(0.0, self._due[0][0] - now))
            if self.dealer.poll(math.ceil(wait * 1000)):
                self._drain()
            if os.getppid() != parent_pid:
                return
            now = clock()
            if self.running and sched.has_work and now >= next_step:
                start = next_step if busy and now - next_step <= _MAX_LAG_S else now
                result = sched.step()
                next_step = start + result.duration_s
                busy = sched.has_work
                if result.finished:
                    self._due.append((next_step, result.finished))
        self._send_due(math.inf)

    def _send_due(self, now: float) -> None:
        while self._due and self._due[0][0] <= now:
            _, finished = self._due.pop(0)
            for c in finished:
                result = {
                    "dp_rank": c.dp_rank,
                    "prompt_tokens": c.prompt_tokens,
                    "cached_tokens": c.cached_tokens,
                    "output_ids": c.output_ids,
                }
                self.send({"id": c.request_id, "ok": True, "result": result})

    def _drain(self) -> None:
        for _ in range(1000):
            try:
                frame = self.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = self._decode(frame)
            except msgspec.DecodeError:
                self.malformed += 1
                continue
            try:
                self._handle(message)
            except (KeyError, TypeError, ValueError) as exc:
                self.malformed += 1
                if "id" in message:
                    error = f"bad {message.get('op')!r} control message: {exc!r}"
                    self.send({"id": message["id"], "ok": False, "error": error, "status": 400})

    def _handle(self, message: dict[str, Any]) -> None:
        op, rid = message["op"], message["id"]
        sched = self.scheduler
        if op == "generate":
            try:
                sched.submit(
                    rid,
                    message["input_ids"],
                    int(message["max_new_tokens"]),
                    cache_salt=message.get("cache_salt"),
                    extra_keys=message.get("extra_keys"),
                    lora_name=message.get("lora_name"),
                    lora_id=message.get("lora_id"),
                    received_blocks=int(message.get("received_blocks", 0)),
                )
            except QueueFullError as exc:
                self.send({"id": rid, "ok": False, "error": str(exc), "status": 503})
            return
        if op == "flush":
            result: Any = {"events": sched.flush()}
        elif op == "load":
            result = sched.load() | {"pid": os.getpid(), "malformed_control": self.malformed}
            # A request the scheduler finished stays the rank's until its step's simulated
            # time is over and its answer leaves (_due), as a real engine's step holds it:
            # counted as running until then. Left out, a router that counts the answers
            # still to come as in flight took the rank's own requests for fewer than they
            # are, for as long as a step takes.
            result["running"] += sum(len(done) for _, done in self._due)
            stats = self.publisher.stats  # CURVE handshakes refused: a subscriber gets nothing
            result |= {
                "curve_handshakes": stats.curve_handshakes,
                "curve_refused": stats.curve_refused,
            }
        elif op == "kv_blocks":
            result = {"block_hashes": sched.cache.block_hashes()}
        elif op == "shutdown":
            self.running = False
            result = {}
        else:
            raise ValueError(f"unknown op {op!r}")
        self.send({"id": rid, "ok": True, "result": result})


def _endpoint_of(publisher: Any, name: str) -> str | None:
    value = getattr(publisher, name, None)
    return None if value is None else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank; the spec is read from stdin (``argv`` must be empty). Returns the exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    args = list(sys.argv[1:] if argv is None else argv)
    if args:
        print("usage: python -m kvevents.engine.rank < SPEC_MSGPACK", file=sys.stderr)
        return 2
    try:
        spec = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=RankSpec)
    except msgspec.DecodeError as exc:
        print(f"kvevents.engine.rank: the spec on stdin is not valid: {exc}", file=sys.stderr)
        return 2
    parent_pid = os.getppid()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, f"rank-{spec.dp_rank}".encode())
    dealer.setsockopt(zmq.LINGER, 2000)
    dealer.connect(spec.control)
    encode = msgspec.msgpack.Encoder().encode
    publisher = None
    try:
        try:
            publisher = _make_publisher(spec)
        except (KVEventsError, zmq.ZMQError, OSError) as exc:
            error = f"dp_rank {spec.dp_rank}: could not start the KV-event publisher: {exc}"
            dealer.send(
                encode(
                    {"op": "failed", "token": spec.token, "dp_rank": spec.dp_rank, "error": error}
                )
            )
            return 1
        hello = {
            "op": "hello",
            "token": spec.token,
            "dp_rank": spec.dp_rank,
            "pid": os.getpid(),
            "endpoint": _endpoint_of(publisher, "endpoint"),
            "replay_endpoint": _endpoint_of(publisher, "replay_endpoint"),
            "snapshot": bool(getattr(publisher, "snapshot_enabled", False)),
        }
        dealer.send(encode(hello))
        _RankServer(spec, dealer, publisher).serve(parent_pid)
        return 0
    except _Stop:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if publisher is not None:
            publisher.shutdown()
        dealer.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
