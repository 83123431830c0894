"""This engine's part in disaggregated prefill/decode serving: one leg of a request.

``kvevents engine --disaggregation-mode prefill|decode`` makes the engine one half of a
P/D pair; ``null`` (the default) is an ordinary engine, which ignores P/D fields as
SGLang and vLLM do without disaggregation. A request whose fields ask for a hand-off
(:mod:`kvevents.engine.handoff`) runs here; one without is served locally, so a router
may skip the prefill hop for a decode that already holds a prompt.

* **prefill**: the prompts run on one rank, generating at most one token (its cache
  stores and publishes their blocks as always), and the result is registered with the
  bootstrap server (:mod:`kvevents.engine.bootstrap`): under each SGLang room, reserved
  before the run so that a duplicate is refused and a waiting decode learns of a
  failure at once; or under a new vLLM request id, which the answer's
  ``kv_transfer_params`` names beside the bootstrap server's host and port.
* **decode**: take each room, or the request id, from the bootstrap server named
  (waiting up to ``--disaggregation-timeout``), check it against the request, wait
  ``--transfer-us-per-block`` per block, then run each prompt with its received blocks:
  the rank stores them (``BlockStored`` for those it lacked), counts them as cached
  tokens and decodes as asked.

Errors are :class:`~kvevents.engine.transfer_registry.DisaggregationError` with the
status to answer: 400 for fields that disagree, 409 for a room registered or taken
twice, 502 for a failed prefill or an unreachable bootstrap server, 504 for a room that
never came.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvevents.engine.bootstrap import BootstrapClient, BootstrapServer
from kvevents.engine.handoff import (
    SGLangHandoff,
    VLLMHandoff,
    decode_keys,
    parse_handoff,
    received_blocks,
)
from kvevents.engine.transfer_registry import (
    DisaggregationError,
    PromptKV,
    Transfer,
    TransferRegistry,
)
from kvevents.transport.endpoints import WILDCARD_HOSTS
from kvevents.types import StrEnum
from kvevents.wire.server_info import LOCAL_PREFILL_KEY

__all__ = [
    "Disaggregation",
    "DisaggregationConfig",
    "DisaggregationError",
    "DisaggregationMode",
    "LegResult",
]

RunPrompt = Callable[
    [list[int], int | None, int, dict[str, Any] | None], Awaitable[tuple[int, dict[str, Any]]]
]
"""The engine's generate: (token ids, rank or None, max new tokens, what the rank is
told besides) -> (rank used, the rank's result)."""


class DisaggregationMode(StrEnum):
    """``--disaggregation-mode``, SGLang's values."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class DisaggregationConfig:
    """The engine's P/D settings (``kvevents engine`` flags)."""

    mode: DisaggregationMode = DisaggregationMode.NULL
    bootstrap_port: int = 8998
    """``--disaggregation-bootstrap-port`` (prefill only; 0: the OS picks)."""
    transfer_us_per_block: float = 10.0
    """``--transfer-us-per-block``: simulated time a decode spends receiving one block."""
    timeout: float = 30.0
    """``--disaggregation-timeout``: how long a decode waits for its room, and how long
    a prefill keeps a registration nobody takes."""


@dataclass(frozen=True)
class LegResult:
    """One leg's outcome: the rank used, each prompt's rank result, and (a vLLM prefill)
    the ``kv_transfer_params`` its answer carries."""

    rank: int
    results: list[dict[str, Any]]
    kv_transfer_params: dict[str, Any] | None = None


Handoff = SGLangHandoff | VLLMHandoff


class Disaggregation:
    """The P/D role of one engine. A prefill has a ``server`` (started by :meth:`start`),
    a decode a ``client``; ``host`` is the engine's ``--host``."""

    def __init__(
        self,
        config: DisaggregationConfig,
        server: BootstrapServer | None,
        client: BootstrapClient | None,
        *,
        page_size: int,
        host: str,
        engine_id: str,
    ) -> None:
        self.config = config
        self.mode = config.mode
        self.engine_id = engine_id
        self._page = page_size
        self._host = host
        self.server = server
        self.client = client

    @classmethod
    def create(
        cls, config: DisaggregationConfig, *, host: str, page_size: int, api_key: str | None
    ) -> Disaggregation:
        """The role ``config`` asks for. A prefill binds its bootstrap port here, on
        ``host`` (a taken port fails now, naming the flag); ``api_key`` guards it, and a
        decode sends it to the prefills' bootstrap servers."""
        engine_id = f"kvevents-{uuid.uuid4().hex[:16]}"
        server = client = None
        if config.mode is DisaggregationMode.PREFILL:
            registry = TransferRegistry(config.timeout)
            server = BootstrapServer.bind(host, config.bootstrap_port, registry, engine_id, api_key)
        elif config.mode is DisaggregationMode.DECODE:
            client = BootstrapClient(api_key)
        return cls(config, server, client, page_size=page_size, host=host, engine_id=engine_id)

    def server_info(self) -> dict[str, Any]:
        """The top-level ``/server_info`` members. A decode instance also says that it
        prefills a request sent without a prefill itself (``disaggregation_decode_local_prefill``),
        which an SGLang decode server cannot: a router sends such one every request's
        prefill."""
        port = self.server.port if self.server is not None else None
        info: dict[str, Any] = {
            "disaggregation_mode": str(self.mode),
            "disaggregation_bootstrap_port": port,
        }
        if str(self.mode) == "decode":
            info[LOCAL_PREFILL_KEY] = True
        return info

    async def start(self) -> None:
        if self.server is not None:
            await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
        if self.client is not None:
            await self.client.aclose()

    def handoff(
        self, fields: Mapping[str, Any], prompts: int, n: Any = 1, *, stream: bool = False
    ) -> Handoff | None:
        """The hand-off a request asks of this engine, or None (serve it locally)."""
        if self.mode is DisaggregationMode.NULL:
            return None
        handoff = parse_handoff(fields, prompts, n)
        if isinstance(handoff, VLLMHandoff):
            wants = DisaggregationMode.PREFILL if handoff.prefill else DisaggregationMode.DECODE
            if wants is not self.mode:
                flag = "do_remote_decode" if handoff.prefill else "do_remote_prefill"
                raise DisaggregationError(
                    f"kv_transfer_params.{flag} asks for a {wants} leg, but this engine runs "
                    f"--disaggregation-mode {self.mode}: send it to a {wants} engine"
                )
            if handoff.prefill and stream:
                raise DisaggregationError(
                    "a prefill leg (kv_transfer_params.do_remote_decode) must not stream: "
                    "its JSON answer carries the kv_transfer_params for the decode leg"
                )
        return handoff

    async def run(
        self,
        handoff: Handoff,
        generate: RunPrompt,
        prompts: list[list[int]],
        rank: int | None,
        max_new: int,
        keys: dict[str, Any] | None,
        request_host: str | None = None,
    ) -> LegResult:
        """Run this engine's leg of ``handoff`` with ``generate`` (see the module docstring)."""
        if self.mode is DisaggregationMode.PREFILL:
            if isinstance(handoff, SGLangHandoff):
                return await self._prefill_rooms(handoff, generate, prompts, rank, max_new, keys)
            return await self._prefill_request(generate, prompts, rank, max_new, keys, request_host)
        if handoff.host is None or handoff.port is None:  # a vLLM decode leg has both
            raise DisaggregationError(
                "bootstrap_host and bootstrap_port are missing: a decode leg needs the "
                "prefill engine's bootstrap server (its disaggregation_bootstrap_port)"
            )
        assert self.client is not None
        transfers = await self.client.take_all(
            handoff.host, handoff.port, decode_keys(handoff), self.config.timeout
        )
        received = received_blocks(handoff, prompts, transfers, self._page)
        blocks = sum(received)
        if blocks and self.config.transfer_us_per_block > 0:
            await asyncio.sleep(blocks * self.config.transfer_us_per_block / 1e6)
        extra = [{**(keys or {}), "received_blocks": b} for b in received]
        return await _run_all(generate, prompts, rank, max_new, extra)

    async def _prefill_rooms(
        self,
        handoff: SGLangHandoff,
        generate: RunPrompt,
        prompts: list[list[int]],
        rank: int | None,
        max_new: int,
        keys: dict[str, Any] | None,
    ) -> LegResult:
        assert self.server is not None
        registry = self.server.registry
        if handoff.prefill_dp_rank is not None:
            if rank is not None and rank != handoff.prefill_dp_rank:
                raise DisaggregationError(
                    f"routed_dp_rank={rank} and disagg_prefill_dp_rank="
                    f"{handoff.prefill_dp_rank} disagree on this prefill leg; give one rank"
                )
            rank = handoff.prefill_dp_rank
        every = [room for per in handoff.rooms for room in per]
        reserved: list[int] = []
        try:
            for room in every:
                registry.reserve(room)
                reserved.append(room)
        except DisaggregationError as exc:
            for room in reserved:
                registry.fail(room, f"its prefill request was refused: {exc}")
            raise
        try:
            leg = await _run_all(
                generate, prompts, rank, min(max_new, 1), [keys or {}] * len(prompts)
            )
        except BaseException as exc:
            for room in every:
                registry.fail(room, str(exc) or type(exc).__name__)
            raise
        for prompt, rooms in zip(prompts, handoff.rooms, strict=True):
            transfer = self._transfer(leg.rank, [prompt])
            for room in rooms:
                registry.complete(room, transfer)
        return leg

    async def _prefill_request(
        self,
        generate: RunPrompt,
        prompts: list[list[int]],
        rank: int | None,
        max_new: int,
        keys: dict[str, Any] | None,
        request_host: str | None,
    ) -> LegResult:
        assert self.server is not None
        leg = await _run_all(generate, prompts, rank, min(max_new, 1), [keys or {}] * len(prompts))
        transfer = self._transfer(leg.rank, prompts)
        request_id = f"{self.engine_id}-{uuid.uuid4().hex[:16]}"
        self.server.registry.reserve(request_id)
        self.server.registry.complete(request_id, transfer)
        host = self._host
        if host in WILDCARD_HOSTS or not host:  # reached through the address the router used
            host = request_host or "127.0.0.1"
        blocks = sum(p.block_count for p in transfer.prompts)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(blocks)),
            "remote_engine_id": self.engine_id,
            "remote_host": host,
            "remote_port": self.server.port,
            "remote_request_id": request_id,
            "tp_size": 1,
        }
        return LegResult(leg.rank, leg.results, params)

    def _transfer(self, rank: int, prompts: Sequence[list[int]]) -> Transfer:
        return Transfer(
            engine_id=self.engine_id,
            dp_rank=rank,
            page_size=self._page,
            prompts=[PromptKV(list(p), len(p) // self._page) for p in prompts],
        )


async def _run_all(
    generate: RunPrompt,
    prompts: list[list[int]],
    rank: int | None,
    max_new: int,
    extra: list[dict[str, Any]],
) -> LegResult:
    """Every prompt on one rank (the first picks it when none is given), as a batch runs."""
    rank, first = await generate(prompts[0], rank, max_new, extra[0] or None)
    rest = await asyncio.gather(
        *(
            generate(p, rank, max_new, e or None)
            for p, e in zip(prompts[1:], extra[1:], strict=True)
        )
    )
    return LegResult(rank, [first, *(r for _, r in rest)])
