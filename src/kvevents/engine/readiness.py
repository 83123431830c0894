"""Whether the simulated engine can serve now: ``GET /ready`` beside ``GET /health``.

``/health`` is liveness: 200 unless a rank died (the engine then exits). ``/ready`` is
readiness: 200 only when every rank is running and, when publishing is on, has bound
its publisher (so a router following the engine sees every cache it routes to); 503
with the reasons otherwise: a rank starting, restarting (``/admin/restart_rank``),
stopping or dead, or a rank with no bound publisher. In Kubernetes: ``livenessProbe``
on ``/health``, ``readinessProbe`` on ``/ready``.

Read from the supervisor's table of ranks, with no call to a rank: as cheap as
``/health``, and it answers even while a rank is stuck.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

__all__ = ["EngineReadiness", "engine_readiness"]

_STATES = {"killing": "being restarted (stopping)", "restarting": "being restarted (starting)"}
"""How a rank's state reads in a reason, where its name alone reads badly."""


class EngineReadiness(msgspec.Struct):
    """``GET /ready``'s answer: 200 when ``ok``, else 503."""

    ok: bool
    reasons: list[str]
    """Why a rank cannot serve, one line per rank; empty when ``ok``."""
    publishing: bool
    """Whether the engine publishes KV events (``--kv-events-config``)."""


def engine_readiness(ranks: Sequence[dict[str, Any]], *, publishing: bool) -> EngineReadiness:
    """Readiness from the supervisor's :meth:`~kvevents.engine.supervisor.RankSupervisor.status`."""
    reasons: list[str] = []
    for rank in ranks:
        name = f"dp_rank {rank['dp_rank']}"
        state = rank["state"]
        if state != "running":
            code = rank.get("exit_code")
            exited = "" if code is None else f" (exit code {code})"
            reasons.append(f"{name} is {_STATES.get(state, state)}{exited}")
        elif publishing and rank.get("endpoint") is None:
            reasons.append(f"{name} has no bound KV-event publisher")
    if not ranks:
        reasons.append("the engine has no rank")
    return EngineReadiness(ok=not reasons, reasons=reasons, publishing=publishing)
