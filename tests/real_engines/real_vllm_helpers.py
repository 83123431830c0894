"""What the real-vLLM tests share: where vLLM is, how to call it, and a model of its cache.

The tests run only under ``scripts/test-real-vllm``, which starts vLLM and exports
``KVEVENTS_REAL_VLLM_*`` variables (see :class:`RealVLLM`). Nothing here imports vLLM:
the tests talk to it over HTTP and ZMQ like any consumer.

What "what vLLM holds" means here
---------------------------------
vLLM has no endpoint that lists its cached blocks. The only first-hand evidence is
(1) its event stream and (2) the ``cached_tokens`` it reports per request. The
:class:`EventModel` is the brute-force reading of (1): per rank, the set of block hashes
after applying every ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` in seq
order, each hash remembering the token prefix it covers. Tests compare our
``PrefixIndex`` with it, and both with (2).
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

ENV_URL = "KVEVENTS_REAL_VLLM_URL"
SCRIPT = "scripts/test-real-vllm"
REPO = Path(__file__).resolve().parents[2]

# Token ids 4..1023 are the words w4..w1023 of the tiny model (0-3 are special tokens).
FIRST_WORD_ID = 4
VOCAB_SIZE = 1024


@dataclass(frozen=True)
class RealVLLM:
    """Where the running vLLM is, read from the environment the script exports."""

    url: str
    kv_endpoint: str  # tcp://127.0.0.1:BASE, rank r publishes on BASE + r
    replay_endpoint: str  # tcp://127.0.0.1:RBASE, rank r replays on RBASE + r
    dp_size: int
    model: str
    block_size: int
    num_blocks: int
    topic: str
    hash_mode: str  # "int" or "bytes"
    state_dir: str

    @classmethod
    def from_env(cls) -> RealVLLM:
        env = os.environ
        missing = [
            k
            for k in (
                ENV_URL,
                "KVEVENTS_REAL_VLLM_KV_ENDPOINT",
                "KVEVENTS_REAL_VLLM_REPLAY_ENDPOINT",
                "KVEVENTS_REAL_VLLM_DP_SIZE",
                "KVEVENTS_REAL_VLLM_MODEL",
                "KVEVENTS_REAL_VLLM_STATE",
            )
            if k not in env
        ]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not set: run the suite with {SCRIPT}")
        return cls(
            url=env[ENV_URL].rstrip("/"),
            kv_endpoint=env["KVEVENTS_REAL_VLLM_KV_ENDPOINT"],
            replay_endpoint=env["KVEVENTS_REAL_VLLM_REPLAY_ENDPOINT"],
            dp_size=int(env["KVEVENTS_REAL_VLLM_DP_SIZE"]),
            model=env["KVEVENTS_REAL_VLLM_MODEL"],
            block_size=int(env.get("KVEVENTS_REAL_VLLM_BLOCK_SIZE", "32")),
            num_blocks=int(env.get("KVEVENTS_REAL_VLLM_NUM_BLOCKS", "20")),
            topic=env.get("KVEVENTS_REAL_VLLM_TOPIC", "kv"),
            hash_mode=env.get("KVEVENTS_REAL_VLLM_HASH_MODE", "int"),
            state_dir=env["KVEVENTS_REAL_VLLM_STATE"],
        )

    def rank_endpoint(self, rank: int) -> str:
        return _offset(self.kv_endpoint, rank)

    def rank_replay_endpoint(self, rank: int) -> str:
        return _offset(self.replay_endpoint, rank)

    def max_cached_tokens(self, prompt_len: int) -> int:
        """The most prompt tokens vLLM can serve from cache: whole blocks, and at least
        the last prompt token is always computed (so at most ``prompt_len - 1``)."""
        return (prompt_len - 1) // self.block_size * self.block_size

    def restart(self) -> float:
        """SIGKILL the whole vLLM process group and start it again on the same ports.

        Returns the seconds it took to be ready again. Uses the script's launcher, which
        keeps the process group id where the script's exit trap finds it.
        """
        sys.path.insert(0, str(REPO / "scripts" / "real_vllm"))
        try:
            import vllm_server
        finally:
            sys.path.pop(0)
        return float(vllm_server.restart(self.state_dir))


def _offset(endpoint: str, rank: int) -> str:
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + rank}"


class VLLMClient:
    """Requests to vLLM's OpenAI endpoints, pinned to a data-parallel rank by header."""

    def __init__(self, vllm: RealVLLM, timeout: float = 60.0) -> None:
        self.vllm = vllm
        self.http = httpx.Client(base_url=vllm.url, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def complete(
        self, tokens: Sequence[int], rank: int | None, *, max_tokens: int = 1
    ) -> dict[str, Any]:
        """POST /v1/completions with token ids; returns vLLM's ``usage`` block.

        ``max_tokens=1`` finishes the request in its prefill step, so every event it
        causes is in that one step's batch.
        """
        headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
        resp = self.http.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": list(tokens),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            headers=headers,
        )
        resp.raise_for_status()
        usage: dict[str, Any] = resp.json()["usage"]
        return usage

    def cached_tokens(self, usage: dict[str, Any]) -> int:
        details = usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    def reset_prefix_cache(self) -> None:
        """POST /reset_prefix_cache (needs VLLM_SERVER_DEV_MODE=1, set by the script)."""
        resp = self.http.post("/reset_prefix_cache")
        resp.raise_for_status()


class Prompts:
    """Fresh random prompts (word ids), distinct from every other test's by seed."""

    _counter = itertools.count()

    def __init__(self, seed: str) -> None:
        self.rng = random.Random(f"{seed}-{next(self._counter)}")

    def fresh(self, length: int) -> list[int]:
        return [self.rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(length)]


class EventModel:
    """Brute-force replay of vLLM's events: per rank, hash -> the token prefix it covers.

    ``BlockStored`` adds each hash with the tokens of its block appended to its parent's
    prefix (a parent this model never saw stays unknown: the block is recorded with
    ``None`` as prefix, and :attr:`unknown_parents` counts it). ``BlockRemoved`` drops
    hashes, ``AllBlocksCleared`` drops everything. O(blocks) memory, no cleverness: it is
    the reference the index is checked against.
    """

    def __init__(self) -> None:
        self.blocks: dict[int, dict[Any, tuple[int, ...] | None]] = {}
        self.unknown_parents = 0
        self.unknown_removals = 0

    def apply(self, rank: int, batch: KVEventBatch) -> None:
        held = self.blocks.setdefault(rank, {})
        for event in batch.events:
            if isinstance(event, BlockStored):
                size = event.block_size
                prefix: tuple[int, ...] | None
                if event.parent_block_hash is None:
                    prefix = ()
                else:
                    prefix = held.get(event.parent_block_hash)
                    if prefix is None:
                        self.unknown_parents += 1
                for i, block_hash in enumerate(event.block_hashes):
                    chunk = tuple(event.token_ids[i * size : (i + 1) * size])
                    prefix = None if prefix is None else prefix + chunk
                    held[block_hash] = prefix
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    if held.pop(block_hash, "missing") == "missing":
                        self.unknown_removals += 1
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    def clear(self, rank: int) -> None:
        self.blocks[rank] = {}

    def prefixes(self, rank: int) -> set[tuple[int, ...]]:
        """Every token prefix (a whole number of blocks) rank ``rank`` holds."""
        return {p for p in self.blocks.get(rank, {}).values() if p is not None}

    def match(self, rank: int, tokens: Sequence[int], block_size: int) -> int:
        """Tokens of the longest prefix of ``tokens`` held by ``rank``, in whole blocks."""
        held = self.prefixes(rank)
        n = 0
        while n + block_size <= len(tokens) and tuple(tokens[: n + block_size]) in held:
            n += block_size
        return n


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` every 20 ms until true; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)
