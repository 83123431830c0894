"""Disaggregated serving's configuration and what the router learns of its engines.

``kvevents router --prefill URL [BOOTSTRAP_PORT] ... --decode URL ...`` makes a
:class:`PDMode`: the pools (:class:`~kvevents.router.decide.pd.PDPools`), the hand-off
protocol (:mod:`kvevents.router.serve.pd_legs`), ``max_local_prefill_tokens`` and the
prefill leg's deadline, and the counters of :mod:`kvevents.router.serve.pd_stats`.

Engines advertise their role in ``GET /server_info``: ``disaggregation_mode``
(``"null"``, ``"prefill"`` or ``"decode"``) and, on a prefill engine,
``disaggregation_bootstrap_port``. :meth:`PDMode.watch` reads every engine's, every
:data:`RECHECK_S` seconds until it answers and every :data:`REREAD_S` after (a restarted
prefill may have another port); an engine whose role is not its pool's is logged (once
per change) and shown in ``/workers``, not refused (a real engine may advertise nothing).
A decode engine that says it prefills a request sent alone itself
(:data:`~kvevents.wire.server_info.LOCAL_PREFILL_KEY`) may be sent one; with SGLang's
legs no other is (:meth:`PDMode.serves_alone`). A prefill's
bootstrap port is the one given on the command line, else the advertised one, else
SGLang's default (:data:`DEFAULT_BOOTSTRAP_PORT`); a request that needs it before the
first read is done reads it then, bounded (:meth:`PDMode.bootstrap_port`). The reads go
through the router's engine client (:meth:`Upstream.get_json
<kvevents.http.upstream.Upstream.get_json>`), with the key and TLS context of its relays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from kvevents.http.upstream import Upstream
from kvevents.http.upstream_errors import UpstreamError
from kvevents.router.decide.pd import DEFAULT_MAX_LOCAL_PREFILL_TOKENS, PDPools, Pool
from kvevents.router.fleet.engines import key_refused
from kvevents.router.serve.pd_legs import PDProtocol
from kvevents.router.serve.pd_stats import PDStats
from kvevents.wire.server_info import LOCAL_PREFILL_KEY

__all__ = ["DEFAULT_BOOTSTRAP_PORT", "DEFAULT_PREFILL_TIMEOUT_S", "PDEngine", "PDMode"]

log = logging.getLogger("kvevents.router")

DEFAULT_BOOTSTRAP_PORT = 8998
"""SGLang's ``--disaggregation-bootstrap-port`` default."""
DEFAULT_PREFILL_TIMEOUT_S = 120.0
"""Seconds the prefill leg may take in all (connecting, the prompt, the answer)."""
SERVER_INFO_TIMEOUT_S = 2.0
RECHECK_S = 2.0
"""Seconds between two reads of an engine's ``/server_info`` until one answers."""
REREAD_S = 30.0
"""Seconds between two reads of an engine's ``/server_info`` once it has answered (a
restarted prefill may have a new bootstrap port, one its OS picked)."""


class PDEngine:
    """One engine of a pool, and what its ``/server_info`` said of its role."""

    def __init__(self, url: str, worker: str, pool: Pool, bootstrap_port: int | None = None):
        self.url = url
        self.worker = worker
        self.pool = pool
        self.configured_port = bootstrap_port
        self.advertised_mode: str | None = None
        self.advertised_port: int | None = None
        self.local_prefill = False
        """Its ``/server_info`` says it prefills a request sent alone itself
        (:data:`~kvevents.wire.server_info.LOCAL_PREFILL_KEY`)."""
        self.read = False
        """True once ``/server_info`` answered (with or without the role)."""
        self.error: str | None = None

    def port(self) -> tuple[int, str]:
        """The bootstrap port and where it came from."""
        if self.configured_port is not None:
            return self.configured_port, "configured"
        if self.advertised_port is not None:
            return self.advertised_port, "server_info"
        return DEFAULT_BOOTSTRAP_PORT, "default"

    def learn(self, info: Any) -> None:
        """Take a ``/server_info`` body."""
        self.read, self.error = True, None
        if not isinstance(info, dict):
            return
        mode = info.get("disaggregation_mode")
        before, self.advertised_mode = self.advertised_mode, None if mode is None else str(mode)
        self.local_prefill = info.get(LOCAL_PREFILL_KEY) is True
        port = info.get("disaggregation_bootstrap_port")
        if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
            self.advertised_port = port
        if self.advertised_mode not in (None, self.pool, before):
            log.warning(
                "engine %s is given as a %s engine but says it runs disaggregation mode %r: "
                "start it with --disaggregation-mode %s, or give it as --%s",
                self.url,
                self.pool,
                self.advertised_mode,
                self.pool,
                self.advertised_mode if self.advertised_mode in ("prefill", "decode") else "engine",
            )

    def summary(self) -> dict[str, Any]:
        port, source = self.port()
        return {
            "url": self.url,
            "worker": self.worker,
            "advertised_mode": self.advertised_mode,
            "bootstrap_port": port if self.pool == "prefill" else None,
            "local_prefill": self.local_prefill if self.pool == "decode" else None,
            "bootstrap_port_source": source if self.pool == "prefill" else None,
            "server_info_error": self.error,
        }


class PDMode:
    """Disaggregated serving's settings and state (see the module docstring)."""

    def __init__(
        self,
        engines: list[PDEngine],
        protocol: PDProtocol,
        *,
        max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
        prefill_timeout: float = DEFAULT_PREFILL_TIMEOUT_S,
        reread_s: float = REREAD_S,
    ) -> None:
        if max_local_prefill_tokens < 0:
            raise ValueError(
                f"--max-local-prefill-tokens {max_local_prefill_tokens}: give 0 (always hand "
                "off) or more"
            )
        if not prefill_timeout > 0:
            raise ValueError(f"--prefill-timeout {prefill_timeout}: must be > 0 seconds")
        self.engines = {e.worker: e for e in engines}
        self.pools = PDPools(
            [e.worker for e in engines if e.pool == "prefill"],
            [e.worker for e in engines if e.pool == "decode"],
        )
        self.protocol = protocol
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.prefill_timeout = prefill_timeout
        self.stats = PDStats()
        self.reread_s = reread_s
        """Seconds between two reads of an engine's ``/server_info`` once it answered."""
        self.background: set[asyncio.Task[None]] = set()
        """Tasks reading a prefill's answer after the decode's began (SGLang's legs)."""

    async def close(self) -> None:
        """Cancel the prefill answers still being read (the router is stopping)."""
        tasks = list(self.background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def watch(self, upstream: Upstream, stopping: asyncio.Event) -> None:
        """Read every engine's ``/server_info``: every :data:`RECHECK_S` seconds until it
        answers, then every ``reread_s`` (:data:`REREAD_S`), until ``stopping`` is set."""
        loop = asyncio.get_running_loop()
        due = dict.fromkeys(self.engines, 0.0)
        while not stopping.is_set():
            now = loop.time()
            reading = [self.engines[w] for w, at in due.items() if at <= now]
            await asyncio.gather(*(self._read(e, upstream) for e in reading))
            for engine in reading:
                due[engine.worker] = loop.time() + (self.reread_s if engine.read else RECHECK_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), max(0.0, min(due.values()) - loop.time()))

    async def bootstrap_port(self, worker: str, upstream: Upstream) -> int:
        """The bootstrap port of prefill engine ``worker`` (read now if not read yet)."""
        engine = self.engines[worker]
        if engine.configured_port is None and not engine.read:
            await self._read(engine, upstream)
        return engine.port()[0]

    async def _read(self, engine: PDEngine, upstream: Upstream) -> None:
        """Read ``engine``'s ``/server_info``. A 404 is an answer (an engine without the
        endpoint advertises nothing: the default port holds); any other refusal or
        failure is an error, read again in :data:`RECHECK_S` seconds."""
        request = f"GET {engine.url}/server_info"
        try:
            status, info = await upstream.get_json(
                engine.url, "/server_info", timeout=SERVER_INFO_TIMEOUT_S
            )
        except TimeoutError:
            engine.error = f"TimeoutError: {request}: no answer within {SERVER_INFO_TIMEOUT_S:g} s"
            return
        except (UpstreamError, ValueError) as exc:
            engine.error = f"{type(exc).__name__}: {exc}"
            return
        if status in (401, 403):
            engine.error = str(key_refused(request, status))
            return
        if status not in (200, 404):
            engine.error = f"{request} answered HTTP {status}"
            return
        engine.learn(info)

    def serves_alone(self, worker: str) -> bool:
        """Whether decode engine ``worker`` can be sent a request alone, without a prefill
        leg: any vLLM instance can; with SGLang's legs, only one whose ``/server_info``
        says it prefills such a request itself (an SGLang decode server never does: it
        would wait for a transfer no prefill makes, then fail)."""
        if self.protocol == "vllm":
            return True
        engine = self.engines.get(worker)
        return engine is not None and engine.local_prefill

    def summary(self) -> dict[str, Any]:
        """``/workers``' ``pd`` section: the settings, then per pool its engines and counts."""
        counts = self.stats.summary()
        return {
            "protocol": self.protocol,
            "max_local_prefill_tokens": self.max_local_prefill_tokens,
            "prefill_timeout": self.prefill_timeout,
            "pools": {
                pool: {
                    "engines": [e.summary() for e in self.engines.values() if e.pool == pool],
                    **counts[pool],
                }
                for pool in ("prefill", "decode")
            },
        }
