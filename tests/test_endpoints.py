"""Endpoint parsing, per-rank offsets, rank selection and port plans."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvevents import EndpointError, KVEventsError, offset_endpoint_port, select_kv_publisher_dp_rank
from kvevents.transport.endpoints import Endpoint, PortPlan, free_port_range


@pytest.mark.parametrize(
    ("attn_dp_size", "attn_dp_rank", "dp_rank", "expected"),
    [
        (4, 2, 0, 2),  # DP-attention: the attention-DP rank
        (4, 3, None, 3),
        (1, 0, 3, 3),  # pure DP: every scheduler has attn_dp_rank 0, told apart by dp_rank
        (1, 0, None, 0),  # single replica
        (1, 0, 0, 0),
    ],
)
def test_select_kv_publisher_dp_rank(
    attn_dp_size: int, attn_dp_rank: int, dp_rank: int | None, expected: int
) -> None:
    """The publisher rank is attn_dp_rank under DP-attention, else dp_rank (0 when None)."""
    assert select_kv_publisher_dp_rank(attn_dp_size, attn_dp_rank, dp_rank) == expected


def test_pure_dp_ranks_span_dp_size() -> None:
    """Under pure DP and under DP-attention the publisher ranks are exactly 0..dp_size-1."""
    assert [select_kv_publisher_dp_rank(1, 0, r) for r in range(4)] == [0, 1, 2, 3]
    assert [select_kv_publisher_dp_rank(4, r, 0) for r in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", None, "tcp://*:5557"),
        ("tcp://0.0.0.0:6000", 1, "tcp://0.0.0.0:6001"),
        ("tcp://10.1.2.3:5557", 2, "tcp://10.1.2.3:5559"),
        ("tcp://engine-7.local:5557", 1, "tcp://engine-7.local:5558"),
        ("tcp://[::1]:5557", 2, "tcp://[::1]:5559"),
        ("tcp://[::]:5557", 1, "tcp://[::]:5558"),
        ("inproc://cache", 2, "inproc://cache_dp2"),
        ("ipc:///tmp/kv.sock", 1, "ipc:///tmp/kv.sock_dp1"),
        ("tcp://*:0", 3, "tcp://*:0"),  # the OS picks for every rank
        ("tcp://localhost:65534", 1, "tcp://localhost:65535"),
    ],
)
def test_offset_endpoint_port(endpoint: str, rank: int | None, expected: str) -> None:
    """Offsets match SGLang's strings; ipc/inproc get a suffix; port 0 stays 0."""
    assert offset_endpoint_port(endpoint, rank) == expected


def test_offset_of_none_is_none() -> None:
    """No endpoint stays no endpoint (replay off)."""
    assert offset_endpoint_port(None, 3) is None


@pytest.mark.parametrize(
    ("endpoint", "rank", "match"),
    [
        ("tcp://*", 0, "has no port"),
        ("tcp://[::1]", 0, "has no port"),
        ("tcp://*:abc", 0, "non-numeric port 'abc'"),
        ("tcp://*:70000", 0, "above 65535"),
        ("tcp://*:65535", 1, "needs port 65536, above 65535"),
        ("udp://*:5557", 0, "unknown scheme 'udp'"),
        ("*:5557", 0, "unknown scheme"),
        ("tcp://:5557", 0, "has no host"),
        ("tcp://[::1:5557", 0, "never closes"),
        ("tcp://a:b:5557", 0, "put IPv6 addresses in brackets"),
    ],
)
def test_invalid_endpoints_name_the_input(endpoint: str, rank: int, match: str) -> None:
    """Invalid endpoints raise EndpointError (a ValueError) naming the input and the fix."""
    with pytest.raises(EndpointError, match=match) as info:
        offset_endpoint_port(endpoint, rank)
    assert endpoint in str(info.value) or "65536" in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, KVEventsError)


def test_endpoint_fields_and_bind_rule() -> None:
    """Parsing yields scheme/host/port/path; wildcards, ipc and inproc bind, the rest connect."""
    ep = Endpoint.parse("tcp://[::1]:5557")
    assert (ep.scheme, ep.host, ep.port, ep.is_ipv6) == ("tcp", "::1", 5557, True)
    assert not ep.should_bind and not ep.is_wildcard
    for text in ("tcp://*:1", "tcp://0.0.0.0:1", "tcp://[::]:1", "ipc:///tmp/x", "inproc://x"):
        assert Endpoint.parse(text).should_bind, text
    assert Endpoint.parse("tcp://127.0.0.1:*").port == 0
    assert str(Endpoint.parse("tcp://:::5557")) == "tcp://[::]:5557"


@given(st.integers(min_value=1, max_value=65535), st.integers(min_value=0, max_value=512))
def test_tcp_offset_is_port_plus_rank(port: int, rank: int) -> None:
    """For every valid port and rank, the offset is port + rank or a clear refusal."""
    ep = Endpoint.parse(f"tcp://*:{port}")
    if port + rank <= 65535:
        assert ep.for_rank(rank).port == port + rank
    else:
        with pytest.raises(EndpointError, match="above 65535"):
            ep.for_rank(rank)


def test_port_plan_lists_every_rank() -> None:
    """A plan gives each rank its live and replay endpoint."""
    plan = PortPlan.build(4, "tcp://*:5557", "tcp://*:5600")
    assert [(str(r.endpoint), str(r.replay_endpoint)) for r in plan] == [
        (f"tcp://*:{5557 + r}", f"tcp://*:{5600 + r}") for r in range(4)
    ]
    assert [r.replay_endpoint for r in PortPlan.build(2, "tcp://*:5557")] == [None, None]


@pytest.mark.parametrize(
    ("live", "replay", "dp_size", "match"),
    [
        (
            "tcp://*:5557",
            "tcp://*:5559",
            4,
            r"\*:5557-5560 and replay endpoints \*:5559-5562 overlap",
        ),
        ("tcp://*:5557", "tcp://127.0.0.1:5557", 1, "overlap"),
        ("ipc:///tmp/k", "ipc:///tmp/k", 2, "overlap"),
    ],
)
def test_port_plan_refuses_overlap(live: str, replay: str, dp_size: int, match: str) -> None:
    """Overlapping live and replay ranges are refused before binding, naming both ranges."""
    with pytest.raises(EndpointError, match=match):
        PortPlan.build(dp_size, live, replay)


def test_port_plan_allows_disjoint_or_os_chosen() -> None:
    """Adjacent ranges, different hosts and OS-chosen ports are all fine."""
    PortPlan.build(4, "tcp://*:5557", "tcp://*:5561")
    PortPlan.build(4, "tcp://127.0.0.1:5557", "tcp://127.0.0.2:5557")
    PortPlan.build(4, "tcp://*:0", "tcp://*:0")


def test_port_plan_refuses_overflow() -> None:
    """A range that runs past 65535 is refused, naming the range and the highest usable base."""
    with pytest.raises(EndpointError, match=r"needs ports 65534-65537, above 65535.*at most 65532"):
        PortPlan.build(4, "tcp://*:65534")
    with pytest.raises(EndpointError, match="dp_size=0"):
        PortPlan.build(0, "tcp://*:5557")


def test_free_port_range_gives_a_whole_range_that_binds() -> None:
    """Every port of the returned range binds on the wildcard address, as a publisher binds them."""
    base = free_port_range(4)
    socks = [socket.socket() for _ in range(4)]
    try:
        for offset, sock in enumerate(socks):
            sock.bind(("", base + offset))
    finally:
        for sock in socks:
            sock.close()
    with pytest.raises(ValueError, match="count must be at least 1"):
        free_port_range(0)
