"""Binding (or connecting) a publisher's sockets, with errors that say how to fix them.

One function for the live PUB and the replay ROUTER of every rank: it reads back an
OS-picked port (``tcp://*:0``), refuses to take over an ipc path another process is
listening on (libzmq would silently do so), and turns ``EADDRINUSE`` into a message
that names the rank and the pure-DP pitfall (docs/architecture.md, "The problem").
"""

from __future__ import annotations

import os
import socket

import zmq

from kvevents.errors import EndpointError
from kvevents.transport.endpoints import Endpoint

__all__ = ["open_socket"]


def open_socket(
    sock: zmq.Socket[bytes], endpoint: Endpoint, bind: bool, rank: int, role: str
) -> str:
    """Bind or connect; return the address with an OS-picked port filled in."""
    address = str(endpoint)
    if not bind and endpoint.is_tcp and endpoint.port == 0:
        raise EndpointError(
            f"cannot connect the {role} endpoint {address} of publisher rank {rank}: port 0 "
            "means 'the OS picks', which only works when binding; use tcp://*:0 (or set "
            "bind=true) to bind an OS-chosen port, or name the port to connect to"
        )
    if endpoint.is_ipv6:
        sock.ipv6 = True
    if bind and endpoint.scheme == "ipc" and _ipc_listening(str(endpoint.path)):
        # libzmq would silently take the path over, orphaning the publisher bound there.
        clash = zmq.ZMQError(zmq.EADDRINUSE)
        raise EndpointError(_open_error(address, endpoint, bind, rank, role, clash))
    try:
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    except zmq.ZMQError as exc:
        raise EndpointError(_open_error(address, endpoint, bind, rank, role, exc)) from None
    if bind and endpoint.is_tcp and endpoint.port == 0:
        bound = Endpoint.parse(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        assert bound.port is not None
        return str(endpoint.with_port(bound.port))
    return address


def _ipc_listening(path: str) -> bool:
    """True when a process accepts connections on the unix socket ``path``."""
    if path.startswith("@") or not os.path.exists(path):  # abstract namespace, or free
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:  # refused: a stale file left by a process that is gone
            return False
    return True


def _open_error(
    address: str, endpoint: Endpoint, bind: bool, rank: int, role: str, exc: zmq.ZMQError
) -> str:
    verb = "bind" if bind else "connect"
    head = f"cannot {verb} the {role} endpoint {address} of publisher rank {rank}"
    if exc.errno == zmq.EADDRINUSE:
        where = f"port {endpoint.port}" if endpoint.is_tcp else address
        return (
            f"{head}: {where} is already in use by another rank or process. Each rank needs "
            "its own port: rank r binds base + r. Under pure DP every scheduler has "
            "attn_dp_rank 0, so choose the rank with select_kv_publisher_dp_rank(attn_dp_size, "
            "attn_dp_rank, dp_rank); otherwise stop the other process or pick another base port"
        )
    if not bind and endpoint.is_wildcard:
        return f"{head}: a wildcard host can only be bound; set bind=true or name a host"
    return f"{head}: {exc.strerror}"
