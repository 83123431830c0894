"""One readiness for a ``--workers`` group: every process answers ``/ready`` for the group
(ready when every running process is), from the readiness files the processes write.

In one process here: two services stand for two processes of a group sharing a folder;
a process that is not running is a file naming a pid no process can have.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvevents import Holder, Router
from kvevents.router.serve.group_readiness import GroupReadiness, ProcessReadiness
from kvevents.router.serve.readiness import MAX_REASONS, readiness
from kvevents.router.serve.service import RouterService


def _member(folder: Path, index: int, count: int) -> tuple[Router, RouterService]:
    router = Router(block_size=16)
    service = RouterService(router, [])
    service.group_readiness = GroupReadiness(folder, index, count)
    return router, service


def test_the_group_is_ready_only_when_every_process_is(tmp_path: Path) -> None:
    """Process 0 ready answers not ready while process 1 starts, or has no holder, naming
    it; once process 1 is ready too (it publishes on its own look), both answer ready."""
    router0, first = _member(tmp_path, 0, 2)
    router1, second = _member(tmp_path, 1, 2)
    router0.add_holder(Holder("a", 0), block_size=16)
    state = readiness(first)
    assert (state.ok, state.routable, state.holders) == (False, 1, 1)
    assert state.reasons == ["router process 1 of 2: starting: its streams are not followed yet"], (
        state.reasons
    )
    assert not readiness(second).ok  # it writes its own: no holder known yet
    state = readiness(first)
    assert not state.ok
    assert state.reasons == [
        "router process 1 of 2: no engine rank is known yet: the router follows no engine "
        "(--engine URL)"
    ], state.reasons
    router1.add_holder(Holder("a", 0), block_size=16)
    assert readiness(second).ok
    assert readiness(first) == readiness(second)
    assert readiness(first).ok and readiness(first).reasons == []


def test_a_reason_every_process_shares_is_listed_once(tmp_path: Path) -> None:
    """Both processes see the same rank down: the answer lists it once, unprefixed; a
    process not ready for the same reasons only says how many holders it can route."""
    routers = []
    services = []
    for index in range(2):
        router, service = _member(tmp_path, index, 2)
        router.add_holder(Holder("a", 0), block_size=16)
        router.add_holder(Holder("b", 0), block_size=16)
        router.set_worker_available("b", False)
        routers.append(router)
        services.append(service)
    readiness(services[1])
    state = readiness(services[0])
    assert state.ok and state.reasons == [
        "engine b rank 0: unavailable: the engine reports the rank down"
    ], state.reasons
    routers[1].set_worker_available("a", False)
    readiness(services[1])
    state = readiness(services[0])
    assert not state.ok
    assert state.reasons[-1].startswith("router process 1 of 2: ")
    assert "engine a rank 0: unavailable" in state.reasons[-1]


def test_a_process_not_running_holds_nothing_back_and_reasons_are_capped(
    tmp_path: Path,
) -> None:
    """A file whose process has exited (it takes no connections) is left out; a process
    that never wrote one is starting; many reasons are cut at MAX_REASONS like one
    process's."""
    never = int(Path("/proc/sys/kernel/pid_max").read_text())  # pids stay below it
    gone = ProcessReadiness(1, never, False, ["starting"], 0, 0)
    router, service = _member(tmp_path, 0, 3)
    (tmp_path / "1.ready.json").write_bytes(msgspec.json.encode(gone))
    router.add_holder(Holder("a", 0), block_size=16)
    state = readiness(service)
    assert state.reasons == ["router process 2 of 3: starting"], state.reasons
    assert not state.ok
    many = ProcessReadiness(
        2,
        service.group_readiness.pid,
        False,  # type: ignore[union-attr]
        [f"engine e{i}: down" for i in range(MAX_REASONS + 4)],
        0,
        1,
    )
    (tmp_path / "2.ready.json").write_bytes(msgspec.json.encode(many))
    state = readiness(service)
    assert len(state.reasons) == MAX_REASONS + 1
    assert state.reasons[-1] == "... and 4 more: see GET /workers"
