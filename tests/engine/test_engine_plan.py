"""Pure engine pieces: the /server_info block, the scheduler topology, the trace helper, the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvevents import ConfigError, KVEventsConfig, streams_from_server_info
from kvevents.engine.server_info import BoundPublisher, build_kv_events_block
from kvevents.engine.topology import plan_topology
from kvevents.text.tokenizer import ByteTokenizer
from kvevents.traces import (
    TraceRequest,
    bundled_trace_path,
    hash_id_tokens,
    load_trace,
    request_tokens,
)

ZMQ = KVEventsConfig(publisher="zmq", endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600")


def pubs(live: list[int], replay: list[int] | None = None) -> list[BoundPublisher]:
    return [
        BoundPublisher(
            r, f"tcp://0.0.0.0:{p}", None if replay is None else f"tcp://0.0.0.0:{replay[r]}"
        )
        for r, p in enumerate(live)
    ]


def test_block_for_consecutive_ports() -> None:
    """Consecutive bound ports give the docs/architecture.md §4 block with both port bases and an exact publishers list."""
    block = build_kv_events_block(ZMQ, pubs([5557, 5558], [5600, 5601]), dp_size=2, page_size=16)
    assert block == {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "replay_endpoint_port_base": 5600,
        "topic": "",
        "block_size": 16,
        "dp_size": 2,
        "ports_consecutive": True,
        "publishers": [
            {"dp_rank": 0, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"},
            {"dp_rank": 1, "endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:5601"},
        ],
    }


def test_block_for_os_picked_ports_does_not_mislead() -> None:
    """Non-consecutive (OS-picked) ports null the misleading base, say ports_consecutive=false, and list every real port."""
    config = KVEventsConfig(publisher="zmq", endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    block = build_kv_events_block(config, pubs([40001, 39000], [41000, 41001]), 2, 16)
    assert block is not None
    assert block["endpoint_port_base"] is None
    assert block["replay_endpoint_port_base"] == 41000
    assert block["ports_consecutive"] is False
    assert [p["endpoint"] for p in block["publishers"]] == ["tcp://*:40001", "tcp://*:39000"]
    specs = streams_from_server_info(
        {"dp_size": 2, "kv_events": block}, engine_url="http://10.0.0.5:30000"
    )
    assert [s.endpoint for s in specs] == ["tcp://10.0.0.5:40001", "tcp://10.0.0.5:39000"]


def test_block_absent_when_off_or_not_tcp() -> None:
    """No block when publishing is off or the endpoint is ipc/inproc."""
    assert build_kv_events_block(KVEventsConfig(), [], 1, 16) is None
    assert build_kv_events_block(KVEventsConfig(publisher="null"), [], 1, 16) is None
    ipc = KVEventsConfig(publisher="zmq", endpoint="ipc:///tmp/kv")
    assert build_kv_events_block(ipc, [BoundPublisher(0, "ipc:///tmp/kv")], 1, 16) is None
    off = KVEventsConfig(publisher="zmq", enable_kv_cache_events=False)
    assert build_kv_events_block(off, [], 1, 16) is None


def test_block_refuses_missing_ranks() -> None:
    """Bound publishers that do not cover 0..dp_size-1 are a ValueError naming the ranks."""
    with pytest.raises(ValueError, match=r"ranks \[0\], expected 0..1"):
        build_kv_events_block(ZMQ, pubs([5557], [5600]), 2, 16)


@pytest.mark.parametrize(
    ("dp", "tp", "dpa", "expected"),
    [
        (4, None, False, [(0, 0), (0, 1), (0, 2), (0, 3)]),  # pure DP: rank = dp_rank
        (4, None, True, [(0, 0), (1, 1), (2, 2), (3, 3)]),  # DP attention: rank = attn_dp_rank
        (2, 4, True, [(0, 0), (2, 1)]),  # attention TP 2: tp ranks 0 and 2 publish
        (2, 2, False, [(0, 0), (0, 1)]),  # tp 2 per replica: tp rank 0 of each publishes
    ],
)
def test_topology_publishers(
    dp: int, tp: int | None, dpa: bool, expected: list[tuple[int, int]]
) -> None:
    """Exactly dp_size schedulers publish, attention-TP rank 0 of each cache, ranks 0..dp_size-1."""
    topo = plan_topology(dp, tp, dpa)
    assert [(s.tp_rank, s.publisher_rank) for s in topo.publishers] == expected
    gpus = (tp or dp) if dpa else dp * (tp or 1)
    assert len(topo.schedulers) == gpus


def test_topology_refuses_bad_sizes() -> None:
    """A tp size that does not split into dp attention groups is refused naming both flags."""
    with pytest.raises(ConfigError, match=r"--tp-size 3 .* --dp-size 2"):
        plan_topology(2, 3, True)
    with pytest.raises(ConfigError, match="--dp-size 0"):
        plan_topology(0, None, False)


def test_trace_requests_share_token_prefixes_by_hash_id() -> None:
    """Requests sharing leading hash ids share exactly those 512-token runs; the last block is cut to input_length."""
    a = TraceRequest(0, 1100, 1, [7, 8, 9])
    b = TraceRequest(0, 700, 1, [7, 8])
    c = TraceRequest(0, 600, 1, [7, 10])
    ta, tb, tc = request_tokens(a), request_tokens(b), request_tokens(c)
    assert (len(ta), len(tb), len(tc)) == (1100, 700, 600)
    assert ta[:700] == tb
    assert ta[:512] == tc[:512] and ta[512:600] != tc[512:600]
    assert hash_id_tokens(7) == request_tokens(a)[:512]
    assert hash_id_tokens(7, seed=1) != hash_id_tokens(7)
    assert max(ta) < 65536


def test_trace_request_too_long_is_refused() -> None:
    """An input_length beyond its hash ids' 512-token runs is a ValueError naming both."""
    with pytest.raises(ValueError, match="input_length=1025 but 2 hash ids"):
        request_tokens(TraceRequest(0, 1025, 1, [1, 2]))


def test_bundled_trace_loads(tmp_path: Path) -> None:
    """The bundled conversation trace ships with the package and parses; a bad line names file and line."""
    assert bundled_trace_path().exists()
    first = load_trace(limit=2)
    assert len(first) == 2 and first[0].hash_ids[0] == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]})
        + "\n{}\n"
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_trace(bad)


def test_byte_tokenizer_round_trip() -> None:
    """The byte tokenizer maps text to its UTF-8 bytes and back."""
    tok = ByteTokenizer()
    assert tok.encode("aé") == [97, 0xC3, 0xA9]
    assert tok.decode(tok.encode("kv ünïcode")) == "kv ünïcode"
