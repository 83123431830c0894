"""Warm-start benchmark: a router replica restarted from a live peer at fleet scale.

``benchmarks/warm_start.py`` and ``kvevents bench warm_start``. Real processes on
loopback: one simulated engine (``dp_size`` ranks, no replay endpoint, instant prefill)
and one ``kvevents router`` following it (the *peer*). ``prompts`` distinct random
prompts of ``prompt_blocks`` blocks are stored on the engine, spread over the ranks,
until the peer's index holds every block. Then:

* **snapshot**: the peer's ``GET /dump`` is fetched ``repeat`` times: its size
  (``snapshot_bytes``), the request's wall time (``dump_request_s``: the peer's encode
  plus the transfer), and in this process the encode (``encode_s``,
  :meth:`~kvevents.index.prefix_index.PrefixIndex.to_bytes` of the loaded index) and
  the decode and load (``decode_load_s``, ``PrefixIndex.from_bytes``); medians.
* **restart**: ``restarts`` times, a new ``kvevents router --peer PEER`` is launched
  while a client keeps posting prompts to the engine (``trickle_per_s``, so that the
  streams move during the restart, as in a fleet). ``ready_after_launch_s``: until it
  prints its ready line (Python start-up included); ``equal_after_launch_s``: until
  its index equals the engine's, rank by rank, as the demo's restart step checks it
  (:class:`kvevents.demo.restart.RestartStep`: the rank's published count is the same
  before and after reading the replica's ``/workers``, the replica's last applied seq
  is the rank's last published one and it holds as many blocks). The replica's own
  breakdown of the peer load (``warm_start`` of its ``/workers``) is reported too.
  After the trickle stops, every rank's blocks in the replica's ``/dump`` are compared
  with the rank's ``/kv_blocks`` (``exact``).
* **peer stall**: during each restart a client posts ``/route`` to the peer in a loop;
  ``peer_route_max_ms`` is the slowest answer while the replica fetched the snapshot,
  beside the same client's ``peer_route_idle_max_ms`` before any restart.

Speed figures, so they are not asserted by tests; ``--quick`` runs a small index.
"""

from __future__ import annotations

import concurrent.futures
import random
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from kvevents.bench.router import EVENTS_CONFIG_WITH_REPLAY
from kvevents.demo.procs import Child
from kvevents.errors import KVEventsError
from kvevents.index.prefix_index import PrefixIndex
from kvevents.types import Holder

__all__ = ["run_warm_start_bench"]

_BLOCK = 16


def _prompt(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(blocks * _BLOCK)]


def _store(engine: str, dp_size: int, prompts: Sequence[list[int]], offset: int = 0) -> None:
    """Prefill every prompt on the engine, rank by rank in turn, 8 at a time."""
    with httpx.Client(timeout=120.0) as client:

        def one(i: int) -> None:
            body = {
                "input_ids": prompts[i],
                "max_new_tokens": 1,
                "routed_dp_rank": (i + offset) % dp_size,
            }
            client.post(f"{engine}/generate", json=body).raise_for_status()

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(len(prompts))))


def _engine_load(http: httpx.Client, engine: str) -> dict[int, tuple[int, int]]:
    answer = http.get(f"{engine}/load")
    answer.raise_for_status()
    return {
        int(r["dp_rank"]): (int(r["batches_published"]), int(r["blocks_used"]))
        for r in answer.json()["ranks"]
    }


def _equal_ranks(http: httpx.Client, engine: str, router: str) -> tuple[set[int], float]:
    """Ranks whose index on ``router`` equals the engine's at this poll, and when."""
    before = _engine_load(http, engine)
    workers = http.get(f"{router}/workers").json()
    now = time.monotonic()
    after = _engine_load(http, engine)
    seqs = {int(s["dp_rank"]): s["last_seq"] for s in workers["streams"] if s["worker"] == engine}
    held = {
        int(h["dp_rank"]): int(h["index_entries"])
        for h in workers["holders"]
        if h["worker"] == engine
    }
    equal = {
        r
        for r, (published, blocks) in before.items()
        if after.get(r) == (published, blocks)
        and seqs.get(r) == published - 1
        and held.get(r) == blocks
    }
    return equal, now


def _wait_equal(engine: str, router: str, dp_size: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=30.0) as http:
        while time.monotonic() < deadline:
            if len(_equal_ranks(http, engine, router)[0]) == dp_size:
                return
            time.sleep(0.2)
    raise KVEventsError(f"router {router} did not catch up with engine {engine} in {timeout:g} s")


def _exact(engine: str, router: str, dp_size: int) -> bool:
    with httpx.Client(timeout=120.0) as http:
        index = PrefixIndex.from_bytes(http.get(f"{router}/dump").content)
        for r in range(dp_size):
            answer = http.get(f"{engine}/kv_blocks", params={"dp_rank": r})
            answer.raise_for_status()
            if index.holder_hashes(Holder(engine, r)) != set(answer.json()["block_hashes"]):
                return False
    return True


class _Prober:
    """Posts ``/route`` to a router in a loop; records (sent, seconds) per answer."""

    def __init__(self, router: str, prompts: Sequence[list[int]]) -> None:
        self.router = router
        self.prompts = prompts
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-probe", daemon=True)

    def __enter__(self) -> _Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30.0)

    def _run(self) -> None:
        i = 0
        with httpx.Client(timeout=60.0) as http:
            while not self._stop.is_set():
                body = {"input_ids": self.prompts[i % len(self.prompts)]}
                t0 = time.monotonic()
                http.post(f"{self.router}/route", json=body).raise_for_status()
                self.samples.append((t0, time.monotonic() - t0))
                i += 1
                time.sleep(0.005)

    def max_ms(self, start: float, end: float) -> float:
        """The slowest answer among requests in flight at any time in [start, end]."""
        inside = [s for t0, s in self.samples if t0 <= end and t0 + s >= start]
        return 1000.0 * max(inside, default=0.0)


class _Trickle:
    """Posts one new prompt to the engine every ``1 / per_s`` seconds, in a thread."""

    def __init__(self, engine: str, dp_size: int, per_s: float, blocks: int, seed: int) -> None:
        self.engine, self.dp_size, self.per_s, self.blocks = engine, dp_size, per_s, blocks
        self.rng = random.Random(seed)
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-trickle", daemon=True)

    def __enter__(self) -> _Trickle:
        if self.per_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30.0)

    def _run(self) -> None:
        with httpx.Client(timeout=60.0) as http:
            while not self._stop.wait(1.0 / self.per_s):
                body = {
                    "input_ids": _prompt(self.rng, self.blocks),
                    "max_new_tokens": 1,
                    "routed_dp_rank": self.sent % self.dp_size,
                }
                http.post(f"{self.engine}/generate", json=body).raise_for_status()
                self.sent += 1


def _snapshot_figures(peer: str, repeat: int) -> dict[str, Any]:
    sizes: list[int] = []
    request_s: list[float] = []
    encode_s: list[float] = []
    decode_s: list[float] = []
    with httpx.Client(timeout=120.0) as http:
        for _ in range(repeat):
            t0 = time.perf_counter()
            raw = http.get(f"{peer}/dump").content
            request_s.append(time.perf_counter() - t0)
            sizes.append(len(raw))
            t0 = time.perf_counter()
            index = PrefixIndex.from_bytes(raw)
            decode_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            index.to_bytes()
            encode_s.append(time.perf_counter() - t0)
    return {
        "snapshot_bytes": sizes[-1],
        "index_blocks": index.num_blocks,
        "index_entries": len(index),
        "engine_hashes": len(index._hashes),
        "dump_request_s": statistics.median(request_s),
        "encode_s": statistics.median(encode_s),
        "decode_load_s": statistics.median(decode_s),
    }


def _restart(
    engine: str, peer: str, dp_size: int, probe: _Prober, timeout: float
) -> dict[str, Any]:
    child = Child("router", ["--engine", engine, "--port", "0", "--workers", "1", "--peer", peer])
    launched = time.monotonic()
    try:
        url = child.start(timeout)
        ready = time.monotonic()
        rank_equal: dict[int, float] = {}
        with httpx.Client(timeout=30.0) as http:
            warm = http.get(f"{url}/workers").json().get("warm_start") or {}
            deadline = ready + timeout
            while len(rank_equal) < dp_size and time.monotonic() < deadline:
                equal, at = _equal_ranks(http, engine, url)
                for r in equal:
                    rank_equal.setdefault(r, at)
                time.sleep(0.02)
        equal_at = max(rank_equal.values()) if len(rank_equal) == dp_size else None
        return {
            "url": url,
            "ready_after_launch_s": ready - launched,
            "equal_after_launch_s": None if equal_at is None else equal_at - launched,
            "warm_start": warm,
            "peer_route_max_ms": probe.max_ms(launched, ready),
            "child": child,
        }
    except BaseException:
        child.stop()
        raise


def run_warm_start_bench(
    *,
    prompts: int = 2_100,
    prompt_blocks: int = 128,
    dp_size: int = 4,
    repeat: int = 3,
    restarts: int = 3,
    trickle_per_s: float = 20.0,
    timeout: float = 120.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the benchmark of the module docstring; returns its JSON document."""
    rng = random.Random(seed)
    stored = [_prompt(rng, prompt_blocks) for _ in range(prompts)]
    per_rank = (prompts // dp_size + 2) * prompt_blocks + 20_000  # nothing is evicted
    engine = Child(
        "engine",
        [
            "--port", "0", "--dp-size", str(dp_size), "--block-size", str(_BLOCK),
            "--max-blocks", str(per_rank), "--prefill-tokens-per-s", "1e12",
            "--decode-steps-per-s", "1e12", "--max-running", "256",
            "--kv-events-config", EVENTS_CONFIG_WITH_REPLAY,  # what the peer had not applied comes back by replay
        ],
    )  # fmt: skip
    peer_child = Child("router", ["--port", "0", "--workers", "1"])
    children: list[Child] = [engine, peer_child]
    try:
        engine_url = engine.start(timeout)
        peer_child.argv += ["--engine", engine_url]
        peer = peer_child.start(timeout)
        t0 = time.monotonic()
        _store(engine_url, dp_size, stored)
        fill_s = time.monotonic() - t0
        _wait_equal(engine_url, peer, dp_size, timeout)
        snapshot = _snapshot_figures(peer, repeat)
        probes = [_prompt(rng, prompt_blocks // 4) for _ in range(8)]
        runs: list[dict[str, Any]] = []
        with _Prober(peer, probes) as probe:
            time.sleep(1.0)
            idle_max = probe.max_ms(0.0, time.monotonic())
            for i in range(restarts):
                with _Trickle(engine_url, dp_size, trickle_per_s, prompt_blocks, seed + i + 1):
                    run = _restart(engine_url, peer, dp_size, probe, timeout)
                children.append(run.pop("child"))
                _wait_equal(engine_url, run["url"], dp_size, timeout)
                run["exact"] = _exact(engine_url, run["url"], dp_size)
                runs.append(run)
                children.pop().stop()
        equal = [r["equal_after_launch_s"] for r in runs]
        return {
            "prompts": prompts,
            "prompt_blocks": prompt_blocks,
            "dp_size": dp_size,
            "fill_s": fill_s,
            **snapshot,
            "peer_route_idle_max_ms": idle_max,
            "restarts": runs,
            "ready_after_launch_s": statistics.median(r["ready_after_launch_s"] for r in runs),
            "equal_after_launch_s": None
            if None in equal
            else statistics.median(e for e in equal if e is not None),
            "peer_route_max_ms": max(r["peer_route_max_ms"] for r in runs),
            "all_exact": all(r["exact"] for r in runs),
            "target_equal_s": 2.0,
        }
    finally:
        for child in reversed(children):
            child.stop()
