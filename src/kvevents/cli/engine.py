"""``kvevents engine``: start the simulated data-parallel engine and its HTTP server.

::

    kvevents engine --dp-size 4
    kvevents engine --dp-size 4 --kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557"}'

Everything is checked before any process starts: the scheduler topology
(:func:`~kvevents.engine.topology.plan_topology`), the KV-events config, the port plan
(overlapping or overflowing ranges are refused, naming them) and the HTTP port. Then
one process per rank starts (see :mod:`kvevents.engine.supervisor`), the HTTP server
(:mod:`kvevents.engine.server`) starts on ``--host``/``--port`` (0: the OS picks), and
one machine-readable line goes to stdout::

    kvevents engine ready http://127.0.0.1:PORT

The engine publishes KV events by default (:data:`DEFAULT_KV_EVENTS_CONFIG`): every rank
on its own OS-chosen live and replay port, so engines on one machine never collide, and
``/server_info`` lists each rank's endpoints (``publishers``), which is what discovery
reads: ``kvevents engine`` and ``kvevents router --engine URL`` route with no other flag.
``--kv-events-config '{"publisher": "null"}'`` (or ``'{}'``) turns publishing off.
Publishers bind a wildcard host in ``--kv-events-config`` as ``--kv-events-host``
(default 127.0.0.1) and ``/server_info`` advertises what they bound; ``--api-key`` closes
every endpoint but ``/health`` and ``/ready``, ``--ssl-certfile`` serves HTTPS
(docs/security.md).

``GET /health`` is liveness (503 while a rank is dead), ``GET /ready`` readiness (503
while a rank is starting, restarting or dead, or has no bound publisher); in Kubernetes,
``livenessProbe`` on ``/health`` and ``readinessProbe`` on ``/ready``
(:mod:`kvevents.engine.readiness`).

``--disaggregation-mode prefill|decode`` makes the engine one half of a disaggregated
pair (:mod:`kvevents.engine.disaggregation`); a prefill binds its bootstrap server
(``--disaggregation-bootstrap-port``, on ``--host``) before any rank starts.

Over 300 lines on purpose: the settings, the options that fill them and the serving
loop of one command read best together.

Ctrl-C or SIGTERM stops the server and every rank, and the command exits 0; requests
still in flight get ``--shutdown-timeout`` seconds (default 10) to finish, then they are
cancelled and their connections closed. A rank
that dies on its own shows in ``/health`` (503) for ``--dead-rank-grace`` seconds, then
the engine stops and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any

from kvevents.cli.options import add_log_level
from kvevents.cli.security import add_engine_server_arguments, engine_api_key, tls_of
from kvevents.engine.disaggregation import (
    Disaggregation,
    DisaggregationConfig,
    DisaggregationMode,
)
from kvevents.engine.models import (
    DEFAULT_MODEL_NAME,
    ServedModels,
    parse_lora_modules,
    parse_served_model_names,
)
from kvevents.engine.rank import RankSpec
from kvevents.engine.server import EngineInfo, EngineLimits, create_app
from kvevents.engine.supervisor import RankSupervisor
from kvevents.engine.topology import Topology, plan_topology
from kvevents.errors import ConfigError
from kvevents.http.auth import ApiKey, ApiKeyGate, ServerTLS
from kvevents.http.serving import bind_http, http_url, start_http, stop_on_signals
from kvevents.publish.config import KVEventsConfig
from kvevents.transport.endpoints import PortPlan
from kvevents.types import (
    NonNegativeFloat,
    Port,
    PositiveFloat,
    PositiveInt,
    bounded,
    check_bound,
)
from kvevents.wire.hashing import HASH_SCHEMES, get_hash_scheme

__all__ = [
    "DEFAULT_KV_EVENTS_CONFIG",
    "OPEN_PATHS",
    "EngineSettings",
    "add_arguments",
    "run",
    "serve_engine",
]

READY_PREFIX = "kvevents engine ready "
OPEN_PATHS = frozenset({"/health", "/ready"})
"""What an engine with an API key answers without it: health and readiness, for probes and
SGLang-style routers. ``/server_info`` and ``/load`` need the key (the router sends its
engine key)."""

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    # the topology's sizes are checked together by plan_topology, which explains the mix
    add("--dp-size", type=int, default=1, help="data-parallel ranks (KV caches)")
    add("--enable-dp-attention", action="store_true", help="SGLang's DP-attention mode")
    add("--tp-size", type=int, default=None, help="tensor-parallel size (see SGLang)")
    add(
        "--block-size",
        "--page-size",
        dest="page_size",
        type=bounded(PositiveInt),
        default=16,
        metavar="B",
        help="tokens per KV block (--page-size: SGLang's name for it)",
    )
    add("--max-blocks", type=bounded(PositiveInt), default=8192, help="KV blocks per rank")
    add(
        "--sliding-window",
        type=bounded(PositiveInt),
        default=None,
        metavar="TOKENS",
        help="simulate a hybrid model: a sliding-window KV-cache group (group 0, this "
        "window) beside the full-attention one (group 1), with vLLM's events",
    )
    add(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="SGLang's KV-events config (default: publish with replay on ports the OS picks, "
        'advertised in /server_info; \'{"publisher": "null"}\' turns publishing off)',
    )
    add(
        "--kv-events-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address publishers bind in place of a wildcard (tcp://*:PORT) in "
        "--kv-events-config; '*' binds every interface as SGLang and vLLM do",
    )
    add("--host", default="127.0.0.1", help="HTTP host")
    add("--port", type=bounded(Port), default=30000, help="HTTP port (0: the OS picks)")
    add("--hash-scheme", choices=HASH_SCHEMES, default="sglang", help="engine block hashes")
    add("--hash-seed", default="0", help="vLLM scheme's PYTHONHASHSEED")
    add(
        "--prefill-tokens-per-s",
        type=bounded(PositiveFloat),
        default=1_000_000.0,
        help="simulated prefill speed (inf: no delay)",
    )
    add(
        "--decode-steps-per-s",
        type=bounded(PositiveFloat),
        default=1_000.0,
        help="simulated decode steps/s (inf: no delay)",
    )
    add("--max-running", type=bounded(PositiveInt), default=64, help="running requests per rank")
    add(
        "--startup-timeout",
        type=bounded(NonNegativeFloat),
        default=30.0,
        help="seconds for ranks to start",
    )
    add(
        "--dead-rank-grace",
        type=bounded(NonNegativeFloat),
        default=1.0,
        help="seconds /health shows a dead rank",
    )
    add(
        "--max-new-tokens-limit",
        type=bounded(PositiveInt),
        default=32_768,
        help="largest max_new_tokens (400 past it)",
    )
    add(
        "--request-timeout",
        type=bounded(PositiveFloat),
        default=60.0,
        help="seconds a request waits for its rank (504)",
    )
    add(
        "--shutdown-timeout",
        type=bounded(NonNegativeFloat),
        default=10.0,
        help="seconds SIGTERM waits for requests",
    )
    add(
        "--max-body-bytes",
        type=bounded(PositiveInt),
        default=8 << 20,
        help="largest request body (413), 8 MiB",
    )
    add_engine_server_arguments(parser)
    add(
        "--disaggregation-mode",
        choices=[str(m) for m in DisaggregationMode],
        default="null",
        help="disaggregated serving, SGLang's flag: prefill (serve prefill legs, KV handed "
        "over by the bootstrap server) or decode (take the KV, then decode); null: neither",
    )
    add(
        "--disaggregation-bootstrap-port",
        type=bounded(Port),
        default=8998,
        metavar="PORT",
        help="a prefill's bootstrap server port, on --host (0: the OS picks; /server_info "
        "tells disaggregation_bootstrap_port)",
    )
    add(
        "--transfer-us-per-block",
        type=bounded(NonNegativeFloat),
        default=10.0,
        metavar="US",
        help="simulated time a decode spends receiving one KV block",
    )
    add(
        "--disaggregation-timeout",
        type=bounded(PositiveFloat),
        default=30.0,
        metavar="S",
        help="seconds a decode waits for its room; a prefill drops a registration nobody "
        "took after as long",
    )
    add(
        "--served-model-name",
        action="append",
        metavar="NAME[,NAME]",
        help="model name(s) requests give as 'model' (repeatable or a comma list, as vLLM's; "
        f"default {DEFAULT_MODEL_NAME}); the first is reported in answers",
    )
    add(
        "--lora-modules",
        nargs="+",
        action="extend",
        metavar="NAME=PATH",
        help="LoRA adapters served on top of the model, as vLLM's flag (the path may be a "
        "dummy); a request naming one as 'model' keeps its own prefix-cache namespace",
    )
    add_log_level(parser)


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
            kv_events_config=settings.kv_events_config,
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
