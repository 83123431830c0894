"""Discovery: /server_info documents into per-rank stream descriptions."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvevents import (
    DiscoveryError,
    EndpointError,
    KVEventsConfig,
    StreamSpec,
    discover,
    streams_from_server_info,
)
from kvevents.engine.server_info import BoundPublisher, build_kv_events_block
from kvevents.subscribe.discovery import (
    fetch_server_info,
    normalize_engine_url,
    streams_from_kv_event_sources,
)
from kvevents.subscribe.engine_watcher import EngineWatcher
from kvevents.subscribe.stream_spec import MISSED_WITHOUT_REPLAY
from subscriber_support import wait_for


def info(**kv: Any) -> dict[str, Any]:
    block = {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "kv",
        "block_size": 16,
        "dp_size": 4,
    }
    block.update(kv)
    return {"dp_size": block["dp_size"], "page_size": 16, "kv_events": block}


def test_base_plus_rank_with_wildcard_host_uses_engine_host() -> None:
    """A wildcard endpoint_host becomes the engine URL's host, one stream per rank on base + r."""
    specs = streams_from_server_info(info(), engine_url="http://10.1.2.3:30000")
    assert [s.endpoint for s in specs] == [f"tcp://10.1.2.3:{5557 + r}" for r in range(4)]
    assert [s.dp_rank for s in specs] == [0, 1, 2, 3]
    assert all(s.replay_endpoint is None and s.topic == "kv" and s.block_size == 16 for s in specs)
    assert {s.worker for s in specs} == {"http://10.1.2.3:30000"}


@pytest.mark.parametrize("wildcard", ["*", "0.0.0.0", "::"])
def test_every_wildcard_spelling_is_replaced(wildcard: str) -> None:
    """Each wildcard spelling (*, 0.0.0.0, ::) is replaced by the engine's host."""
    specs = streams_from_server_info(
        info(endpoint_host=wildcard, dp_size=1), engine_url="http://engine-a:8000"
    )
    assert specs[0].endpoint == "tcp://engine-a:5557"


def test_ipv6_engine_host_is_bracketed() -> None:
    """An IPv6 engine host yields a bracketed ZMQ address."""
    specs = streams_from_server_info(info(dp_size=1), engine_url="http://[::1]:8000")
    assert specs[0].endpoint == "tcp://[::1]:5557"


def test_explicit_host_and_replay_base_are_used() -> None:
    """A concrete endpoint_host is kept and replay endpoints follow replay base + rank."""
    specs = streams_from_server_info(
        info(endpoint_host="192.168.0.9", replay_endpoint_port_base=6000, dp_size=2),
        engine_url="http://10.0.0.1:1",
    )
    assert [(s.endpoint, s.replay_endpoint) for s in specs] == [
        ("tcp://192.168.0.9:5557", "tcp://192.168.0.9:6000"),
        ("tcp://192.168.0.9:5558", "tcp://192.168.0.9:6001"),
    ]


def test_publishers_list_wins_over_base_plus_rank() -> None:
    """When a publishers list is present its endpoints are used, wildcards resolved, in rank order."""
    doc = info(
        dp_size=2,
        endpoint_port_base=None,
        publishers=[
            {"dp_rank": 1, "endpoint": "tcp://*:41000", "replay_endpoint": "tcp://*:42000"},
            {"dp_rank": 0, "endpoint": "tcp://10.9.9.9:39000", "replay_endpoint": None},
        ],
    )
    specs = streams_from_server_info(doc, engine_url="http://127.0.0.1:8000", worker="eng-a")
    assert specs == [
        StreamSpec(
            worker="eng-a", dp_rank=0, endpoint="tcp://10.9.9.9:39000", topic="kv", block_size=16
        ),
        StreamSpec(
            worker="eng-a",
            dp_rank=1,
            endpoint="tcp://127.0.0.1:41000",
            replay_endpoint="tcp://127.0.0.1:42000",
            topic="kv",
            block_size=16,
        ),
    ]


def test_publishers_list_missing_a_rank_is_refused() -> None:
    """A publishers list that does not cover every rank of dp_size is a DiscoveryError naming the ranks."""
    doc = info(dp_size=3, publishers=[{"dp_rank": 0, "endpoint": "tcp://*:1"}])
    with pytest.raises(DiscoveryError, match=r"ranks \[0\] but dp_size is 3"):
        streams_from_server_info(doc, engine_url="http://h:1")


def test_block_built_by_the_engine_round_trips() -> None:
    """The engine's own kv_events block with OS-picked, non-consecutive ports is read back exactly."""
    config = KVEventsConfig(
        publisher="zmq", endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="t"
    )
    bound = [
        BoundPublisher(0, "tcp://*:40001", "tcp://*:40100"),
        BoundPublisher(1, "tcp://*:40007", "tcp://*:40150"),
    ]
    block = build_kv_events_block(config, bound, dp_size=2, page_size=8)
    specs = streams_from_server_info({"kv_events": block}, engine_url="http://127.0.0.1:9")
    assert [(s.endpoint, s.replay_endpoint, s.block_size) for s in specs] == [
        ("tcp://127.0.0.1:40001", "tcp://127.0.0.1:40100", 8),
        ("tcp://127.0.0.1:40007", "tcp://127.0.0.1:40150", 8),
    ]


@pytest.mark.parametrize(
    "doc",
    [{"dp_size": 2}, {"kv_events": None}, {"kv_events": {"publisher": "null"}}],
)
def test_missing_block_says_publishing_is_off_and_how_to_enable(doc: dict[str, Any]) -> None:
    """No kv_events block (or a null publisher) says publishing looks off and gives the flag to turn it on."""
    with pytest.raises(DiscoveryError) as err:
        streams_from_server_info(doc, engine_url="http://h:1")
    text = str(err.value)
    assert "publishing looks off" in text and "--kv-events-config" in text and "http://h:1" in text


def test_a_publisher_other_than_zmq_is_refused_not_followed_over_zmq() -> None:
    """A block whose publisher is, say, kafka has no ZeroMQ stream at its endpoint."""
    with pytest.raises(DiscoveryError, match=r"publisher is 'kafka'.*only 'zmq'"):
        streams_from_server_info(info(publisher="kafka"), engine_url="http://h:1")
    assert len(streams_from_server_info(info(publisher="zmq"), engine_url="http://h:1")) == 4


def test_wrong_field_type_is_named() -> None:
    """A field of the wrong type is a DiscoveryError naming the field."""
    with pytest.raises(DiscoveryError, match="endpoint_port_base"):
        streams_from_server_info(info(endpoint_port_base="5557"), engine_url="http://h:1")


@pytest.mark.parametrize(
    "doc", [info(block_size=0), info(block_size=-16), {**info(block_size=None), "page_size": 0}]
)
def test_a_block_size_below_one_is_refused(doc: dict[str, Any]) -> None:
    """A block of 0 or fewer tokens is refused naming the field (it was taken as the
    router's block size, and every request of every engine then failed)."""
    with pytest.raises(DiscoveryError, match="positive number of tokens per block"):
        streams_from_server_info(doc, engine_url="http://h:1")


def test_wildcard_without_engine_url_is_refused() -> None:
    """A wildcard host with no engine URL to take the host from is a clear DiscoveryError."""
    with pytest.raises(DiscoveryError, match="engine's URL is needed"):
        streams_from_server_info(info())


def test_explicit_stream_spec_validates_endpoints() -> None:
    """StreamSpec.from_endpoint refuses bind-only wildcard hosts and malformed endpoints."""
    spec = StreamSpec.from_endpoint("tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5600")
    assert spec.worker == "tcp://127.0.0.1:5557" and spec.dp_rank == 0
    with pytest.raises(EndpointError, match="wildcard"):
        StreamSpec.from_endpoint("tcp://*:5557")
    with pytest.raises(EndpointError, match="no port"):
        StreamSpec.from_endpoint("tcp://127.0.0.1")


def test_engine_url_is_normalized() -> None:
    """An engine URL without scheme gets http://, and trailing slashes go."""
    assert normalize_engine_url("127.0.0.1:30000/") == "http://127.0.0.1:30000"


class _Handler(BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[int, bytes]]] = {}

    def do_GET(self) -> None:
        status, body = self.routes.get(self.path, (404, b"not found"))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[tuple[str, dict[str, tuple[int, bytes]]]]:
    """A real HTTP server on an OS-chosen loopback port; routes are set by the test."""
    routes: ClassVar[dict[str, tuple[int, bytes]]] = {}
    handler = type("Handler", (_Handler,), {"routes": routes})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", routes
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.slow
def test_discover_over_http(http_server: tuple[str, dict[str, tuple[int, bytes]]]) -> None:
    """discover() GETs /server_info over HTTP and resolves the wildcard to the URL's host."""
    url, routes = http_server
    routes["/server_info"] = (200, json.dumps(info(dp_size=2)).encode())
    specs = discover(url)
    assert [s.endpoint for s in specs] == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]
    assert specs[0].worker == url


@pytest.mark.slow
def test_http_errors_are_discovery_errors(
    http_server: tuple[str, dict[str, tuple[int, bytes]]],
) -> None:
    """A non-200 answer or a body that is not a JSON object is a DiscoveryError naming the URL."""
    url, routes = http_server
    with pytest.raises(DiscoveryError, match="HTTP 404"):
        fetch_server_info(url)
    routes["/server_info"] = (200, b"<html>")
    with pytest.raises(DiscoveryError, match="did not answer with JSON"):
        fetch_server_info(url)
    routes["/server_info"] = (200, b"[1, 2]")
    with pytest.raises(DiscoveryError, match="expected a JSON object"):
        fetch_server_info(url)


def test_unreachable_engine_is_a_discovery_error() -> None:
    """A URL where nothing listens is a DiscoveryError asking whether the engine runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DiscoveryError, match="is the engine running"):
        discover(f"http://127.0.0.1:{port}", timeout=1.0)


VLLM_SOURCES = json.loads(
    (Path(__file__).parent / "data" / "vllm-0.32-kv_event_sources.json").read_text()
)
"""What a real vLLM 0.32 (DP 2, KV events with replay, topic "kv") answered at
GET /kv_event_sources."""


def test_vllm_kv_event_sources_give_each_ranks_own_endpoints() -> None:
    """vLLM's per-rank configs (already offset) become one stream per rank on the engine's host."""
    specs = streams_from_kv_event_sources(VLLM_SOURCES, engine_url="http://10.0.0.5:8000")
    assert [(s.dp_rank, s.endpoint, s.replay_endpoint, s.topic) for s in specs] == [
        (0, "tcp://10.0.0.5:56810", "tcp://10.0.0.5:40674", "kv"),
        (1, "tcp://10.0.0.5:56811", "tcp://10.0.0.5:40675", "kv"),
    ]
    assert all(s.worker == "http://10.0.0.5:8000" and s.block_size is None for s in specs)


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ({}, "lists no publishers"),
        (
            {"zero": {"publisher": "zmq", "endpoint": "tcp://*:5557"}},
            "must be a data-parallel rank",
        ),
        ({"²": {"publisher": "zmq", "endpoint": "tcp://*:5557"}}, "must be a data-parallel rank"),
        (
            {
                "0": {"publisher": "zmq", "endpoint": "tcp://*:5557"},
                "00": {"publisher": "zmq", "endpoint": "tcp://*:5600"},
            },
            "must be a data-parallel rank",
        ),
        ({"0": {"publisher": "null"}}, "publishing looks off"),
        ({"0": {"publisher": "zmq"}}, "no 'endpoint'"),
        ({"0": "tcp://*:5557"}, "expected a publisher config object"),
    ],
)
def test_bad_kv_event_sources_are_refused_naming_the_rank(sources: Any, message: str) -> None:
    """Each malformed /kv_event_sources answer is a DiscoveryError saying what is wrong where."""
    with pytest.raises(DiscoveryError, match=message):
        streams_from_kv_event_sources(sources, engine_url="http://10.0.0.5:8000")


@pytest.mark.slow
def test_discover_falls_back_to_vllms_kv_event_sources(
    http_server: tuple[str, dict[str, tuple[int, bytes]]],
) -> None:
    """An engine whose /server_info has no kv_events block (or none at all) but which answers
    /kv_event_sources, as vLLM does, is discovered from its URL alone."""
    url, routes = http_server
    routes["/kv_event_sources"] = (200, json.dumps(VLLM_SOURCES).encode())
    no_info = discover(url)  # /server_info answers 404
    routes["/server_info"] = (200, json.dumps({"vllm_config": "model=tiny"}).encode())
    no_block = discover(url)
    assert no_info == no_block
    assert [s.endpoint for s in no_block] == ["tcp://127.0.0.1:56810", "tcp://127.0.0.1:56811"]
    routes["/kv_event_sources"] = (200, b"{}")  # vLLM with KV events off
    with pytest.raises(DiscoveryError, match="publishing looks off") as caught:
        discover(url)
    assert caught.value.reached  # it answered: not unreachable


@pytest.mark.slow
@pytest.mark.parametrize("replay", [False, True], ids=["no replay endpoint", "replay endpoints"])
def test_an_engine_without_replay_endpoints_is_warned_of_once(
    http_server: tuple[str, dict[str, tuple[int, bytes]]],
    caplog: pytest.LogCaptureFixture,
    replay: bool,
) -> None:
    """Following an engine whose ranks have no replay endpoint logs one warning naming
    it and its ranks (what the subscriber misses can never be fetched again); rechecks
    of the same ranks say nothing more, and an engine with replay endpoints nothing."""
    url, routes = http_server
    extra = {"replay_endpoint_port_base": 6000} if replay else {}
    routes["/server_info"] = (200, json.dumps(info(dp_size=2, **extra)).encode())
    added: list[StreamSpec] = []
    closing = threading.Event()
    watcher = EngineWatcher(
        url,
        url,
        timeout=5.0,
        retry_initial=0.1,
        retry_max=0.1,
        closing=closing,
        add_spec=added.append,
        report=lambda signal: None,
        replace_spec=lambda spec: None,
        recheck=0.05,
    )
    caplog.set_level(logging.WARNING, logger="kvevents.subscribe.engine_watcher")
    watcher.thread.start()
    try:
        wait_for(lambda: watcher.attempts >= 1 and len(added) == 2, what="both ranks followed")
        time.sleep(0.3)  # several rechecks of the same two ranks
    finally:
        closing.set()
        watcher.thread.join(5.0)
    warned = [r.getMessage() for r in caplog.records if "replay endpoint" in r.getMessage()]
    if replay:
        assert warned == []
    else:
        assert len(warned) == 1 and url in warned[0] and "rank(s) 0, 1" in warned[0]
        assert MISSED_WITHOUT_REPLAY in warned[0]
