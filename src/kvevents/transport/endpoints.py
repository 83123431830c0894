"""Endpoints: parsed once, offset per data-parallel rank, planned for a deployment.

An endpoint string is parsed into an :class:`Endpoint` value; every later question
(bind or connect? which port for rank 3? is the host routable?) is answered from its
fields, never by searching the string for substrings.

Per-rank offsets follow SGLang: rank ``r`` of a deployment whose base endpoint is
``tcp://*:5557`` publishes on ``tcp://*:5557+r``. Unlike upstream:

* port 0 means "the OS picks" and stays 0 for every rank (upstream offsets it to 1, 2,
  …); the publisher reads the real port back after binding;
* ``port + rank`` above 65535 is refused with the range in the message;
* ipc and inproc endpoints get a ``_dp{rank}`` suffix instead of being refused;
* a :class:`PortPlan` refuses overlapping live and replay ranges before anything binds;
  :func:`free_port_range` finds a base whose whole range is free (for tests and
  single-machine deployments that want fixed ``base + rank`` ports without choosing).

Which rank a publisher uses is :func:`select_kv_publisher_dp_rank`
(docs/architecture.md, "The problem"): the attention-DP rank in DP-attention mode,
else the DP rank, so both modes span ``0..dp_size-1``.

Parsing, per-rank offsets and the port plan stay in one module: they are one concept
(where rank ``r`` publishes), and the plan applies the parsing rules rather than
re-deriving them.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from kvevents.errors import EndpointError, KVEventsError

__all__ = [
    "WILDCARD_HOSTS",
    "Endpoint",
    "PortPlan",
    "RankEndpoints",
    "free_port_range",
    "offset_endpoint_port",
    "select_kv_publisher_dp_rank",
]

Scheme = Literal["tcp", "ipc", "inproc"]
_SCHEMES: tuple[Scheme, ...] = ("tcp", "ipc", "inproc")
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::"})
"""Hosts that mean "every interface": bound by a publisher, replaced by the engine's host by a consumer."""
MAX_PORT = 65535


def select_kv_publisher_dp_rank(attn_dp_size: int, attn_dp_rank: int, dp_rank: int | None) -> int:
    """The rank a scheduler's KV-event publisher offsets its ports by.

    DP-attention (``attn_dp_size > 1``): the attention-DP rank. Pure DP or a single
    replica: the DP rank, or 0 when there is none. Either way the ranks of a deployment
    span ``0..dp_size-1``, the range ``/server_info`` advertises.
    """
    if attn_dp_size > 1:
        return attn_dp_rank
    return 0 if dp_rank is None else dp_rank


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A parsed ZMQ endpoint.

    ``tcp``: ``host`` (a name, an IPv4 address, an IPv6 address without brackets, or a
    wildcard) and ``port`` (0 = OS picks). ``ipc`` and ``inproc``: ``path``.
    ``str(endpoint)`` is the address to hand to ZMQ.
    """

    scheme: Scheme
    host: str | None = None
    port: int | None = None
    path: str | None = None

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """Parse ``tcp://HOST:PORT``, ``tcp://[IPV6]:PORT``, ``ipc://PATH`` or ``inproc://NAME``."""
        if not isinstance(text, str):
            raise EndpointError(f"endpoint {text!r} must be a string like 'tcp://*:5557'")
        scheme, sep, rest = text.partition("://")
        if not sep or scheme not in _SCHEMES:
            raise EndpointError(
                f"endpoint {text!r} has an unknown scheme {scheme!r}: use tcp://HOST:PORT, "
                "ipc://PATH or inproc://NAME"
            )
        if scheme != "tcp":
            if not rest:
                raise EndpointError(f"endpoint {text!r} has no path: write {scheme}://NAME")
            return cls(scheme=scheme, path=rest)
        return cls._parse_tcp(text, rest)

    @classmethod
    def _parse_tcp(cls, text: str, rest: str) -> Endpoint:
        if rest.startswith("["):
            host, bracket, tail = rest[1:].partition("]")
            if not bracket:
                raise EndpointError(
                    f"endpoint {text!r} opens '[' for an IPv6 host but never closes it"
                )
            if not tail.startswith(":"):
                raise EndpointError(
                    f"endpoint {text!r} has no port: write tcp://[{host}]:PORT, e.g. tcp://[{host}]:5557"
                )
            port_text = tail[1:]
        else:
            host, colon, port_text = rest.rpartition(":")
            if not colon:
                raise EndpointError(
                    f"endpoint {text!r} has no port: write tcp://HOST:PORT, e.g. tcp://{rest or '*'}:5557"
                )
            if ":" in host:  # bare IPv6 such as tcp://:::5557
                try:
                    ipaddress.IPv6Address(host)
                except ValueError:
                    raise EndpointError(
                        f"endpoint {text!r} has an ambiguous host {host!r}: put IPv6 addresses "
                        "in brackets, tcp://[ADDR]:PORT"
                    ) from None
        if not host:
            raise EndpointError(
                f"endpoint {text!r} has no host: write tcp://*:PORT to bind every interface"
            )
        if port_text == "*":
            port = 0
        elif port_text.isdigit():
            port = int(port_text)
        else:
            raise EndpointError(
                f"endpoint {text!r} has a non-numeric port {port_text!r}: use a number in "
                "0..65535 (0 lets the OS pick)"
            )
        if port > MAX_PORT:
            raise EndpointError(f"endpoint {text!r} has port {port}, above {MAX_PORT}")
        return cls(scheme="tcp", host=host, port=port)

    @property
    def is_tcp(self) -> bool:
        return self.scheme == "tcp"

    @property
    def is_wildcard(self) -> bool:
        """A tcp endpoint on every interface (``*``, ``0.0.0.0``, ``::``)."""
        return self.scheme == "tcp" and self.host in WILDCARD_HOSTS

    @property
    def is_ipv6(self) -> bool:
        return self.host is not None and ":" in self.host

    @property
    def should_bind(self) -> bool:
        """SGLang's default when ``bind`` is not given: bind wildcards, ipc and inproc; connect otherwise."""
        return self.scheme != "tcp" or self.is_wildcard

    def with_port(self, port: int) -> Endpoint:
        """The same tcp endpoint on another port."""
        if self.scheme != "tcp":
            raise EndpointError(f"endpoint {self} is {self.scheme}, it has no port")
        if not 0 <= port <= MAX_PORT:
            raise EndpointError(f"port {port} for endpoint {self} is outside 0..{MAX_PORT}")
        return Endpoint(scheme="tcp", host=self.host, port=port)

    def for_rank(self, rank: int | None) -> Endpoint:
        """This endpoint offset for data-parallel ``rank``.

        tcp: port + rank (port 0 stays 0: the OS picks for every rank). ipc and inproc:
        ``_dp{rank}`` appended to the path. Rank 0 and None give the endpoint unchanged.
        """
        if not rank:
            return self
        if rank < 0:
            raise EndpointError(f"rank {rank} for endpoint {self} must be >= 0")
        if self.scheme != "tcp":
            return Endpoint(scheme=self.scheme, path=f"{self.path}_dp{rank}")
        assert self.port is not None
        if self.port == 0:
            return self
        if self.port + rank > MAX_PORT:
            raise EndpointError(
                f"endpoint {self} offset for rank {rank} needs port {self.port + rank}, above "
                f"{MAX_PORT}: choose a base port at most {MAX_PORT - rank}"
            )
        return Endpoint(scheme="tcp", host=self.host, port=self.port + rank)

    def __str__(self) -> str:
        if self.scheme != "tcp":
            return f"{self.scheme}://{self.path}"
        host = f"[{self.host}]" if self.is_ipv6 else self.host
        return f"tcp://{host}:{self.port}"


def offset_endpoint_port(endpoint: str | None, rank: int | None) -> str | None:
    """SGLang's helper, right: ``tcp://*:5557`` for rank 3 is ``tcp://*:5560``.

    ``None`` stays ``None``; rank 0 or None returns the string unchanged; ipc and inproc
    get ``_dp{rank}``; port 0 stays 0. Invalid input raises :class:`EndpointError`.
    """
    if endpoint is None:
        return None
    parsed = Endpoint.parse(endpoint)
    if not rank:
        return endpoint
    return str(parsed.for_rank(rank))


@dataclass(frozen=True, slots=True)
class RankEndpoints:
    """Where one rank publishes live and (optionally) serves replay."""

    rank: int
    endpoint: Endpoint
    replay_endpoint: Endpoint | None


def _describe_range(base: Endpoint, dp_size: int) -> str:
    if base.scheme == "tcp":
        last = base.port if base.port == 0 else (base.port or 0) + dp_size - 1
        return f"{base.host}:{base.port}-{last}"
    return f"{base.for_rank(0)} .. {base.for_rank(dp_size - 1)}"


def _hosts_may_clash(a: Endpoint, b: Endpoint) -> bool:
    return a.host == b.host or a.is_wildcard or b.is_wildcard


@dataclass(frozen=True, slots=True)
class PortPlan:
    """Every rank's live and replay endpoint for a deployment of ``dp_size`` ranks.

    Built with :meth:`build`, which checks the whole plan before any socket exists:
    every port fits in 0..65535 and no live port equals a replay port.
    """

    dp_size: int
    ranks: tuple[RankEndpoints, ...]

    @classmethod
    def build(
        cls,
        dp_size: int,
        endpoint: str | Endpoint,
        replay_endpoint: str | Endpoint | None = None,
    ) -> PortPlan:
        if dp_size < 1:
            raise EndpointError(f"dp_size={dp_size} must be at least 1")
        live = endpoint if isinstance(endpoint, Endpoint) else Endpoint.parse(endpoint)
        replay = (
            replay_endpoint
            if isinstance(replay_endpoint, Endpoint) or replay_endpoint is None
            else Endpoint.parse(replay_endpoint)
        )
        top = dp_size - 1
        for name, base in (("live", live), ("replay", replay)):
            if (
                base is not None
                and base.scheme == "tcp"
                and base.port
                and base.port + top > MAX_PORT
            ):
                raise EndpointError(
                    f"{name} endpoint {base} for dp_size={dp_size} needs ports "
                    f"{base.port}-{base.port + top}, above {MAX_PORT}: choose a base port at most "
                    f"{MAX_PORT - top}"
                )
        if replay is not None:
            cls._check_overlap(live, replay, dp_size)
        ranks = tuple(
            RankEndpoints(r, live.for_rank(r), None if replay is None else replay.for_rank(r))
            for r in range(dp_size)
        )
        return cls(dp_size=dp_size, ranks=ranks)

    @staticmethod
    def _check_overlap(live: Endpoint, replay: Endpoint, dp_size: int) -> None:
        clash = False
        if live.scheme != replay.scheme:
            return
        if live.scheme == "tcp":
            if live.port == 0 or replay.port == 0 or not _hosts_may_clash(live, replay):
                return
            assert live.port is not None and replay.port is not None
            clash = abs(live.port - replay.port) < dp_size
        else:
            live_paths = {str(live.for_rank(r)) for r in range(dp_size)}
            clash = any(str(replay.for_rank(r)) in live_paths for r in range(dp_size))
        if clash:
            raise EndpointError(
                f"live endpoints {_describe_range(live, dp_size)} and replay endpoints "
                f"{_describe_range(replay, dp_size)} overlap for dp_size={dp_size}: each rank "
                f"needs its own port in both ranges; move replay_endpoint at least {dp_size} "
                "ports away from endpoint"
            )

    def __iter__(self) -> Iterator[RankEndpoints]:
        return iter(self.ranks)


def free_port_range(count: int, *, attempts: int = 50) -> int:
    """A tcp port ``base`` such that ``base .. base + count - 1`` are all free right now.

    The OS picks ``base`` (a bind to port 0); every port of the range is then bound on
    the wildcard address, as a publisher binding ``tcp://*:PORT`` would, and released.
    "Free right now" is all anyone can promise: another process may take a port before
    the caller binds it. KVEventsError after ``attempts`` bases that did not fit.
    """
    if count < 1:
        raise ValueError(f"free_port_range(count={count}): count must be at least 1")
    for _ in range(attempts):
        held: list[socket.socket] = []
        try:
            probe = socket.socket()
            held.append(probe)
            probe.bind(("", 0))
            base = int(probe.getsockname()[1])
            if base + count - 1 > MAX_PORT:
                continue
            for port in range(base + 1, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise KVEventsError(f"no {count} consecutive free tcp ports found in {attempts} attempts")
