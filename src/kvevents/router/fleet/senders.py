"""Who a load note speaks for: sender ids, their seats and runs, and the replica name a
sender publishes under on the NATS bus.

A sender id is ``NAME``, ``NAME#RUN`` or ``NAME/INDEX#RUN`` (a ``--workers`` process):
``NAME`` is the router replica, the part before its first ``/`` or ``#``
(:func:`bus_name`); the part before ``#`` is the sender's *seat* (:func:`seat_of`), a
stable place whose later run supersedes the earlier one (:mod:`kvevents.router.fleet.peers`).

On NATS each replica publishes on ``<group subject>.<NAME>`` only, and a receiver drops
a note whose sender's ``NAME`` is not the last token of the subject it came on, so a NATS
server that lets each credential publish on its own subject only (docs/security.md) makes
a note unable to speak for another replica. A name is therefore one NATS subject token,
and kept to the characters every NATS configuration writes without quoting:
:data:`NAME_PATTERN`.
"""

from __future__ import annotations

import re
import socket

__all__ = [
    "NAME_PATTERN",
    "bus_name",
    "bus_token",
    "check_bus_name",
    "machine_seat",
    "process_sender",
    "seat_of",
    "sender_id",
    "started_at",
]

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A replica name (``--sync-name``): one NATS subject token of letters, digits, ``_``, ``-``."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def bus_token(text: str) -> str:
    """``text`` made a valid replica name: runs of other characters become ``_``, and the
    end is cut to 64 characters (the start, e.g. a host name, is what a reader knows)."""
    return _UNSAFE.sub("_", text)[:64] or "_"


def check_bus_name(name: str, option: str = "--sync-name") -> str:
    """``name`` when it is a valid replica name, else ValueError naming ``option``."""
    if NAME_PATTERN.fullmatch(name) is None:
        raise ValueError(
            f"{option} {name!r}: a replica name is 1 to 64 letters, digits, '_' or '-' "
            "(one NATS subject token, e.g. router-a), unique in the router group"
        )
    return name


def bus_name(sender: str) -> str:
    """The replica a sender id belongs to: the part before its first ``/`` or ``#``."""
    return sender.partition("#")[0].partition("/")[0]


def machine_seat(port: int) -> str:
    """The default name of a router serving ``port`` on this machine: host name, port and
    the kernel's boot id, the same when the router restarts, apart for two machines that
    share a host name (two VMs both called ``localhost`` on the same port). It is a valid
    replica name (:func:`bus_token`); one a NATS configuration can name in advance is
    given with ``--sync-name``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:  # not Linux: the host name and port alone
        boot = ""
    host = bus_token(socket.gethostname())[:40]
    return bus_token(f"{host}-{port}-{boot}" if boot else f"{host}-{port}")


def sender_id(seat: str, run: str) -> str:
    """A sender id naming a seat (a stable place, e.g. a worker index) and this run of it:
    a later run in the same seat supersedes the earlier one (module docstring).

    A run ending in ``-<start time in ns>`` (``--workers`` use ``PID-TIME_NS``) is ordered
    by that time: a note from a run that started before the one heard in its seat is a
    dead run's late note, whichever came first. Other runs are ordered as they are heard.
    """
    if "#" in seat:
        raise ValueError(f"note sender seat {seat!r}: must not contain '#'")
    return f"{seat}#{run}"


def process_sender(name: str | None, port: int, run: str) -> str:
    """The sender id of a one-process router: seated at its replica ``name``
    (``--sync-name``), else at this machine and ``port`` when the port is fixed, so a
    restarted replica's first note (its hello) makes its peers drop what its previous run
    left in flight; with neither (``--port 0``) a seatless name of this host and run."""
    if name is not None or port:
        return sender_id(name or machine_seat(port), run)
    return bus_token(f"{bus_token(socket.gethostname())[:40]}-{run}")


def seat_of(sender: str) -> str | None:
    """The seat of a sender id (before its last ``#``), or None: a sender without one."""
    seat, sep, _ = sender.rpartition("#")
    return seat if sep else None


def started_at(sender: str) -> int | None:
    """The start time a sender's run ends with (:func:`sender_id`), or None."""
    _, sep, tail = sender.rpartition("#")[2].rpartition("-")
    return int(tail) if sep and tail.isascii() and tail.isdigit() else None
