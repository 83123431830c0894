"""`kvevents router --workers N` supervised: a worker that dies is replaced and serves, the
workers do not outlive a killed parent, and a port another group serves is refused.

Real processes: a `kvevents engine` and `kvevents router --workers 2` subprocesses; which
worker answers a request is read from `/workers` (`process`), a new connection each time
so that the kernel spreads them over the workers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_support import Engine, RouterProc, wait_until

from kvevents.cli import router_workers
from kvevents.cli.router import default_workers
from process_support import KVEventsProcess, run_kvevents

pytestmark = pytest.mark.slow


def _workers_seen(url: str, tries: int = 16) -> dict[int, int]:
    """Per worker index that answered one of ``tries`` new connections, its pid."""
    seen: dict[int, int] = {}
    for _ in range(tries):
        with httpx.Client(base_url=url, timeout=10.0) as fresh:
            process = fresh.get("/workers").json()["process"]
        seen[process["index"]] = process["pid"]
    return seen


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone for this purpose
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_killed_worker_is_replaced_by_one_that_stays_and_serves(engine: Engine) -> None:
    """SIGKILL one of two workers: a new process takes its index, answers on the port,
    and is still the same process seconds later (it does not die and come back)."""
    proc = RouterProc([engine.url], "--workers", "2")
    try:
        pids: dict[int, int] = {}
        wait_until(lambda: len(pids.update(_workers_seen(proc.url)) or pids) == 2, 30, "both")
        os.kill(pids[1], signal.SIGKILL)
        replaced: dict[int, int] = {}

        def new_worker_answers() -> bool:
            try:
                seen = _workers_seen(proc.url)
            except httpx.TransportError:
                # a connection the kernel had queued at the killed worker, reset as its
                # socket closed (what a client of a killed worker sees; it retries)
                return False
            if seen.get(1, pids[1]) != pids[1]:
                replaced[1] = seen[1]
            return bool(replaced)

        wait_until(new_worker_answers, 30, "a new worker 1 answering on the port")
        time.sleep(3.0)  # a worker that fails after it starts would be gone and replaced
        assert _alive(replaced[1])
        wait_until(lambda: _workers_seen(proc.url).get(1) == replaced[1], 10, "it answering")
        assert _alive(pids[0]) and _workers_seen(proc.url).get(0, pids[0]) == pids[0]
    finally:
        proc.stop()
    assert "starting it again" in proc.stderr and "serves again" in proc.stderr


def test_workers_stop_when_their_parent_is_killed(engine: Engine) -> None:
    """The supervising process SIGKILLed (it cannot stop them): its workers stop by
    themselves, and the port is free again."""
    proc = RouterProc([engine.url], "--workers", "2")
    pids: dict[int, int] = {}
    try:
        wait_until(lambda: len(pids.update(_workers_seen(proc.url)) or pids) == 2, 30, "both")
        proc.proc.kill()
        proc.wait_exit()
        wait_until(lambda: not any(_alive(p) for p in pids.values()), 20, "the workers to stop")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{proc.url}/health", timeout=5.0)
    finally:
        proc.stop(expect=None)
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_port_another_router_group_serves_is_refused(engine: Engine) -> None:
    """`SO_REUSEPORT` would let a second `--workers` group bind beside a first on the same
    port and take part of its connections: the second is refused, naming the port."""
    first = RouterProc([engine.url], "--workers", "2")
    try:
        port = first.url.rsplit(":", 1)[1]
        argv = ["router", "--engine", engine.url, "--port", port, "--workers", "2"]
        second = subprocess.run(
            [sys.executable, "-m", "kvevents.cli.main", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert second.returncode != 0
        assert f"127.0.0.1:{port} cannot be bound" in second.stderr
        assert "choose another --port" in second.stderr
    finally:
        first.stop()


def test_two_groups_started_together_on_one_port_do_not_share_it(engine: Engine) -> None:
    """Two `--workers 2` groups started at once on the same free port: until workers
    listen, only the parents' reserve sockets hold it, which do not see each other; the
    group's claim on the port does. One serves, the other is refused, naming the port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    argv = [sys.executable, "-m", "kvevents.cli.main", "router", "--engine", engine.url]
    argv += ["--port", port, "--workers", "2"]
    groups = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        refused = []
        deadline = time.monotonic() + 60
        while not refused and time.monotonic() < deadline:
            refused = [g for g in groups if g.poll() is not None]
            time.sleep(0.1)
        assert len(refused) == 1, "one of the two groups must be refused"
        (loser,) = refused
        assert loser.returncode != 0
        assert f"127.0.0.1:{port} cannot be bound" in loser.communicate(timeout=10)[1]
        (winner,) = [g for g in groups if g is not loser]

        def serving() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5.0).is_success
            except httpx.HTTPError:
                return False

        wait_until(serving, 30, "the other group serving")
        assert winner.poll() is None
    finally:
        for group in groups:
            if group.poll() is None:
                group.send_signal(signal.SIGTERM)
            group.communicate(timeout=30)


def _silent_worker(ready: Any) -> None:
    """A worker that holds its ready pipe and never says it is ready."""
    time.sleep(60)


def test_a_restarted_worker_that_hangs_before_it_is_ready_is_stopped_and_restarted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The supervisor's loop on real processes that never say they are ready: a worker
    that died is started again, and the new one, silent past the ready bound (1 s here,
    as the first start is bounded), is stopped and started again in its turn."""
    monkeypatch.setattr(router_workers, "_READY_TIMEOUT", 1.0)
    ctx = multiprocessing.get_context("spawn")
    procs: dict[int, Any] = {}
    started: list[Any] = []

    def start(index: int) -> tuple[Any, Any]:
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_silent_worker, args=(child_end,))
        proc.start()
        child_end.close()
        procs[index] = proc
        started.append(proc)
        return proc, parent_end

    try:
        start(0)
        started[0].kill()  # the first worker dies
        started[0].join(10)
        deadline = time.monotonic() + 30
        router_workers._supervise(
            procs, start, lambda: len(started) >= 3 or time.monotonic() > deadline
        )
        assert len(started) >= 3, "the hung restart was not stopped and started again"
        started[1].join(10)
        assert started[1].exitcode == -signal.SIGKILL
    finally:
        for proc in started:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 2), (16, 16)])
def test_default_workers_are_one_per_core(cores: int, expected: int) -> None:
    """By default the router starts one process per core it may run on."""
    assert default_workers(cores) == expected


def test_a_router_without_workers_starts_the_default_count(engine: Engine) -> None:
    """Without --workers the router starts default_workers() processes for the cores it
    may run on (two here, whatever the machine has), as /workers says
    (``process.workers``); --help states the default for where it runs."""
    usable = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(usable)[:2])  # the router inherits it
    try:
        proc = KVEventsProcess("router", ["--engine", engine.url, "--port", "0"])
    finally:
        os.sched_setaffinity(0, usable)
    try:
        expected = default_workers(min(2, len(usable)))
        assert proc.http.get("/workers").json()["process"]["workers"] == expected
    finally:
        proc.stop()
    shown = run_kvevents("router", "--help").stdout
    assert f"one per usable core, here {default_workers()})" in " ".join(shown.split())


def test_http_server_granian_is_refused_naming_what_serves() -> None:
    """granian is gone: asking for it is a clear error saying uvicorn serves every route."""
    failed = run_kvevents(
        "router", "--engine", "http://127.0.0.1:9", "--port", "0", "--http-server", "granian"
    )
    assert failed.returncode == 2
    assert "--http-server granian: uvicorn (with httptools and uvloop) serves every route" in (
        failed.stderr
    )


def _claim_files(port: str) -> tuple[Path, Path]:
    stem = Path(tempfile.gettempdir()) / f"kvevents-router-127.0.0.1-{port}"
    return stem.with_name(stem.name + ".lock"), stem.with_name(stem.name + ".d")


def test_a_killed_groups_leftovers_are_removed_by_the_next_start_and_a_clean_stop(
    engine: Engine,
) -> None:
    """A group SIGKILLed leaves its claim and folder; the next group on that port removes
    what was in the folder, a stale claim of another port is swept, and a clean stop
    leaves nothing behind."""
    first = RouterProc([engine.url], "--workers", "2", "--host", "127.0.0.1")
    port = first.url.rsplit(":", 1)[1]
    lock, folder = _claim_files(port)
    assert lock.exists() and folder.is_dir()
    workers = _workers_seen(first.url)
    first.stop(signal.SIGKILL, expect=None)  # no cleanup: as a killed pod's
    wait_until(lambda: not any(_alive(p) for p in workers.values()), 20, "the workers to stop")
    assert lock.exists() and folder.is_dir()
    (folder / "left-behind").write_text("from the killed group")
    other_lock, other_folder = _claim_files("1")  # a killed group's on another port
    other_lock.write_text("")
    other_folder.mkdir(exist_ok=True)
    second = RouterProc(
        [engine.url], "--workers", "2", "--host", "127.0.0.1", "--port", port, timeout=60
    )
    try:
        assert folder.is_dir() and not (folder / "left-behind").exists()
        assert not other_lock.exists() and not other_folder.exists()
    finally:
        second.stop()
    assert not lock.exists() and not folder.exists()
