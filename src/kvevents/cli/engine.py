"""``kvevents engine``: start the simulated data-parallel engine and its HTTP server.

::

    kvevents engine --dp-size 4
    kvevents engine --dp-size 4 --kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557"}'

Everything is checked before any process starts: the scheduler topology
(:func:`~kvevents.engine.topology.plan_topology`), the KV-events config, the port plan
(overlapping or overflowing ranges are refused, naming them) and the HTTP port. Then one
process per rank starts (:mod:`kvevents.engine.supervisor`), the HTTP server
(:mod:`kvevents.engine.server`) starts on ``--host``/``--port`` (0: the OS picks), and
one machine-readable line goes to stdout::

    kvevents engine ready http://127.0.0.1:PORT

By default (:data:`DEFAULT_KV_EVENTS_CONFIG`) every rank publishes on its own OS-chosen
live and replay port on ``--kv-events-host`` (loopback), so engines on one machine never
collide, and ``/server_info`` lists each rank's endpoints: ``kvevents router --engine
URL`` needs no other flag. ``'{"publisher": "null"}'`` turns publishing off.
``--api-key`` and ``--ssl-certfile`` are docs/security.md's; ``--disaggregation-mode``
makes the engine one half of a P/D pair (:mod:`kvevents.engine.disaggregation`).

Ctrl-C or SIGTERM stops the server and every rank and exits 0, after in-flight requests
had ``--shutdown-timeout`` seconds to finish. A rank that dies on its own shows in
``/health`` (503) for ``--dead-rank-grace`` seconds, then the engine exits 1. The options
and their ``--help`` groups are :mod:`kvevents.cli.engine_options`'s; here are the
settings they fill and the serving loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any

from kvevents.cli.engine_options import add_arguments
from kvevents.cli.security import engine_api_key, tls_of
from kvevents.engine.disaggregation import (
    Disaggregation,
    DisaggregationConfig,
    DisaggregationMode,
)
from kvevents.engine.models import (
    ServedModels,
    parse_lora_modules,
    parse_served_model_names,
)
from kvevents.engine.rank import RankSpec, engine_kv_events_config
from kvevents.engine.server import EngineInfo, EngineLimits, create_app
from kvevents.engine.supervisor import RankSupervisor
from kvevents.engine.topology import Topology, plan_topology
from kvevents.errors import ConfigError
from kvevents.http.auth import OPEN_PATHS, ApiKey, ApiKeyGate, ServerTLS
from kvevents.http.serving import bind_http, http_url, start_http, stop_on_signals
from kvevents.publish.config import KVEventsConfig
from kvevents.transport.endpoints import PortPlan
from kvevents.types import (
    NonNegativeFloat,
    Port,
    PositiveFloat,
    PositiveInt,
    check_bound,
)
from kvevents.wire.hashing import get_hash_scheme

__all__ = [
    "DEFAULT_KV_EVENTS_CONFIG",
    "EngineSettings",
    "add_arguments",
    "run",
    "serve_engine",
]

READY_PREFIX = "kvevents engine ready "

DEFAULT_KV_EVENTS_CONFIG = (
    '{"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'
)
"""``--kv-events-config`` when none is given: publish, with replay, every rank on ports the
OS picks (bound on ``--kv-events-host``, loopback by default). Port 0, not SGLang's
5557: a second engine on the machine would collide with the first on a fixed base."""


@dataclass(frozen=True)
class EngineSettings:
    """Validated settings of one simulated engine (see :meth:`from_args`)."""

    topology: Topology
    kv_events_config: KVEventsConfig
    page_size: int = 16
    max_blocks: int = 8192
    host: str = "127.0.0.1"
    port: int = 30000
    hash_scheme: str = "sglang"
    hash_seed: str | None = "0"
    prefill_tokens_per_s: float = 1_000_000.0
    decode_steps_per_s: float = 1_000.0
    max_running: int = 64
    startup_timeout: float = 30.0
    dead_rank_grace: float = 1.0
    max_new_tokens_limit: int = 32_768
    request_timeout: float = 60.0
    shutdown_timeout: float = 10.0
    max_body_bytes: int = 8 << 20
    api_key: str | None = field(default=None, repr=False)
    """Required of every request but ``/health`` (None: no key); never shown."""
    tls: ServerTLS | None = None
    sliding_window: int | None = None
    models: ServedModels = field(default_factory=ServedModels)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)

    def __post_init__(self) -> None:
        pd = self.disaggregation
        # the bounds are the ones the command line parses these options with
        for flag, value, bound in (
            ("--block-size", self.page_size, PositiveInt),
            ("--max-blocks", self.max_blocks, PositiveInt),
            ("--max-running", self.max_running, PositiveInt),
            ("--startup-timeout", self.startup_timeout, NonNegativeFloat),
            ("--dead-rank-grace", self.dead_rank_grace, NonNegativeFloat),
            ("--port", self.port, Port),
            ("--prefill-tokens-per-s", self.prefill_tokens_per_s, PositiveFloat),
            ("--decode-steps-per-s", self.decode_steps_per_s, PositiveFloat),
            ("--max-new-tokens-limit", self.max_new_tokens_limit, PositiveInt),
            ("--max-body-bytes", self.max_body_bytes, PositiveInt),
            ("--request-timeout", self.request_timeout, PositiveFloat),
            ("--shutdown-timeout", self.shutdown_timeout, NonNegativeFloat),
            ("--disaggregation-bootstrap-port", pd.bootstrap_port, Port),
            ("--transfer-us-per-block", pd.transfer_us_per_block, NonNegativeFloat),
            ("--disaggregation-timeout", pd.timeout, PositiveFloat),
            *(
                [("--sliding-window", self.sliding_window, PositiveInt)]
                if self.sliding_window is not None
                else []
            ),
        ):
            try:
                check_bound(value, bound, flag)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        try:
            get_hash_scheme(self.hash_scheme, seed=self.hash_seed)
        except (ValueError, ImportError) as exc:
            raise ConfigError(f"--hash-scheme {self.hash_scheme}: {exc}") from None
        config = self.kv_events_config
        if config.enabled:  # refuse a bad port plan before anything binds
            PortPlan.build(self.topology.dp_size, config.endpoint, config.replay_endpoint)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineSettings:
        return cls(
            topology=plan_topology(args.dp_size, args.tp_size, args.enable_dp_attention),
            kv_events_config=KVEventsConfig.from_json(
                DEFAULT_KV_EVENTS_CONFIG if args.kv_events_config is None else args.kv_events_config
            ).bound_to(args.kv_events_host),
            page_size=args.page_size,
            max_blocks=args.max_blocks,
            host=args.host,
            port=args.port,
            hash_scheme=args.hash_scheme,
            hash_seed=args.hash_seed,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            decode_steps_per_s=args.decode_steps_per_s,
            max_running=args.max_running,
            startup_timeout=args.startup_timeout,
            dead_rank_grace=args.dead_rank_grace,
            max_new_tokens_limit=args.max_new_tokens_limit,
            request_timeout=args.request_timeout,
            shutdown_timeout=args.shutdown_timeout,
            max_body_bytes=args.max_body_bytes,
            api_key=engine_api_key(args),
            tls=tls_of(args),
            sliding_window=args.sliding_window,
            models=ServedModels(
                names=parse_served_model_names(args.served_model_name),
                loras=parse_lora_modules(args.lora_modules),
                configured=bool(args.served_model_name or args.lora_modules),
            ),
            disaggregation=DisaggregationConfig(
                mode=DisaggregationMode(args.disaggregation_mode),
                bootstrap_port=args.disaggregation_bootstrap_port,
                transfer_us_per_block=args.transfer_us_per_block,
                timeout=args.disaggregation_timeout,
            ),
        )

    def rank_specs(self) -> list[RankSpec]:
        return [
            RankSpec(
                dp_rank=role.publisher_rank or 0,
                control="",
                token="",
                kv_events_config=self.kv_events_config.to_dict(),
                page_size=self.page_size,
                max_blocks=self.max_blocks,
                hash_scheme=self.hash_scheme,
                hash_seed=self.hash_seed,
                prefill_tokens_per_s=self.prefill_tokens_per_s,
                decode_steps_per_s=self.decode_steps_per_s,
                max_running=self.max_running,
                sliding_window=self.sliding_window,
            )
            for role in self.topology.publishers
        ]


def run(args: argparse.Namespace) -> int:
    return asyncio.run(serve_engine(EngineSettings.from_args(args)))


async def serve_engine(settings: EngineSettings) -> int:
    """Run the engine until a signal (exit code 0) or a dead rank (exit code 1)."""
    stop = asyncio.Event()
    with stop_on_signals(stop):
        return await _serve_until_stopped(settings, stop)


async def _serve_until_stopped(settings: EngineSettings, stop: asyncio.Event) -> int:
    sock = bind_http(settings.host, settings.port, "engine")
    try:
        pd = Disaggregation.create(
            settings.disaggregation,
            host=settings.host,
            page_size=settings.page_size,
            api_key=settings.api_key,
        )
    except BaseException:
        sock.close()
        raise
    supervisor = RankSupervisor(settings.rank_specs(), startup_timeout=settings.startup_timeout)
    stop_wait = asyncio.create_task(stop.wait())
    try:
        starting = asyncio.create_task(supervisor.start())
        await asyncio.wait({starting, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return 0
        starting.result()
        info = EngineInfo(
            topology=settings.topology,
            page_size=settings.page_size,
            max_blocks=settings.max_blocks,
            hash_scheme=settings.hash_scheme,
            kv_events_config=engine_kv_events_config(
                settings.kv_events_config, settings.max_blocks, settings.sliding_window
            ),  # as the ranks publish with it (snapshots on unless it decides)
            models=settings.models,
        )
        limits = EngineLimits(
            max_new_tokens=settings.max_new_tokens_limit,
            request_timeout=settings.request_timeout,
            max_body_bytes=settings.max_body_bytes,
        )
        await pd.start()
        app: Any = create_app(supervisor, info, limits, pd)
        if settings.api_key is not None:
            app = ApiKeyGate(app, ApiKey(settings.api_key), OPEN_PATHS)
        server, serving = await start_http(
            app,
            sock,
            lifespan="off",
            graceful_timeout=settings.shutdown_timeout,
            tls=settings.tls,
        )
        url = http_url(settings.host, sock, tls=settings.tls is not None)
        print(READY_PREFIX + url, flush=True)
        failed = asyncio.create_task(supervisor.failed.wait())
        await asyncio.wait({stop_wait, failed, serving}, return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if failed.done() and not stop.is_set():
            code = 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.dead_rank_grace)
        failed.cancel()
        server.should_exit = True
        await serving
        return code
    finally:
        stop_wait.cancel()
        await pd.stop()
        await supervisor.stop()
        sock.close()


if __name__ == "__main__":  # pragma: no cover
    _parser = argparse.ArgumentParser(prog="kvevents engine")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
