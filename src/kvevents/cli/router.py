"""``kvevents router``: the KV-aware router as an HTTP service (FastAPI + uvicorn).

    kvevents router --engine http://127.0.0.1:30000 [--engine URL ...] [--port 8100]
    kvevents router --engine http://10.0.0.5:8000 --kv-endpoint tcp://*:5557 \\
        --replay-endpoint tcp://*:5600 --dp-size 2 --topic kv --tokenizer MODEL_DIR
    kvevents router --engines-file engines.toml
    kvevents router --prefill http://10.0.0.5:30000 [8998] --decode http://10.0.0.6:30001

An engine is discovered through its ``/server_info`` (a vLLM through its
``/kv_event_sources``), or described by the options after its ``--engine``
(:mod:`kvevents.cli.engine_args`) or in an engines file
(:mod:`kvevents.subscribe.engine_spec`). The router follows every rank's stream, polls
each engine (:mod:`kvevents.router.fleet.engines`), and serves the OpenAI routes
(:mod:`kvevents.router.serve.openai`), ``/query`` and ``/route``
(:mod:`kvevents.router.serve.hot_path`; ``/route`` changes nothing unless the body says
``"record": true``), ``/generate``, ``/workers``, ``/health`` and ``/ready``
(:mod:`kvevents.router.serve.readiness`), ``/metrics``
(:mod:`kvevents.router.serve.metrics`) and ``/dump`` (the index snapshot a ``--peer``
replica starts from: :mod:`kvevents.router.fleet.warm_start`). With ``--prefill`` and
``--decode`` pools it serves disaggregated prefill/decode (:mod:`kvevents.router.decide.pd`).
Before any engine is registered routing answers 503; before any block size is known,
requests are routed by load alone and ``/query`` answers 503.

Security is off by default, as upstream engines have it: ``--api-key`` closes every
endpoint but the probes and the API description, ``--engine-api-key`` is what the router
sends engines, ``--ssl-*`` serve and verify HTTPS (docs/security.md).

With ``--port 0`` the OS picks the port; ``kvevents router ready http://HOST:PORT`` goes
to stdout once the service accepts requests, after each engine's first poll (bounded for
an engine that hangs), so the first request is routed with them; one more line follows
shortly, ``kvevents router: ready to route: N of M holders`` or ``... not ready to route``
with ``/ready``'s reasons. The options, and their ``--help`` groups, are
:mod:`kvevents.cli.router_options`'s; here are the checks between them and the service
they build.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable

import httpx

from kvevents.cli.engine_args import (
    curve_options,
    engine_specs,
    pool_specs,
)
from kvevents.cli.router_options import add_arguments, default_workers
from kvevents.cli.router_workers import serve_workers
from kvevents.cli.security import (
    SYNC_OPTIONS,
    RouterSecurity,
    router_security,
    sync_security,
)
from kvevents.errors import ConfigError
from kvevents.http.inline import HttpLimits
from kvevents.http.serving import run_event_loop, serve_app
from kvevents.index.types import TierCredits
from kvevents.router.decide.router import Router
from kvevents.router.decide.scoring import ScoringWeights
from kvevents.router.fleet.peers import LoadNotes, SyncTransport
from kvevents.router.fleet.senders import process_sender
from kvevents.router.fleet.warm_start import (
    load_from_peers,
    peer_url_problem,
    snapshot_bytes_bound,
)
from kvevents.router.prompts.tokenize import EndpointTokenizer, FileTokenizer, TextTokenizer
from kvevents.router.serve.app import create_app
from kvevents.router.serve.hot_path import DEFAULT_MAX_BODY_BYTES
from kvevents.router.serve.pd_legs import PDProtocol
from kvevents.router.serve.pd_mode import PDEngine, PDMode
from kvevents.router.serve.readiness import Readiness, print_readiness, report_readiness
from kvevents.router.serve.service import RouterService
from kvevents.subscribe.engine_spec import EngineSpec
from kvevents.subscribe.subscriber import Subscriber
from kvevents.types import (
    Holder,
)

__all__ = [
    "READY_PREFIX",
    "RouterService",
    "add_arguments",
    "build_service",
    "create_app",
    "default_workers",
    "run",
    "serve",
]

log = logging.getLogger("kvevents.router")

READY_PREFIX = "kvevents router ready "


# --- command line ---------------------------------------------------------------------------


def _credits(text: str) -> TierCredits:
    try:
        gpu, cpu, disk = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(
            f"--credits {text!r}: give three numbers GPU,CPU,DISK, e.g. 1.0,0.75,0.25"
        ) from None
    return TierCredits(gpu=gpu, cpu=cpu, disk=disk)


def _weights(args: argparse.Namespace) -> ScoringWeights:
    # each option was parsed with the bound ScoringWeights declares for its field
    if not 0.0 <= args.predicted_credit <= 1.0:
        raise ValueError(f"--predicted-credit {args.predicted_credit}: must be between 0 and 1")
    return ScoringWeights(
        load_weight=args.load_weight,
        foreign_request_blocks=args.foreign_request_blocks,
        balance_weight=args.balance_weight,
        balance_half_life=args.balance_half_life,
        predicted_credit=args.predicted_credit,
    )


def _tokenizer(args: argparse.Namespace) -> TextTokenizer | None:
    if args.tokenizer is not None:
        return FileTokenizer(args.tokenizer)
    if args.tokenize_endpoint is not None:
        return EndpointTokenizer(args.tokenize_endpoint)
    return None


def build_service(args: argparse.Namespace, *, warn: bool = True) -> RouterService:
    """The service of ``kvevents router ARGS``; ConfigError/ValueError for bad options.

    ``warn``: log the warnings about the options (the worker processes of ``--workers``
    leave that to the parent, which checks the options once before starting them).
    """
    router, specs, tokenizer = _check(args, warn=warn)
    secure = router_security(args)
    warm = None
    if args.peer:
        peers = secure.peers
        with httpx.Client(
            timeout=httpx.Timeout(5.0), headers=peers.headers(), verify=peers.verify()
        ) as client:
            index, warm = load_from_peers(
                args.peer,
                client=client,
                block_size=_known_block_size(router, specs),
                follows=_follows(specs),
                max_bytes=args.peer_max_bytes or snapshot_bytes_bound(args.max_entries),
                total_timeout=args.peer_timeout,
            )
        if index is not None:
            router.restore_index(index)
    # every holder restored from a peer, -1 (from the start) for one it had no batch of:
    # the subscriber drops those its engine turns out not to have
    applied = router.index.applied_seqs
    resume = {holder: applied.get(holder, -1) for holder in router.index.holders()}
    subscriber = Subscriber(resume=resume, http_credentials=secure.engines, **curve_options(args))
    try:
        for spec in specs:
            spec.follow(subscriber)
    except BaseException:
        subscriber.close()
        raise
    service = RouterService(
        router,
        specs,
        subscriber=subscriber,
        load_interval=args.load_interval,
        forward_timeout=args.forward_timeout,
        tokenizer=tokenizer,
        policy=args.policy,
        engine_credentials=secure.engines,
        pd=_pd_mode(args),
        engine_max_head_bytes=args.engine_max_head_bytes,
        engine_head_timeout=args.engine_head_timeout,
    )
    service.http_limits = HttpLimits(
        request_timeout=args.request_timeout, max_idle_connections=args.max_idle_connections
    )
    service.warm_start = warm
    service.sync = _sync(args, [s.url for s in specs])
    return service


def _follows(specs: list[EngineSpec]) -> Callable[[Holder], bool]:
    """Whether this router follows a holder of a peer's snapshot. A peer may follow
    engines, or ranks, this router does not: ranks of engines described here must be
    among theirs; a discovered engine's ranks that it does not list are dropped once
    discovery has read it (Removed)."""
    followed = {spec.worker for spec in specs}
    described = {
        Holder(s.worker, s.dp_rank) for spec in specs if spec.described for s in spec.streams()
    }
    fixed = {holder.worker for holder in described}
    return lambda holder: (
        holder.worker in followed and (holder.worker not in fixed or holder in described)
    )


def _known_block_size(router: Router, specs: list[EngineSpec]) -> int | None:
    """The block size the router keys requests at before any event: ``--block-size``,
    else the first engine's configured one (RouterService declares them in order, and
    the first sets it); None: it comes from the engines."""
    if router.index.block_size is not None:
        return router.index.block_size
    return next((spec.block_size for spec in specs if spec.block_size is not None), None)


def _sync(
    args: argparse.Namespace, engines: list[str], *, warn: bool = False
) -> SyncTransport | None:
    """The NATS transport of ``--sync``, or None; ConfigError when nats-py is missing.
    ``warn``: log what the link leaves open (no credentials, no TLS)."""
    if args.sync is None:
        for option in ("--sync-subject", "--sync-name", *SYNC_OPTIONS):
            if getattr(args, option.lstrip("-").replace("-", "_")) is not None:
                raise ConfigError(f"{option} needs --sync NATS_URL")
        return None
    try:
        from kvevents.router.fleet.nats_sync import NatsNoteTransport, default_subject
    except ImportError:
        raise ConfigError(
            "--sync needs the nats-py package: pip install 'kvevents[sync]'"
        ) from None
    transport = NatsNoteTransport(
        args.sync,
        args.sync_subject or default_subject(engines),
        security=sync_security(args),
        name=args.sync_name,
    )
    for warning in transport.warnings() if warn else ():
        log.warning("%s", warning)
    return transport


def _check(
    args: argparse.Namespace, *, warn: bool
) -> tuple[Router, list[EngineSpec], TextTokenizer | None]:
    """Every option checked, and what they build short of following the engines."""
    # the numeric options were checked as they were parsed (kvevents.types.bounded)
    if not 0 <= args.prediction_ttl < float("inf"):
        raise ValueError(
            f"--prediction-ttl {args.prediction_ttl}: must be a number of seconds >= 0 "
            "(0 turns predictions off)"
        )
    router = Router(
        block_size=args.global_block_size,
        credits=_credits(args.credits),
        weights=_weights(args),
        max_entries=args.max_entries,
        prediction_ttl_s=args.prediction_ttl or None,
        stall_after_s=args.stall_after or None,
    )
    specs = _engines(args)
    _pd_mode(args)  # refuse bad disaggregation options before any process starts
    # refuse bad --sync options before any process starts
    _sync(args, [s.url for s in specs], warn=warn)
    for url in args.peer:  # and --peer URLs with credentials, which it would show
        problem = peer_url_problem(url)
        if problem is not None:
            raise ConfigError(problem)
    router_security(args)  # and unreadable key files, certificates or CA bundles
    curve_options(args)  # and bad CURVE keys
    tokenizer = _tokenizer(args)
    if tokenizer is None and warn:
        for spec in specs:
            if spec.engine_kind != "kvevents":
                log.warning(
                    "engine %s is a %s engine, and text prompts and chats will be tokenized "
                    "with the simulated engine's byte tokenizer, which is not its model's: "
                    "they will match nothing it caches. Give --tokenize-endpoint "
                    "%s/tokenize (or --tokenizer MODEL_DIR); token-id prompts are unaffected",
                    spec.url,
                    spec.engine_kind,
                    spec.url,
                )
    return router, specs, tokenizer


def _engines(args: argparse.Namespace) -> list[EngineSpec]:
    """Every engine: ``--engine`` ones, or the pools' (``--prefill``, ``--decode``)."""
    specs = engine_specs(args)
    pooled = pool_specs(args)
    if not pooled:
        if not specs:
            raise ConfigError(
                "give at least one --engine URL (or --engines-file FILE), or --prefill URL "
                "and --decode URL for disaggregated serving"
            )
        return specs
    if specs:
        raise ConfigError(
            f"--engine {specs[0].url} (or --engines-file) cannot be mixed with --prefill and "
            "--decode: in disaggregated serving every engine is in a pool; give it as "
            "--prefill URL or --decode URL"
        )
    given = {pool for pool, _, _ in pooled}
    for pool, other in (("prefill", "decode"), ("decode", "prefill")):
        if pool not in given:
            raise ConfigError(
                f"--{other} needs at least one --{pool} engine: disaggregated serving sends "
                f"every request to a decode instance and, when the prompt is not cached, "
                f"a prefill one"
            )
    pooled_specs = [spec for _, spec, _ in pooled]
    seen: set[str] = set()
    for spec in pooled_specs:
        if spec.worker in seen:
            raise ConfigError(
                f"engine {spec.worker} is given twice; give each engine once, in one pool"
            )
        seen.add(spec.worker)
    return pooled_specs


def _pd_mode(args: argparse.Namespace) -> PDMode | None:
    """Disaggregated serving's settings from ``--prefill``/``--decode`` and their options,
    or None for one pool; ConfigError for options that do not fit together."""
    pooled = pool_specs(args)
    if not pooled:
        if args.pd_protocol is not None:
            raise ConfigError("--pd-protocol needs --prefill and --decode engines")
        return None
    kinds = {spec.engine_kind for _, spec, _ in pooled}
    protocol: PDProtocol
    if args.pd_protocol is not None:
        protocol = args.pd_protocol
    elif kinds == {"vllm"}:
        protocol = "vllm"
    elif "vllm" not in kinds:
        protocol = "sglang"
    else:
        raise ConfigError(
            "the --prefill and --decode engines mix vllm engines with "
            f"{' and '.join(sorted(kinds - {'vllm'}))} ones, which hand the KV over "
            "differently: give --engine-kind after each, or --pd-protocol sglang|vllm"
        )
    engines = [PDEngine(spec.url, spec.worker, pool, port) for pool, spec, port in pooled]
    return PDMode(
        engines,
        protocol,
        max_local_prefill_tokens=args.max_local_prefill_tokens,
        prefill_timeout=args.prefill_timeout,
    )


def run(args: argparse.Namespace) -> int:
    if args.http_server != "uvicorn":
        raise ConfigError(
            f"--http-server {args.http_server}: uvicorn (with httptools and uvloop) serves every "
            "route of the router, and no other server is offered: drop --http-server"
        )
    workers = default_workers() if args.workers is None else args.workers
    try:
        if workers > 1:
            _check(args, warn=True)  # refuse bad options once, before any process starts
        else:
            service = build_service(args)
        secure = router_security(args)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if workers > 1:
        return serve_workers(
            functools.partial(build_service, warn=False), args, workers, READY_PREFIX, secure
        )
    return run_event_loop(
        serve(
            service,
            args.host,
            args.port,
            args.max_body_bytes,
            secure,
        )
    )


async def serve(
    service: RouterService,
    host: str,
    port: int,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    security: RouterSecurity | None = None,
) -> int:
    """Serve the router until SIGINT or SIGTERM; prints the ready line once accepting requests.

    ``security``: the key clients need and the TLS to serve with (default: neither).
    """
    security = security or RouterSecurity()
    app = create_app(
        service,
        max_body_bytes=max_body_bytes,
        api_key=security.api_key,
        metrics_auth=security.metrics_auth,
    )
    notes = None
    if service.sync is not None and service.peers is None:
        sender = process_sender(service.sync.name, port, f"{os.getpid()}-{time.time_ns()}")
        notes = service.peers = LoadNotes(
            service.router,
            sender,
            [service.sync],
            follows=service.workers.__contains__,
            max_request_tokens=max_body_bytes,
        )
        notes.start()
    reported: list[asyncio.Task[Readiness]] = []  # held: a task only weakly referenced may vanish
    try:

        def announce(url: str) -> None:
            print(READY_PREFIX + url, flush=True)
            service.serving()
            reported.append(asyncio.create_task(report_readiness(service, print_readiness)))

        return await serve_app(
            app,
            host,
            port,
            READY_PREFIX,
            "router",
            announce=announce,
            tls=security.tls,
            limits=service.http_limits,
        )
    finally:
        for task in reported:
            task.cancel()
        if notes is not None:
            await notes.close()
