"""The /server_info kv_events block: one struct the engine writes and discovery reads."""

from __future__ import annotations

import json

import pytest

from kvevents import DiscoveryError, KVEventsConfig, streams_from_server_info
from kvevents.engine.server_info import BoundPublisher, build_kv_events_block, kv_events_block
from kvevents.wire import KVEventsBlock, decode_kv_events_block, encode_kv_events_block


def test_block_json_keeps_key_order_null_bases_and_omits_replay_when_off() -> None:
    """The engine's JSON lists keys in the documented order, writes null for a
    non-consecutive base, and has no replay key at all when replay is off."""
    config = KVEventsConfig(publisher="zmq", endpoint="tcp://*:0", topic="kv")
    bound = [BoundPublisher(0, "tcp://*:40001"), BoundPublisher(1, "tcp://*:39000")]
    block = kv_events_block(config, bound, dp_size=2, page_size=16)
    assert block is not None
    assert encode_kv_events_block(block) == (
        b'{"publisher":"zmq","endpoint_host":"*","endpoint_port_base":null,"topic":"kv",'
        b'"block_size":16,"dp_size":2,"ports_consecutive":false,"publishers":['
        b'{"dp_rank":0,"endpoint":"tcp://*:40001","replay_endpoint":null},'
        b'{"dp_rank":1,"endpoint":"tcp://*:39000","replay_endpoint":null}]}'
    )
    # What /server_info serves (json.dumps of the dict form) is the same document.
    as_dict = build_kv_events_block(config, bound, dp_size=2, page_size=16)
    assert json.dumps(as_dict, separators=(",", ":")).encode() == encode_kv_events_block(block)


def test_non_consecutive_replay_range_is_null_not_absent() -> None:
    """With replay on but OS-picked replay ports, the replay base is present and null."""
    config = KVEventsConfig(publisher="zmq", endpoint="tcp://*:5557", replay_endpoint="tcp://*:0")
    bound = [
        BoundPublisher(0, "tcp://*:5557", "tcp://*:41000"),
        BoundPublisher(1, "tcp://*:5558", "tcp://*:40000"),
    ]
    built = build_kv_events_block(config, bound, dp_size=2, page_size=16)
    assert built is not None
    assert "replay_endpoint_port_base" in built and built["replay_endpoint_port_base"] is None
    assert built["endpoint_port_base"] == 5557 and built["ports_consecutive"] is False


def test_engine_block_decodes_to_the_struct_it_was_built_from() -> None:
    """Decoding the engine's JSON form gives back the struct the engine built."""
    config = KVEventsConfig(
        publisher="zmq", endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600"
    )
    bound = [BoundPublisher(0, "tcp://*:5557", "tcp://*:5600")]
    block = kv_events_block(config, bound, dp_size=1, page_size=8)
    assert decode_kv_events_block(build_kv_events_block(config, bound, 1, 8)) == block


def test_upstream_sglang_block_without_publishers_decodes() -> None:
    """SGLang's block (no publishers, no ports_consecutive) decodes with those fields None."""
    block = decode_kv_events_block(
        {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": ""}
    )
    assert block == KVEventsBlock(endpoint_host="*", endpoint_port_base=5557, topic="")
    assert block.publishers is None and block.ports_consecutive is None


@pytest.mark.parametrize(
    ("block", "field"),
    [
        (
            {"publisher": "zmq", "endpoint_host": 7, "endpoint_port_base": 1},
            "kv_events.endpoint_host",
        ),
        (
            {"publishers": [{"dp_rank": "0", "endpoint": "tcp://*:1"}]},
            "kv_events.publishers[0].dp_rank",
        ),
        (
            {"publishers": [{"dp_rank": 0}]},
            "kv_events.publishers[0]: object missing required field `endpoint`",
        ),
        ({"publishers": "tcp://*:1"}, "kv_events.publishers"),
        ({"dp_size": True, "endpoint_host": "*", "endpoint_port_base": 1}, "kv_events.dp_size"),
    ],
)
def test_malformed_block_is_a_discovery_error_naming_field_and_engine(
    block: dict[str, object], field: str
) -> None:
    """A decoding error becomes a DiscoveryError naming the engine URL and the field."""
    with pytest.raises(DiscoveryError) as caught:
        streams_from_server_info({"kv_events": block}, engine_url="http://10.0.0.5:30000")
    text = str(caught.value)
    assert text.startswith("engine http://10.0.0.5:30000: ") and field in text


def test_missing_base_without_publishers_names_the_field() -> None:
    """Without a publishers list, a missing endpoint_port_base is named."""
    with pytest.raises(DiscoveryError, match="kv_events has no 'endpoint_port_base'"):
        streams_from_server_info(
            {"kv_events": {"publisher": "zmq", "endpoint_host": "*"}}, engine_url="http://h:1"
        )
