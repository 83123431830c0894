"""Whether the router can route now: ``GET /ready``, and ``/workers``' ``ready`` member.

``/health`` says the process answers (liveness: restart it if not); ``/ready`` says a
request routed now would go where its cache is (readiness: send it traffic). In
Kubernetes, point the ``livenessProbe`` at ``/health`` and the ``readinessProbe`` at
``/ready``. The router is ready when at least one holder (one engine rank's KV cache;
in disaggregated mode, one in each pool, prefill and decode) is

* known and available: its engine registered it and its last poll says the rank is up;
* followed: its event stream is connected (the publisher's ZMQ handshake succeeded, or
  a batch arrived), so what it caches reaches the index;
* at the router's block size: neither a declaration (``/server_info``, the engine's
  ``--block-size``) nor its events disagree with the size requests are keyed at, which
  would make every lookup of it a silent miss.

Otherwise ``/ready`` answers 503. Either way the answer lists the reasons found, one
line per engine or per problem of an engine's ranks, saying what to fix (a fleet with
one engine down is ready, and still says so). A connected stream that has sent nothing
yet is not a reason, on purpose: an idle engine publishes only once it serves, so
waiting for its first event would keep an idle fleet unready, and so idle, for ever.

In a group of router processes (``--workers``) each answers for the group: ready when
every running process is (:mod:`kvevents.router.serve.group_readiness`), another's
reasons listed after its ``router process K of N:``.

Cost: O(engines + holders) and one snapshot of the subscriber's stream stats, cheap
enough for the hot path to answer it as it answers ``/health``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec

from kvevents.router.serve.service import RouterService
from kvevents.subscribe.engine_watcher import DiscoveryState
from kvevents.subscribe.stats import StreamStats, StreamStatus
from kvevents.types import Holder

__all__ = [
    "MAX_REASONS",
    "PUBLISH_INTERVAL_S",
    "READINESS_PREFIX",
    "READY_REPORT_WAIT_S",
    "READY_SETTLE_S",
    "Readiness",
    "print_readiness",
    "publish_readiness",
    "readiness",
    "report_readiness",
]

MAX_REASONS = 20
"""Reasons listed at most; past them one more line counts the rest (see ``/workers``)."""

READY_REPORT_WAIT_S = 10.0
"""The longest :func:`report_readiness` waits for the router to turn ready before it
prints what still holds it back (streams connect, and ranks register, just after start)."""


READY_SETTLE_S = 3.0
"""Once ready, the longest :func:`report_readiness` waits for the holders still held back
(a stream still connecting) before it prints the line with their reasons."""


READINESS_PREFIX = "kvevents router: "
"""Starts the readiness line ``kvevents router`` prints after its ready line (never the
ready line's own ``kvevents router ready ``, which scripts wait for)."""


class Readiness(msgspec.Struct):
    """``GET /ready``'s answer (200 when ``ok``, else 503) and ``/workers``' ``ready``."""

    ok: bool
    """At least one holder can be routed to (see the module docstring)."""
    reasons: list[str]
    """What keeps holders or engines from being routed to, one line each; empty when
    every holder known is routable."""
    routable: int
    """Holders that can be routed to now (by the process answering)."""
    holders: int
    """Holders known (every rank of every registered engine)."""


PUBLISH_INTERVAL_S = 0.2
"""Seconds between two looks at its own readiness of a process in a group
(:func:`publish_readiness`): the longest a change waits before the group's answer has it."""


def readiness(service: RouterService) -> Readiness:
    """The router's readiness now (see the module docstring); in a group of processes
    (``--workers``), the group's: this process's, written for the others to read, and
    theirs (:mod:`kvevents.router.serve.group_readiness`)."""
    own = _own_readiness(service)
    group = service.group_readiness
    if group is None:
        return own
    group.publish(own.ok, own.reasons, own.routable, own.holders)
    ok = own.ok
    reasons = list(own.reasons)
    for index, other in group.others().items():
        if other is None:
            ok = False
            reasons.append(f"router process {index} of {group.count}: starting")
            continue
        ok = ok and other.ok
        theirs = [r for r in other.reasons if r not in own.reasons]
        reasons += [f"router process {index} of {group.count}: {r}" for r in theirs]
        if not other.ok and not theirs:
            reasons.append(
                f"router process {index} of {group.count}: not ready "
                f"({other.routable} of {other.holders} holders routable)"
            )
    return Readiness(ok=ok, reasons=_capped(reasons), routable=own.routable, holders=own.holders)


async def publish_readiness(service: RouterService, interval: float = PUBLISH_INTERVAL_S) -> None:
    """Keep this process's readiness in its group's folder as it changes, until cancelled
    (a process no probe reaches would otherwise never tell the others it turned ready)."""
    group = service.group_readiness
    while group is not None:
        own = _own_readiness(service)
        group.publish(own.ok, own.reasons, own.routable, own.holders)
        await asyncio.sleep(interval)


def _capped(reasons: list[str]) -> list[str]:
    """``reasons``, past :data:`MAX_REASONS` cut to them and a line counting the rest."""
    if len(reasons) <= MAX_REASONS:
        return reasons
    more = len(reasons) - MAX_REASONS
    return [*reasons[:MAX_REASONS], f"... and {more} more: see GET /workers"]


def _own_readiness(service: RouterService) -> Readiness:
    """This process's readiness (see the module docstring)."""
    router = service.router
    sub = service.subscriber
    streams = None if sub is None else sub.stats()
    discovery = {} if sub is None else sub.engines()
    reasons: list[str] = []
    troubled: set[str] = set()  # workers whose engine-level reason covers their ranks
    for state in service.states.values():
        spec = state.spec
        found = discovery.get(spec.url)
        if found is not None and found.state is DiscoveryState.UNREACHABLE:
            reasons.append(f"engine {spec.url} is unreachable: {found.last_error or state.error}")
        elif found is not None and found.state is DiscoveryState.INVALID:
            reasons.append(f"engine {spec.url} has no usable KV-event stream: {found.last_error}")
        elif state.error is not None:
            reasons.append(f"engine {spec.url} is unavailable: {state.error}")
        elif not state.registered:
            reasons.append(f"engine {spec.url}: its ranks are not known yet (first poll pending)")
        else:
            continue
        troubled.add(spec.worker)
    holders = router.holders()
    problems: dict[tuple[str, str], list[int]] = {}
    routable = 0
    routable_workers: set[str] = set()
    for holder in holders:
        problem = _problem(service, holder, streams)
        if problem is None:
            routable += 1
            routable_workers.add(holder.worker)
        elif holder.worker not in troubled:
            problems.setdefault((holder.worker, problem), []).append(holder.dp_rank)
    for (worker, problem), ranks in problems.items():
        reasons.append(f"engine {worker} {_ranks(ranks)}: {problem}")
    if not holders and not reasons:
        reasons.append(
            "no engine rank is known yet"
            + ("" if service.states else ": the router follows no engine (--engine URL)")
        )
    empty_pools = _empty_pools(service, routable_workers)
    return Readiness(
        ok=routable > 0 and not empty_pools,
        reasons=_capped([*empty_pools, *reasons]),  # first: past MAX_REASONS, the rest are cut
        routable=routable,
        holders=len(holders),
    )


def _empty_pools(service: RouterService, routable_workers: set[str]) -> list[str]:
    """In disaggregated mode, one reason per pool with no routable holder: a request needs
    a decode rank, and one whose prompt the decode would not prefill alone a prefill rank,
    so the router is not ready without both."""
    pd = service.pd
    if pd is None:
        return []
    reasons = []
    for pool, workers in (("prefill", pd.pools.prefill), ("decode", pd.pools.decode)):
        if not workers & routable_workers:
            reasons.append(
                f"no {pool} engine rank is routable: requests that need one answer 503 until "
                f"one of the {pool} engines ({', '.join(sorted(workers))}) is up and followed"
            )
    return reasons


def _problem(
    service: RouterService, holder: Holder, streams: dict[Holder, StreamStats] | None
) -> str | None:
    """Why ``holder`` cannot be routed to now, or None."""
    router = service.router
    load = router.loads.get(holder)
    if load is not None and not load.available:
        return "unavailable: the engine reports the rank down"
    if streams is not None:
        stream = streams.get(holder)
        if stream is None:
            return "no event stream followed yet (discovery pending)"
        if stream.status is not StreamStatus.CONNECTED:
            why = stream.handshake_error or stream.error
            return f"event stream {stream.status.value}" + (f": {why}" if why else "")
    sizes = router.block_sizes
    expected = sizes.expected(holder)
    if expected is not None:
        for said, source in (
            (sizes.declared.get(holder), "is declared"),
            (sizes.observed.get(holder), "stores blocks"),
        ):
            if said is not None and said != expected[0]:
                return (
                    f"block size mismatch: it {source} at {said} tokens but the router keys "
                    f"at {expected[0]} ({expected[1]}); fix the router's or the engine's "
                    "--block-size"
                )
    return None


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, or ``ranks 0-3, 6`` (runs of consecutive ranks joined)."""
    ranks = sorted(ranks)
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


async def report_readiness(
    service: RouterService,
    say: Callable[[str], object],
    *,
    timeout: float = READY_REPORT_WAIT_S,
    interval: float = 0.1,
    settle: float = READY_SETTLE_S,
) -> Readiness:
    """Wait (at most ``timeout`` s) for the router to turn ready, and once ready at most
    ``settle`` s more for every holder to be routable, then ``say`` one line:
    ``ready to route: N of M holders`` or ``not ready to route: REASON; REASON``
    (``kvevents router`` prints it after its ready line: :func:`print_readiness`)."""
    deadline = time.monotonic() + timeout
    state = readiness(service)
    ready_since: float | None = None
    while state.reasons and time.monotonic() < deadline:
        if state.ok and ready_since is None:  # what holds some holders back: a little longer
            ready_since = time.monotonic()
            deadline = min(deadline, ready_since + settle)
        await asyncio.sleep(interval)
        state = readiness(service)
    if state.ok:
        line = f"ready to route: {state.routable} of {state.holders} holders"
        if state.reasons:
            line += " (" + "; ".join(state.reasons) + ")"
    else:
        line = "not ready to route (GET /ready answers 503): " + "; ".join(state.reasons)
    say(line)
    return state


def print_readiness(line: str) -> None:
    """Print a :func:`report_readiness` line on stdout, after :data:`READINESS_PREFIX`."""
    print(READINESS_PREFIX + line, flush=True)
