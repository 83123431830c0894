"""The simulated engine's HTTP API (FastAPI), in front of the rank processes.

Endpoints (JSON in and out):

* ``GET /server_info``: ``dp_size``, ``tp_size``, ``page_size``, the scheduler plan, the
  models (:mod:`kvevents.engine.models`), and the ``kv_events`` discovery block
  (:mod:`kvevents.engine.server_info`; absent when publishing is off or not on TCP).
* ``POST /generate``: ``{"input_ids": [...]} | {"text": "..."}``, optional
  ``routed_dp_rank`` (SGLang's name; ``data_parallel_rank`` accepted), ``lora_path``,
  ``max_new_tokens`` (top level or in ``sampling_params``), ``cache_salt`` and per-block
  ``extra_keys`` (as vLLM hashes them: :mod:`kvevents.engine.cache`). Answers ``dp_rank``,
  ``prompt_tokens``, ``cached_tokens``, ``completion_tokens``, ``output_ids``, ``text``
  and SGLang's ``meta_info``. Without a rank, requests go round-robin over live ranks.
* ``GET /health`` (liveness) and ``GET /ready`` (readiness: :mod:`kvevents.engine.readiness`).
* ``POST /flush_cache[?dp_rank=r]``, ``GET /load``, ``GET /kv_blocks?dp_rank=r`` (the
  hashes rank r holds: the ground truth for consistency checks),
  ``POST /admin/restart_rank?dp_rank=r[&signal=kill|term]``.
* ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` and
  ``POST /tokenize``, vLLM-style: :mod:`kvevents.engine.openai_api`.
* With ``--disaggregation-mode``, the P/D fields of SGLang and vLLM
  (:mod:`kvevents.engine.disaggregation`).

Every endpoint is described in ``/openapi.json`` and ``/docs``
(:mod:`kvevents.engine.api_schema`). A malformed body or query answers 400 naming the
field (:mod:`kvevents.engine.bodies`), a body above ``--max-body-bytes`` 413, an
unavailable rank 503, a rank that does not answer within ``--request-timeout`` 504.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvevents.api import install
from kvevents.engine.api_schema import OPERATIONS, GenerateRequest
from kvevents.engine.bodies import BodyError, diagnose, read_body
from kvevents.engine.disaggregation import Disaggregation, DisaggregationError
from kvevents.engine.models import ServedModels, lora_keys
from kvevents.engine.openai_api import add_openai_routes
from kvevents.engine.readiness import engine_readiness
from kvevents.engine.server_info import build_kv_events_block
from kvevents.engine.supervisor import EngineRankError, RankSupervisor
from kvevents.engine.topology import Topology
from kvevents.errors import RequestError
from kvevents.publish.config import KVEventsConfig
from kvevents.text.tokenizer import ByteTokenizer

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "EngineInfo", "EngineLimits", "create_app"]

DEFAULT_MAX_NEW_TOKENS = 16

_GENERATE_DECODER = msgspec.json.Decoder(GenerateRequest)


@dataclass(frozen=True)
class EngineInfo:
    """The engine's static settings, as ``/server_info`` reports them."""

    topology: Topology
    page_size: int
    max_blocks: int
    hash_scheme: str
    kv_events_config: KVEventsConfig
    models: ServedModels = field(default_factory=ServedModels)


@dataclass(frozen=True)
class EngineLimits:
    """Bounds on the work one request may cause (``kvevents engine`` flags in brackets).

    * ``max_new_tokens`` [``--max-new-tokens-limit``]: a request asking for more is
      answered 400 (``/generate``, ``/v1/completions``, ``/v1/chat/completions``).
    * ``request_timeout`` [``--request-timeout``]: seconds a generate call may wait for
      its rank; past it the request answers 504, so a stalled rank does not hold
      connections open.
    * ``rank_load_timeout``: seconds ``GET /load`` waits for each rank; a rank that does
      not answer in time is reported ``available: false`` while the others are reported
      as usual (well under the router's 5 s poll timeout).
    * ``max_body_bytes`` [``--max-body-bytes``]: a larger request body answers 413,
      refused from its ``Content-Length`` or, when chunked, as soon as the count passes
      it, before it is buffered whole. 8 MiB holds a 128k-token prompt as JSON ids.
    """

    max_new_tokens: int = 32_768
    request_timeout: float = 60.0
    rank_load_timeout: float = 1.0
    max_body_bytes: int = 8 << 20


class BadRequest(RequestError):
    """A request the engine answers with 400 and this message."""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _query_rank(request: Request, dp_size: int, required: bool) -> int | None:
    text = request.query_params.get("dp_rank")
    if text is None:
        if required:
            raise BadRequest(
                f"query parameter dp_rank is missing: add ?dp_rank=R, R in 0..{dp_size - 1}"
            )
        return None
    try:
        rank = int(text)
    except ValueError:
        rank = -1
    if not 0 <= rank < dp_size:
        raise BadRequest(f"query parameter dp_rank={text!r} must be an int in 0..{dp_size - 1}")
    return rank


def _parse_generate(
    body: bytes, dp_size: int, tokenizer: ByteTokenizer, limit: int, models: ServedModels
) -> tuple[list[int], int | None, int, dict[str, Any], GenerateRequest]:
    try:
        req = _GENERATE_DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid /generate body: {exc}") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise diagnose(body, f"/generate body is not a JSON object: {exc}") from None
    if (req.input_ids is None) == (req.text is None):
        raise BadRequest("give exactly one of input_ids (a list of token ids) or text (a string)")
    tokens = req.input_ids if req.input_ids is not None else tokenizer.encode(req.text or "")
    if not tokens:
        raise BadRequest("the prompt is empty: input_ids or text must hold at least one token")
    rank = req.routed_dp_rank
    if req.data_parallel_rank is not None:
        if rank is not None and rank != req.data_parallel_rank:
            raise BadRequest(
                f"routed_dp_rank={rank} and data_parallel_rank={req.data_parallel_rank} disagree; give one"
            )
        rank = req.data_parallel_rank
    if rank is not None and not 0 <= rank < dp_size:
        raise BadRequest(
            f"routed_dp_rank={rank} is out of range: this engine has ranks 0..{dp_size - 1}"
        )
    max_new = req.max_new_tokens
    if max_new is None and req.sampling_params is not None:
        max_new = req.sampling_params.max_new_tokens
    if max_new is not None and max_new > limit:
        raise BadRequest(
            f"max_new_tokens={max_new} is above this engine's limit of {limit} "
            "(kvevents engine --max-new-tokens-limit): ask for fewer tokens"
        )
    keys: dict[str, Any] = {}
    if req.cache_salt is not None:
        keys["cache_salt"] = req.cache_salt
    if req.extra_keys:
        try:
            msgspec.msgpack.encode(req.extra_keys)  # as the rank gets them
        except (OverflowError, TypeError) as exc:
            raise BadRequest(
                f"extra_keys cannot be keyed: {exc}; give ints in -2**63..2**64-1"
            ) from None
        keys["extra_keys"] = req.extra_keys
    if req.lora_path is not None:
        # an adapter by name: a served model's name, or any name on an engine started
        # without adapters, is none (it ran the base model)
        lora = next((m for m in models.loras if m.name == req.lora_path), None)
        if lora is None:
            raise BadRequest(
                f"lora_path={req.lora_path!r} is no adapter of this engine; its adapters: "
                f"{', '.join(m.name for m in models.loras) or 'none (kvevents engine --lora-modules)'}"
            )
        keys |= lora_keys(lora)
    if max_new is None:
        max_new = min(DEFAULT_MAX_NEW_TOKENS, limit)  # the default never passes the limit
    return tokens, rank, max_new, keys, req


def create_app(
    supervisor: RankSupervisor,
    info: EngineInfo,
    limits: EngineLimits | None = None,
    disaggregation: Disaggregation | None = None,
) -> FastAPI:
    """The FastAPI application serving the endpoints in the module docstring;
    ``disaggregation`` is the engine's P/D role (None: an ordinary engine)."""
    limits = limits or EngineLimits()
    # /docs is kvevents.api's page (install): FastAPI's own load their assets from a CDN
    app = FastAPI(title="kvevents simulated engine", docs_url=None, redoc_url=None)
    tokenizer = ByteTokenizer()
    dp_size = info.topology.dp_size
    round_robin = itertools.count()

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(BodyError)
    async def _body_error(request: Request, exc: BodyError) -> JSONResponse:
        return _error(exc.status, str(exc))

    @app.exception_handler(EngineRankError)
    async def _rank_error(request: Request, exc: EngineRankError) -> JSONResponse:
        return _error(exc.status, str(exc))

    @app.exception_handler(DisaggregationError)
    async def _disaggregation_error(request: Request, exc: DisaggregationError) -> JSONResponse:
        return _error(exc.status, str(exc))

    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        topo = info.topology
        body: dict[str, Any] = {
            "dp_size": dp_size,
            "tp_size": topo.tp_size,
            "enable_dp_attention": topo.enable_dp_attention,
            "page_size": info.page_size,
            "max_blocks_per_rank": info.max_blocks,
            "hash_scheme": info.hash_scheme,
            "kv_events_config": info.kv_events_config.to_public_json(),
            "schedulers": [s.to_dict() for s in topo.schedulers],
            **info.models.server_info(),
            "disaggregation_mode": "null",
            "disaggregation_bootstrap_port": None,
        }
        if disaggregation is not None:
            body |= disaggregation.server_info()
        block = build_kv_events_block(
            info.kv_events_config, supervisor.bound_publishers(), dp_size, info.page_size
        )
        if block is not None:
            body["kv_events"] = block
        return JSONResponse(body)

    async def run_generate(
        tokens: list[int], rank: int | None, max_new: int, keys: dict[str, Any] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Generate on ``rank`` (round-robin over the live ranks when None), under ``lora``."""
        if rank is None:
            live = supervisor.live_ranks()
            if not live:
                raise EngineRankError("no rank is running")
            rank = live[next(round_robin) % len(live)]
        result: dict[str, Any] = await supervisor.call(
            rank,
            "generate",
            timeout=limits.request_timeout,
            input_ids=tokens,
            max_new_tokens=max_new,
            **(keys or {}),
        )
        return rank, result

    add_openai_routes(
        app,
        dp_size,
        run_generate,
        models=info.models,
        max_new_tokens=limits.max_new_tokens,
        max_body_bytes=limits.max_body_bytes,
        disaggregation=disaggregation,
    )

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        tokens, rank, max_new, keys, req = _parse_generate(
            await read_body(request, limits.max_body_bytes),
            dp_size,
            tokenizer,
            limits.max_new_tokens,
            info.models,
        )
        handoff = None
        if disaggregation is not None:
            n = 1 if req.sampling_params is None else req.sampling_params.n
            handoff = disaggregation.handoff(msgspec.structs.asdict(req), 1, n)
        if handoff is None:
            rank, result = await run_generate(tokens, rank, max_new, keys)
        else:
            assert disaggregation is not None
            leg = await disaggregation.run(
                handoff, run_generate, [tokens], rank, max_new, keys, request.url.hostname
            )
            rank, result = leg.rank, leg.results[0]
        output_ids = result["output_ids"]
        meta = {
            "prompt_tokens": result["prompt_tokens"],
            "cached_tokens": result["cached_tokens"],
            "completion_tokens": len(output_ids),
            "dp_rank": rank,
            "finish_reason": {"type": "length", "length": len(output_ids)},
        }
        body = {"text": tokenizer.decode(output_ids), "output_ids": output_ids, **meta}
        return JSONResponse(body | {"meta_info": meta})

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> JSONResponse:
        rank = _query_rank(request, dp_size, required=False)
        targets = list(range(dp_size)) if rank is None else [rank]
        await asyncio.gather(*(supervisor.call(r, "flush") for r in targets))
        return JSONResponse({"flushed": targets})

    @app.get("/health")
    async def health() -> JSONResponse:
        ranks = supervisor.status()
        dead = supervisor.dead_ranks()
        body = {"status": "ok" if not dead else "unhealthy", "dead_ranks": dead, "ranks": ranks}
        return JSONResponse(body, status_code=200 if not dead else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        state = engine_readiness(supervisor.status(), publishing=info.kv_events_config.enabled)
        return JSONResponse(msgspec.to_builtins(state), status_code=200 if state.ok else 503)

    @app.get("/load")
    async def load() -> JSONResponse:
        async def one(r: int) -> dict[str, Any]:
            try:
                figures: dict[str, Any] = await supervisor.call(
                    r, "load", timeout=limits.rank_load_timeout
                )
            except EngineRankError as exc:
                return {"dp_rank": r, "available": False, "error": str(exc)}
            return figures | {"available": True}

        ranks = await asyncio.gather(*(one(r) for r in range(dp_size)))
        return JSONResponse({"dp_size": dp_size, "ranks": list(ranks)})

    @app.get("/kv_blocks")
    async def kv_blocks(request: Request) -> JSONResponse:
        rank = _query_rank(request, dp_size, required=True)
        assert rank is not None
        result = await supervisor.call(rank, "kv_blocks")
        hashes = result["block_hashes"]
        return JSONResponse(
            {
                "dp_rank": rank,
                "block_size": info.page_size,
                "num_blocks": len(hashes),
                "block_hashes": hashes,
            }
        )

    @app.post("/admin/restart_rank")
    async def restart_rank(request: Request) -> JSONResponse:
        rank = _query_rank(request, dp_size, required=True)
        assert rank is not None
        name = request.query_params.get("signal", "kill")
        sigs = {"kill": signal.SIGKILL, "term": signal.SIGTERM}
        if name not in sigs:
            raise BadRequest(f"query parameter signal={name!r} must be 'kill' or 'term'")
        return JSONResponse(await supervisor.restart(rank, sigs[name]))

    install(app, OPERATIONS)
    return app
