"""Helpers for engine tests: run `kvevents engine` as a subprocess and follow its streams."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import zmq

from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch
from kvevents.wire.frames import parse_live_frames, parse_replay_reply, replay_request_frames
from process_support import KVEventsProcess


class Engine(KVEventsProcess):
    """A `kvevents engine` subprocess on OS-chosen ports; stop() it (the fixture does)."""

    def __init__(
        self,
        args: Sequence[str],
        kv_config: dict[str, Any] | None,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
    ):
        argv = ["--port", "0", *args]
        if kv_config is not None:
            argv += ["--kv-events-config", json.dumps(kv_config)]
        super().__init__("engine", argv, timeout=timeout, env=env)

    def server_info(self) -> dict[str, Any]:
        response = self.http.get("/server_info")
        response.raise_for_status()
        return response.json()

    def generate(self, tokens: list[int], rank: int | None = None, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"input_ids": tokens, "max_new_tokens": 2, **extra}
        if rank is not None:
            body["routed_dp_rank"] = rank
        response = self.http.post("/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    def kv_blocks(self, rank: int) -> set[int]:
        response = self.http.get("/kv_blocks", params={"dp_rank": rank})
        assert response.status_code == 200, response.text
        return set(response.json()["block_hashes"])

    def rank_pids(self) -> list[int]:
        return [r["pid"] for r in self.http.get("/health").json()["ranks"]]


def stream_events(
    client: httpx.Client, path: str, body: dict[str, Any]
) -> tuple[httpx.Headers, list[Any]]:
    """POST ``body`` asking for a stream: the headers and every SSE ``data:`` payload, parsed.

    Checks the status is 200 and the stream ends with ``data: [DONE]`` (not returned).
    """
    with client.stream("POST", path, json=body) as response:
        raw = b"".join(response.iter_raw())
    assert response.status_code == 200, raw
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]", events[-3:]
    return response.headers, [json.loads(e) for e in events[:-1]]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def connectable(endpoint: str, engine_url: str) -> str:
    """The wildcard rule of docs/architecture.md §4: a wildcard host means the engine URL's host."""
    host = httpx.URL(engine_url).host
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard) :]}"
    return endpoint


class RankStreams:
    """One SUB per advertised rank, from the kv_events block alone; gaps filled by replay."""

    def __init__(self, ctx: zmq.Context, block: dict[str, Any], engine_url: str):
        self.ctx = ctx
        self.topic = block["topic"].encode()
        self.live: dict[int, str] = {}
        self.replay: dict[int, str | None] = {}
        self.subs: dict[int, zmq.Socket] = {}
        self.batches: dict[int, dict[int, KVEventBatch]] = {}
        for pub in block["publishers"]:
            rank = pub["dp_rank"]
            self.live[rank] = connectable(pub["endpoint"], engine_url)
            rep = pub["replay_endpoint"]
            self.replay[rank] = None if rep is None else connectable(rep, engine_url)
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.connect(self.live[rank])
            self.subs[rank] = sub
            self.batches[rank] = {}
        self.live_received = dict.fromkeys(self.live, 0)

    def close(self) -> None:
        for sub in self.subs.values():
            sub.close(linger=0)

    def collect(self, expected: dict[int, int], timeout: float = 20.0) -> None:
        """Receive live batches until each rank has seqs 0..expected[r]-1 (replaying what SUB missed)."""
        poller = zmq.Poller()
        for sub in self.subs.values():
            poller.register(sub, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            missing = {r for r, n in expected.items() if len(self.batches[r]) < n}
            if not missing:
                return
            ready = dict(poller.poll(timeout=200))
            for rank, sub in self.subs.items():
                while sub in ready and sub.poll(0):
                    msg = parse_live_frames(sub.recv_multipart())
                    batch = decode_batch(msg.payload)
                    assert batch.data_parallel_rank == rank, "batch arrived on another rank's port"
                    self.batches[rank][msg.seq] = batch
                    self.live_received[rank] += 1
            if not ready:
                for rank in missing:
                    self.fill_by_replay(rank)
        raise AssertionError(
            f"streams incomplete: have { {r: sorted(b) for r, b in self.batches.items()} }, "
            f"expected counts {expected}"
        )

    def fill_by_replay(self, rank: int, start: int = 0, timeout: float = 5.0) -> None:
        endpoint = self.replay[rank]
        assert endpoint is not None, "the test config enables replay"
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(endpoint)
            dealer.send_multipart(replay_request_frames(start))
            while dealer.poll(timeout=int(timeout * 1000)):
                reply = parse_replay_reply(dealer.recv_multipart())
                if reply.is_end:
                    return
                assert reply.topic == self.topic
                self.batches[rank].setdefault(reply.seq, decode_batch(reply.payload))
            raise AssertionError(f"replay of rank {rank} did not end in {timeout} s")
        finally:
            dealer.close(linger=0)

    def held(self, rank: int) -> set[int]:
        """The hashes a consumer holds after applying rank's batches in seq order."""
        held: set[int] = set()
        seqs = sorted(self.batches[rank])
        assert seqs == list(range(len(seqs))), f"rank {rank} has seq gaps: {seqs}"
        for seq in seqs:
            for ev in self.batches[rank][seq].events:
                if isinstance(ev, BlockStored):
                    held.update(ev.block_hashes)  # type: ignore[arg-type]
                elif isinstance(ev, BlockRemoved):
                    held.difference_update(ev.block_hashes)
                elif isinstance(ev, AllBlocksCleared):
                    held.clear()
        return held


def published_counts(engine: Engine) -> dict[int, int]:
    """Batches each rank's scheduler has published so far (= its next seq)."""
    load = engine.http.get("/load").json()
    return {r["dp_rank"]: r["batches_published"] for r in load["ranks"]}
