"""Which simulated schedulers exist, and which of them publish KV events (SGLang's rules).

SGLang runs one scheduler per GPU. Their ranks depend on the mode:

* **pure DP** (default): ``dp_size`` replicas of ``tp_size`` GPUs each. A scheduler has
  ``dp_rank`` = its replica, ``attn_tp_rank`` = its TP rank, ``attn_dp_size = 1`` and
  ``attn_dp_rank = 0``.
* **DP attention** (``--enable-dp-attention``): ``tp_size`` GPUs in all, split into
  ``dp_size`` attention groups of ``tp_size // dp_size``. A scheduler has
  ``attn_dp_rank = tp_rank // attn_tp_size``, ``attn_tp_rank = tp_rank % attn_tp_size``,
  ``attn_dp_size = dp_size`` and no ``dp_rank``.

Either way there are ``dp_size`` KV caches. Only attention-TP rank 0 of each publishes
(the others hold identical copies), and its publisher rank is
:func:`~kvevents.transport.endpoints.select_kv_publisher_dp_rank` of its ranks, which spans
``0..dp_size-1`` in both modes (docs/architecture.md, The problem).

The simulated engine runs one process per KV cache, i.e. per publishing scheduler;
the non-publishing TP schedulers are part of the plan (shown in ``/server_info``) but
would only repeat the same cache, so they are not run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvevents.errors import ConfigError
from kvevents.transport.endpoints import select_kv_publisher_dp_rank

__all__ = ["SchedulerRole", "Topology", "plan_topology"]


@dataclass(frozen=True, slots=True)
class SchedulerRole:
    """One simulated scheduler (one GPU) and whether it publishes."""

    tp_rank: int
    dp_rank: int | None
    attn_tp_rank: int
    attn_dp_rank: int
    attn_dp_size: int
    publishes: bool
    publisher_rank: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Topology:
    """Every scheduler of the deployment, and the publishing ones by publisher rank."""

    dp_size: int
    tp_size: int
    enable_dp_attention: bool
    schedulers: tuple[SchedulerRole, ...]

    @property
    def publishers(self) -> tuple[SchedulerRole, ...]:
        """The publishing schedulers, ordered by publisher rank ``0..dp_size-1``."""
        pubs = [s for s in self.schedulers if s.publishes]
        return tuple(sorted(pubs, key=lambda s: s.publisher_rank or 0))


def plan_topology(dp_size: int, tp_size: int | None, enable_dp_attention: bool) -> Topology:
    """The schedulers of ``--dp-size``/``--tp-size``/``--enable-dp-attention``.

    ``tp_size=None`` means 1 in pure DP and ``dp_size`` with DP attention. Raises
    :class:`~kvevents.errors.ConfigError` naming the flags when they do not fit.
    """
    if dp_size < 1:
        raise ConfigError(f"--dp-size {dp_size} must be at least 1")
    if enable_dp_attention:
        tp = dp_size if tp_size is None else tp_size
        if tp < dp_size or tp % dp_size:
            raise ConfigError(
                f"--tp-size {tp} with --enable-dp-attention must be a multiple of --dp-size "
                f"{dp_size} (each attention-DP group gets tp_size/dp_size GPUs)"
            )
        attn_tp = tp // dp_size
        schedulers = [
            _role(tp_rank, None, tp_rank % attn_tp, tp_rank // attn_tp, dp_size)
            for tp_rank in range(tp)
        ]
    else:
        tp = 1 if tp_size is None else tp_size
        if tp < 1:
            raise ConfigError(f"--tp-size {tp} must be at least 1")
        schedulers = [
            _role(tp_rank, dp_rank, tp_rank, 0, 1)
            for dp_rank in range(dp_size)
            for tp_rank in range(tp)
        ]
    topology = Topology(dp_size, tp, enable_dp_attention, tuple(schedulers))
    ranks = [s.publisher_rank for s in topology.publishers]
    if ranks != list(range(dp_size)):  # the property docs/architecture.md §1 is about
        raise AssertionError(f"publisher ranks {ranks} do not span 0..{dp_size - 1}")
    return topology


def _role(
    tp_rank: int, dp_rank: int | None, attn_tp_rank: int, attn_dp_rank: int, attn_dp_size: int
) -> SchedulerRole:
    publishes = attn_tp_rank == 0
    rank = select_kv_publisher_dp_rank(attn_dp_size, attn_dp_rank, dp_rank) if publishes else None
    return SchedulerRole(
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        attn_tp_rank=attn_tp_rank,
        attn_dp_rank=attn_dp_rank,
        attn_dp_size=attn_dp_size,
        publishes=publishes,
        publisher_rank=rank,
    )
