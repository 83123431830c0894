"""``kvevents router --workers N``: N router processes serving one port.

Each worker process is a whole router: it follows every engine's streams itself (ZMQ
fans each stream out to every subscriber), keeps its own index, polls the engines, and
listens on the same port with ``SO_REUSEPORT``, so the kernel spreads connections over
the processes. The processes tell each other every request they route and every one
that ends (:mod:`kvevents.router.fleet.peers`, over ``ipc://`` sockets in a private
folder), so each one's cost sees all N processes' traffic.

The parent only supervises. It reserves the port (bound, never listening, so it gets no
connection), which must be free, since ``SO_REUSEPORT`` would let a second group share
it; a lock file named after host and port marks it as this group's, and the private
folder (ipc sockets, metrics snapshots, readiness files) is named after it too, so what a
killed group left is swept by the next. It starts the workers (spawn), prints ``kvevents
router ready URL`` once every worker accepts requests (then worker 0's readiness line,
the group's: :mod:`kvevents.router.serve.group_readiness`), restarts a worker that dies (after a delay that
doubles while it keeps dying soon after its start) or that is not ready in time after a
restart, and on SIGINT or SIGTERM stops them all. A worker stops by itself when the
parent is gone, so none serves the port unsupervised. A restarted worker's index refills
by replay, and its peers' view of its in-flight requests ages out
(:data:`~kvevents.router.fleet.peers.DEFAULT_NOTE_TTL`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import glob
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

from kvevents.cli.options import configure_logging
from kvevents.cli.security import RouterSecurity
from kvevents.errors import EndpointError, KVEventsError
from kvevents.http.serving import bind_http, run_event_loop, serve_app
from kvevents.router.fleet.peers import PeerNotes, machine_seat, sender_id
from kvevents.router.serve.app import create_app
from kvevents.router.serve.group_metrics import GroupMetrics
from kvevents.router.serve.group_readiness import GroupReadiness
from kvevents.router.serve.readiness import (
    READINESS_PREFIX,
    READY_REPORT_WAIT_S,
    Readiness,
    publish_readiness,
    report_readiness,
)
from kvevents.router.serve.service import RouterService

__all__ = ["serve_workers"]

log = logging.getLogger("kvevents.router")

_READY_TIMEOUT = 120.0
_STOP_TIMEOUT = 10.0
_RESTART_DELAY = 1.0
"""Seconds before a dead worker is started again; doubled while it keeps dying young."""
_RESTART_DELAY_MAX = 30.0
_SNAPSHOT_S = 1.0
"""Seconds between two metrics snapshots of a worker (router/serve/group_metrics.py)."""
_STABLE_AFTER = 60.0
"""A worker that ran this long before it died is restarted after the first delay again."""


def _endpoint(folder: str, index: int) -> str:
    return f"ipc://{folder}/worker-{index}"


def _worker_main(
    build_service: Callable[[argparse.Namespace], RouterService],
    args: argparse.Namespace,
    index: int,
    workers: int,
    port: int,
    folder: str,
    ready: Any,
    security: RouterSecurity,
) -> None:
    """One worker process: build the router from the same options, serve the shared port."""

    configure_logging(str(getattr(args, "log_level", None) or "warning"))
    if index > 0:  # what every process sees alike is told once, by process 0
        for handler in logging.getLogger().handlers:
            handler.addFilter(_told_by_process_zero)
    try:
        service = build_service(args)
    except (KVEventsError, ValueError) as exc:
        print(f"kvevents router: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    service.process_index = index
    service.process_count = workers
    service.group_metrics = GroupMetrics(service.registry, os.path.join(folder, "metrics"), index)
    service.group_readiness = GroupReadiness(os.path.join(folder, "ready"), index, workers)

    # The group's seat, this machine and port (machine_seat): the same when the router restarts, so a
    # restarted worker (or group) supersedes what its previous run left in flight at its
    # peers. With --sync, the group's own notes arrive over ipc, so the NATS copies of
    # them are ignored.
    group = (service.sync.name if service.sync is not None else None) or machine_seat(port)
    if service.sync is not None:
        service.sync.ignore_prefix = f"{group}/"

    async def main() -> int:
        peers = PeerNotes(
            service.router,
            sender=sender_id(f"{group}/{index}", f"{os.getpid()}-{time.time_ns()}"),
            own=_endpoint(folder, index),
            peers=[_endpoint(folder, j) for j in range(workers) if j != index],
            extra=[] if service.sync is None else [service.sync],
            follows=service.workers.__contains__,
            max_request_tokens=args.max_body_bytes,
        )
        peers.start()
        service.peers = peers
        snapshots = asyncio.get_running_loop().create_task(_snapshots(service))
        published = asyncio.get_running_loop().create_task(publish_readiness(service))

        reported: list[asyncio.Task[Readiness]] = []  # held: a bare task may vanish

        def say_readiness(line: str) -> None:
            """Worker 0's readiness line, to the parent, which prints it after its ready line."""
            with contextlib.suppress(OSError):  # a restarted worker's: the parent no longer reads
                ready.send(READINESS_PREFIX + line)
            ready.close()

        def announce(url: str) -> None:
            with contextlib.suppress(OSError):  # the parent reads it; gone, it stops us
                ready.send(url)
            service.serving()
            if index == 0:
                reported.append(asyncio.create_task(report_readiness(service, say_readiness)))
            else:
                ready.close()

        # The parent gone (killed: it stops its workers itself otherwise), nothing would
        # stop this worker, which would go on serving the port: stop as on SIGTERM.
        parent = multiprocessing.parent_process()
        if parent is not None:
            loop = asyncio.get_running_loop()

            def orphaned() -> None:
                loop.remove_reader(parent.sentinel)
                log.error("router worker %d: the supervising process is gone; stopping", index)
                os.kill(os.getpid(), signal.SIGTERM)

            loop.add_reader(parent.sentinel, orphaned)

        try:
            app = create_app(
                service,
                max_body_bytes=args.max_body_bytes,
                api_key=security.api_key,
                metrics_auth=security.metrics_auth,
            )
            return await serve_app(
                app,
                args.host,
                port,
                "",
                "router",
                reuse_port=True,
                announce=announce,
                tls=security.tls,
                limits=service.http_limits,
            )
        finally:
            snapshots.cancel()
            published.cancel()
            await peers.close()

    with contextlib.suppress(KeyboardInterrupt):
        run_event_loop(main())


_SHARED_LOGGERS = ("kvevents.subscribe", "kvevents.index", "kvevents.router.fleet.engines")
"""Loggers of what every worker sees alike (the engines, their streams and events)."""


def _told_by_process_zero(record: logging.LogRecord) -> bool:
    """False for a warning every worker would log alike: process 0 logs it for the group."""
    return record.levelno < logging.WARNING or not record.name.startswith(_SHARED_LOGGERS)


async def _snapshots(service: RouterService) -> None:
    """This worker's metrics snapshot for the group's ``/metrics``, once a second."""
    group = service.group_metrics
    while group is not None:
        await asyncio.sleep(_SNAPSHOT_S)
        try:
            group.write()
        except OSError as exc:  # the folder is gone: the group is stopping
            log.debug("router worker %d: metrics snapshot not written: %s", group.index, exc)


def serve_workers(
    build_service: Callable[[argparse.Namespace], RouterService],
    args: argparse.Namespace,
    workers: int,
    ready_prefix: str,
    security: RouterSecurity | None = None,
) -> int:
    """Run ``workers`` router processes on one port until SIGINT/SIGTERM (module docstring).

    ``build_service(args)`` builds each worker's service (in the worker process, which
    reads the engine key and CA bundle from ``args`` itself); every worker serves with
    ``security``'s key and TLS (default: neither).
    """
    security = security or RouterSecurity()
    if args.port != 0:
        # SO_REUSEPORT lets a second group bind beside one already serving the port (the
        # kernel would then share the connections out between the two): bound once
        # without it, the port must be free.
        bind_http(args.host, args.port, "router", listen=False).close()
    reserve = bind_http(args.host, args.port, "router", reuse_port=True, listen=False)
    port = reserve.getsockname()[1]
    try:
        claim = _claim_port(args.host, port)
    except BaseException:
        reserve.close()
        raise
    folder = _group_folder(args.host, port)
    ctx = multiprocessing.get_context("spawn")
    procs: dict[int, BaseProcess] = {}
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    def start(index: int) -> tuple[BaseProcess, Any]:
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_worker_main,
            args=(
                build_service,
                args,
                index,
                workers,
                port,
                folder,
                child_end,
                security,
            ),
            name=f"kvevents-router-{index}",
        )
        proc.start()
        child_end.close()
        procs[index] = proc
        return proc, parent_end

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        started = [start(i) for i in range(workers)]
        url = ""
        deadline = time.monotonic() + _READY_TIMEOUT
        for index, (proc, conn) in enumerate(started):
            while not conn.poll(0.1):
                if stopping:
                    return 0
                if not proc.is_alive():
                    raise KVEventsError(
                        f"router worker {index} exited with code {proc.exitcode} before it "
                        "was ready (its error is above)"
                    )
                if time.monotonic() > deadline:
                    raise KVEventsError(
                        f"router worker {index} was not ready within {_READY_TIMEOUT:g} s"
                    )
            try:
                url = conn.recv()
            except EOFError:  # it closed its end, dying: its exit code says more
                proc.join(5.0)
                raise KVEventsError(
                    f"router worker {index} exited with code {proc.exitcode} before it "
                    "was ready (its error is above)"
                ) from None
            if index:
                conn.close()
        reserve.close()
        print(ready_prefix + url, flush=True)
        _print_readiness(started[0][1], lambda: stopping)
        _supervise(procs, start, lambda: stopping)
        return 0
    finally:
        reserve.close()
        _stop_all(list(procs.values()))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(folder, ignore_errors=True)
        if claim is not None:
            with contextlib.suppress(OSError):  # ours while we hold it: nobody else's
                os.unlink(_claim_path(args.host, port))
            os.close(claim)


def _print_readiness(conn: Any, stopping: Callable[[], bool]) -> None:
    """Print worker 0's readiness line (:func:`report_readiness`) once it comes, at most
    a little after the worker's own wait for it, unless stopping; then close its pipe."""
    deadline = time.monotonic() + READY_REPORT_WAIT_S + 2.0
    try:
        while not stopping() and time.monotonic() < deadline:
            if conn.poll(0.1):
                print(conn.recv(), flush=True)
                return
    except (EOFError, OSError):  # worker 0 died meanwhile: the supervisor restarts it
        pass
    finally:
        conn.close()


_IPC_FOLDER_MAX = 80
"""The longest group folder used: an ipc socket's path (folder + ``/worker-N``) must fit
the 107 bytes of a Unix socket address."""


def _claim_path(host: str, port: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"kvevents-router-{host}-{port}.lock")


def _group_folder(host: str, port: int) -> str:
    """The group's private folder (ipc sockets, metrics snapshots, readiness files), named after
    its claim: what a killed group left there is removed first (the claim, held now, says
    no group uses it). A name taken by something that is not our own folder gets a fresh
    one instead."""
    path = _claim_path(host, port)[: -len(".lock")] + ".d"
    if len(path) > _IPC_FOLDER_MAX:  # its ipc socket paths must stay under the OS's limit
        return tempfile.mkdtemp(prefix="kvevents-router-")
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        found = None
    if found is not None:
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
            return tempfile.mkdtemp(prefix="kvevents-router-")
        shutil.rmtree(path, ignore_errors=True)
    try:
        os.mkdir(path, 0o700)
    except OSError:
        return tempfile.mkdtemp(prefix="kvevents-router-")
    return path


def _sweep_stale_claims() -> None:
    """Remove the claims (and folders) of groups that were killed: a claim file no
    process holds a lock on. Ours and live groups' are left alone."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "kvevents-router-*.lock")):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # held: a live group's
        try:
            if os.fstat(fd).st_uid == os.getuid():
                os.unlink(path)
                folder = path[: -len(".lock")] + ".d"
                if os.path.isdir(folder) and not os.path.islink(folder):
                    shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass
        finally:
            os.close(fd)


def _claim_port(host: str, port: int) -> int | None:
    """The group's claim on ``host:port``, held for its life: a lock on a file named
    after them. Until its workers listen, the port is held only by the parent's reserve
    socket, which a second group's bind does not see as taken; the lock does. None when
    the file is another user's (the kernel keeps users' SO_REUSEPORT groups apart).
    Claims of killed groups are swept first (:func:`_sweep_stale_claims`), and the claim
    file is removed when the group stops."""
    _sweep_stale_claims()
    path = _claim_path(host, port)
    try:
        claim = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(claim)
        raise EndpointError(
            f"router HTTP address {host}:{port} cannot be bound (another `kvevents router "
            "--workers` group is starting or serving on it): choose another --port (0 lets "
            "the OS pick)"
        ) from None
    return claim


def _supervise(
    procs: dict[int, BaseProcess],
    start: Callable[[int], tuple[BaseProcess, Any]],
    stopping: Callable[[], bool],
) -> None:
    """Restart the workers that die until ``stopping()``: each after a delay that doubles
    while it keeps dying young (module docstring); a restarted worker's ready message is
    read (and logged) as it comes, so that its announcement finds the parent listening."""
    born = dict.fromkeys(procs, time.monotonic())
    delay = dict.fromkeys(procs, 0.0)
    due: dict[int, float] = {}  # dead workers: when each starts again
    ready: dict[int, Any] = {}  # restarted workers not serving yet: the parent's pipe end
    while not stopping():
        now = time.monotonic()
        for index, proc in procs.items():
            if index in due or proc.is_alive():
                continue
            young = now - born[index] < _STABLE_AFTER
            delay[index] = (
                min(max(2 * delay[index], _RESTART_DELAY), _RESTART_DELAY_MAX)
                if young
                else _RESTART_DELAY
            )
            due[index] = now + delay[index]
            log.error(
                "router worker %d (pid %s) exited with code %s; starting it again in %g s",
                index,
                proc.pid,
                proc.exitcode,
                delay[index],
            )
            stale = ready.pop(index, None)
            if stale is not None:
                stale.close()
        for index, when in list(due.items()):
            if when <= now and not stopping():
                del due[index]
                ready[index] = start(index)[1]
                born[index] = time.monotonic()
        for index, conn in list(ready.items()):
            if not conn.poll():
                proc = procs[index]
                if now - born[index] > _READY_TIMEOUT and proc.is_alive() and proc.pid:
                    # hung before serving, as a first start is bounded: stopped, it is
                    # started again with the others that die
                    log.error(
                        "router worker %d (pid %s) was not ready within %g s; stopping it",
                        index,
                        proc.pid,
                        _READY_TIMEOUT,
                    )
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)
                    born[index] = now  # a restart after a hang counts as dying young
                continue
            with contextlib.suppress(EOFError, OSError):  # EOF: it died first (above)
                conn.recv()
                log.warning("router worker %d (pid %s) serves again", index, procs[index].pid)
            conn.close()
            del ready[index]
        timeout = min([0.5, *(max(0.0, when - now) for when in due.values())])
        alive = [p.sentinel for i, p in procs.items() if i not in due]
        multiprocessing.connection.wait(alive + list(ready.values()), timeout=timeout)
    for conn in ready.values():
        conn.close()


def _stop_all(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_TIMEOUT
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
