"""KVEventsConfig: the --kv-events-config JSON, validated with named errors."""

from __future__ import annotations

import pytest

from kvevents import ConfigError, KVEventsConfig


@pytest.mark.parametrize("text", [None, "", "{}", '{"publisher": "null"}'])
def test_empty_and_null_configs_are_valid_and_off(text: str | None) -> None:
    """{} and {"publisher": "null"} parse, and publishing is off."""
    assert KVEventsConfig.from_json(text).enabled is False


def test_sglang_and_vllm_spellings() -> None:
    """SGLang's keys and vLLM's enable_kv_cache_events are both accepted."""
    sglang = KVEventsConfig.from_json(
        '{"publisher": "zmq", "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6100",'
        ' "buffer_steps": 5, "hwm": 10, "max_queue_size": 7, "topic": "kv", "bind": true}'
    )
    assert sglang.enabled and sglang.endpoint == "tcp://*:6000" and sglang.bind is True
    assert (sglang.buffer_steps, sglang.hwm, sglang.max_queue_size, sglang.topic) == (
        5,
        10,
        7,
        "kv",
    )
    vllm = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq"}')
    assert vllm.enabled
    off = KVEventsConfig.from_json('{"enable_kv_cache_events": false, "publisher": "zmq"}')
    assert not off.enabled


def test_defaults() -> None:
    """Defaults are SGLang's: tcp://*:5557, 10,000 buffered steps, 100,000 hwm and queue."""
    cfg = KVEventsConfig()
    assert (cfg.endpoint, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size) == (
        "tcp://*:5557",
        10_000,
        100_000,
        100_000,
    )
    assert KVEventsConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            '{"hwmm": 3}',
            r"unknown key 'hwmm' \(did you mean 'hwm'\?\); accepted keys: publisher, endpoint",
        ),
        ('{"hwm": "3"}', r"key 'hwm': Expected `int`, got `str`"),
        ('{"bind": "yes"}', r"key 'bind'"),
        (
            '{"endpoint": "udp://x:1"}',
            r"key 'endpoint': endpoint 'udp://x:1' has an unknown scheme",
        ),
        ('{"replay_endpoint": "tcp://*"}', r"key 'replay_endpoint'.*has no port"),
        ('{"buffer_steps": 0}', r"'buffer_steps' is 0; it must be >= 1"),
        ('{"publisher": ""}', r"'publisher' is empty"),
        ("[1, 2]", r"must be a JSON object, got list"),
        ("{publisher: zmq}", r"is not valid JSON"),
    ],
)
def test_bad_config_names_the_key(text: str, match: str) -> None:
    """Unknown keys, wrong types and invalid values are refused naming the key and the fix."""
    with pytest.raises(ConfigError, match=match):
        KVEventsConfig.from_json(text)


def test_direct_construction_validates() -> None:
    """Keyword construction runs the same checks as parsing."""
    with pytest.raises(ConfigError, match="hwm"):
        KVEventsConfig(hwm=-1)
