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
order, each hash remembering the token prefix it covers. Tests compare with it both
our in-process ``PrefixIndex`` (:class:`IndexFeed`) and the ``kvevents router``
service's index (``GET /dump``, see ``real_vllm_router``), and all of them with (2).
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from real_vllm_router import RouterProcess, vllm_engine_args

from kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Delivery,
    Holder,
    KVEventBatch,
    Loss,
    Reset,
    Router,
    Signal,
    StreamSpec,
    Subscriber,
    content_keys,
)

ENV_PREFIX = "KVEVENTS_REAL_VLLM_"
ENV_URL = ENV_PREFIX + "URL"
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
    def from_env(cls, env: Mapping[str, str] | None = None, prefix: str = ENV_PREFIX) -> RealVLLM:
        """From ``env`` (default ``os.environ``): the variables ``vllm_server.py env`` exports,
        named ``prefix`` + ``URL`` and so on (a P/D run names its two instances apart)."""
        env = os.environ if env is None else env
        needed = ("URL", "KV_ENDPOINT", "REPLAY_ENDPOINT", "DP_SIZE", "MODEL", "STATE")
        missing = [prefix + k for k in needed if prefix + k not in env]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not set: run the suite with {SCRIPT}")

        def get(key: str, default: str) -> str:
            return env.get(prefix + key, default)

        return cls(
            url=env[prefix + "URL"].rstrip("/"),
            kv_endpoint=env[prefix + "KV_ENDPOINT"],
            replay_endpoint=env[prefix + "REPLAY_ENDPOINT"],
            dp_size=int(env[prefix + "DP_SIZE"]),
            model=env[prefix + "MODEL"],
            block_size=int(get("BLOCK_SIZE", "32")),
            num_blocks=int(get("NUM_BLOCKS", "20")),
            topic=get("TOPIC", "kv"),
            hash_mode=get("HASH_MODE", "int"),
            state_dir=env[prefix + "STATE"],
        )

    def router_engine_args(self) -> list[str]:
        """The flags describing this vLLM to ``kvevents router``, after ``--engine URL``."""
        return vllm_engine_args(
            kv_endpoint=self.kv_endpoint,
            replay_endpoint=self.replay_endpoint,
            dp_size=self.dp_size,
            topic=self.topic,
            block_size=self.block_size,
        )

    def start_router(
        self, *extra: str, log: Path | None = None, ask_engine: bool = False
    ) -> RouterProcess:
        """``kvevents router`` in front of this vLLM, tokenizing text with its model's
        ``tokenizer.json`` or, ``ask_engine``, with vLLM's own ``/tokenize`` (which also
        renders chats); ``extra`` router options (``--policy``...). Stop it after."""
        if ask_engine:
            tokenizer = ["--tokenize-endpoint", f"{self.url}/tokenize"]
        else:
            tokenizer = ["--tokenizer", self.model]
        return RouterProcess(
            self.url,
            self.router_engine_args(),
            *tokenizer,
            *extra,
            log=log or Path(self.state_dir) / "router.log",
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
        self,
        tokens: Sequence[int],
        rank: int | None,
        *,
        max_tokens: int = 1,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        """POST /v1/completions with token ids; returns vLLM's ``usage`` block.

        ``max_tokens=1`` finishes the request in its prefill step, so every event it
        causes is in that one step's batch.
        """
        headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
        body: dict[str, Any] = {
            "model": "tiny",
            "prompt": list(tokens),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        resp = self.http.post("/v1/completions", json=body, headers=headers)
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
    prefix (a parent this model does not hold leaves the prefix unknown, ``None``, and
    is counted in :attr:`unknown_parents`). vLLM may hold two physical blocks under one
    hash and stores and removes each separately, so copies are counted: a hash is held
    while its count is above zero. ``BlockRemoved`` decrements, ``AllBlocksCleared``
    drops everything. O(blocks) memory, no cleverness: the reference the index is
    checked against.
    """

    def __init__(self) -> None:
        self.blocks: dict[int, dict[Any, tuple[tuple[int, ...] | None, int]]] = {}
        self.unknown_parents = 0
        self.unknown_removals = 0
        self.removed = 0
        self.cleared = 0

    def apply(self, rank: int, batch: KVEventBatch) -> None:
        held = self.blocks.setdefault(rank, {})
        for event in batch.events:
            if isinstance(event, BlockStored):
                size = event.block_size
                prefix: tuple[int, ...] | None = ()
                if event.parent_block_hash is not None:
                    prefix = held.get(event.parent_block_hash, (None, 0))[0]
                    if prefix is None:
                        self.unknown_parents += 1
                for i, block_hash in enumerate(event.block_hashes):
                    chunk = tuple(event.token_ids[i * size : (i + 1) * size])
                    prefix = None if prefix is None else prefix + chunk
                    copies = held.get(block_hash, (None, 0))[1]
                    held[block_hash] = (prefix, copies + 1)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    if block_hash not in held:
                        self.unknown_removals += 1
                        continue
                    self.removed += 1
                    prefix, copies = held[block_hash]
                    if copies > 1:
                        held[block_hash] = (prefix, copies - 1)
                    else:
                        del held[block_hash]
            elif isinstance(event, AllBlocksCleared):
                self.cleared += 1
                held.clear()

    def clear(self, rank: int) -> None:
        self.blocks[rank] = {}

    def hashes(self, rank: int) -> set[Any]:
        """The engine hashes rank ``rank`` holds."""
        return set(self.blocks.get(rank, {}))

    def prefixes(self, rank: int) -> set[tuple[int, ...]]:
        """Every token prefix (a whole number of blocks) rank ``rank`` holds."""
        return {p for p, _ in self.blocks.get(rank, {}).values() if p is not None}

    def content_keys(self, rank: int, block_size: int) -> set[int]:
        """Our content key of every block rank ``rank`` holds (the key of its whole prefix)."""
        return {content_keys(p, block_size)[-1] for p in self.prefixes(rank)}

    def match(self, rank: int, tokens: Sequence[int], block_size: int) -> int:
        """Tokens of the longest prefix of ``tokens`` held by ``rank``, in whole blocks."""
        held = self.prefixes(rank)
        n = 0
        while n + block_size <= len(tokens) and tuple(tokens[: n + block_size]) in held:
            n += block_size
        return n


class IndexFeed:
    """A :class:`Subscriber` on every rank of the real vLLM feeding an in-process
    :class:`Router` (its :class:`PrefixIndex`) and the :class:`EventModel`, in a
    background thread, exactly as the router service consumes its streams.

    The router clears a holder on ``Reset`` and ``Loss``; the model does the same. Every
    signal is kept in :attr:`signals`. :meth:`wait_for` blocks on a condition variable
    notified after each item, with a deadline.
    """

    def __init__(self, vllm: RealVLLM) -> None:
        self.vllm = vllm
        self.holders = [Holder(vllm.url, r) for r in range(vllm.dp_size)]
        self.router = Router(block_size=vllm.block_size)
        self.index = self.router.index
        for holder in self.holders:
            self.router.add_holder(holder, block_size=vllm.block_size)
        self.model = EventModel()
        self.signals: list[Signal] = []
        self.deliveries = 0
        self.cond = threading.Condition()
        self._stop = threading.Event()
        self.sub = Subscriber(
            streams=[
                StreamSpec.from_endpoint(
                    vllm.rank_endpoint(r),
                    replay_endpoint=vllm.rank_replay_endpoint(r),
                    topic=vllm.topic,
                    worker=vllm.url,
                    dp_rank=r,
                    block_size=vllm.block_size,
                )
                for r in range(vllm.dp_size)
            ]
        )
        self.thread = threading.Thread(target=self._run, name="real-vllm-feed", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            item = self.sub.get(timeout=0.1)
            if item is None:
                continue
            with self.cond:
                self.router.handle(item)
                if isinstance(item, Delivery):
                    self.model.apply(item.holder.dp_rank, item.batch)
                    self.deliveries += 1
                else:
                    self.signals.append(item)
                    if isinstance(item, (Reset, Loss)) and item.holder is not None:
                        self.model.clear(item.holder.dp_rank)
                self.cond.notify_all()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5.0)
        self.sub.close()

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Block until ``condition()`` (evaluated under the feed's lock) is true."""
        with self.cond:
            if not self.cond.wait_for(condition, timeout):
                raise AssertionError(
                    f"timed out after {timeout:.0f} s waiting for {what}; signals so far: "
                    f"{[s.to_dict() for s in self.signals]}"
                )

    def holds(self, rank: int, tokens: Sequence[int]) -> bool:
        """True when the model holds every full block of ``tokens`` on ``rank``."""
        bs = self.vllm.block_size
        full = len(tokens) // bs * bs
        return self.model.match(rank, tokens, bs) == full

    def settle(
        self,
        client: VLLMClient,
        rank: int,
        prompts: Prompts,
        timeout: float = 30.0,
        router: RouterProcess | None = None,
    ) -> None:
        """Make sure every event rank ``rank`` published so far has been applied, here
        and (given ``router``) in the router service too.

        Sends a fresh one-block prompt to the rank and waits until its block is in.
        Events of one stream are delivered in seq order, so everything the rank
        published before it is applied too. (The barrier's own block stays cached: the
        comparisons include it.)
        """
        barrier = prompts.fresh(self.vllm.block_size + 1)
        client.complete(barrier, rank)
        self.wait_for(lambda: self.holds(rank, barrier), timeout, f"rank {rank}'s barrier block")
        if router is not None:
            router.wait_holds(rank, barrier, self.vllm.block_size, timeout)

    def predicted_cached_tokens(self, rank: int, tokens: Sequence[int]) -> int:
        """What the index says rank ``rank`` will serve from cache for ``tokens``."""
        with self.cond:
            found = self.index.holder_match(self.index.match(tokens), self.holders[rank])
        return min(found.gpu * self.vllm.block_size, self.vllm.max_cached_tokens(len(tokens)))

    def assert_index_equals_model(self, rank: int) -> None:
        """The index holds for ``rank`` exactly the blocks vLLM's events say it holds:
        the same engine hashes, and the same content keys (prefixes)."""
        holder = self.holders[rank]
        bs = self.vllm.block_size
        with self.cond:
            index_hashes = self.index.holder_hashes(holder)
            index_keys = self.index.holder_keys(holder)
            model_hashes = self.model.hashes(rank)
            model_keys = self.model.content_keys(rank, bs)
            unknown = self.model.unknown_parents
        assert unknown == 0, "vLLM's events referred to a parent block never stored"
        assert index_hashes == model_hashes, (
            f"rank {rank}: index has {len(index_hashes)} engine hashes, events say "
            f"{len(model_hashes)}; only in index {len(index_hashes - model_hashes)}, "
            f"only in events {len(model_hashes - index_hashes)}"
        )
        assert index_keys == model_keys

    def assert_router_equals_model(self, router: RouterProcess, rank: int) -> None:
        """The router service's index (``GET /dump``) holds for ``rank`` exactly the blocks
        vLLM's events say it holds: the same engine hashes in the GPU tier, and the same
        content keys (one per held token prefix). Settle both first."""
        index = router.index()
        holder = router.holder(rank)
        router_hashes = index.holder_hashes(holder)
        router_keys = index.holder_keys(holder)
        with self.cond:
            model_hashes = self.model.hashes(rank)
            model_keys = self.model.content_keys(rank, self.vllm.block_size)
        assert router_hashes == model_hashes, (
            f"rank {rank}: router /dump has {len(router_hashes)} engine hashes, vLLM's events "
            f"say {len(model_hashes)}; only in the router {len(router_hashes - model_hashes)}, "
            f"only in the events {len(model_hashes - router_hashes)}"
        )
        assert router_keys == model_keys


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` every 20 ms until true; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)
