"""Engines described by hand: EngineSpec, engines files and the --engine command-line options."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from kvevents import ConfigError, EngineSpec, StreamSpec, load_engines_file
from kvevents.cli.engine_args import add_engine_arguments, endpoint_specs, engine_specs
from kvevents.subscribe.engine_spec import parse_engines_document
from kvevents.subscribe.stream_spec import MISSED_WITHOUT_REPLAY


def test_tcp_endpoints_are_offset_per_rank_and_wildcards_take_the_url_host() -> None:
    """Rank r connects to base + r (live and replay), a wildcard host becoming the engine URL's host."""
    spec = EngineSpec.create(
        "10.0.0.5:8000",
        kv_endpoint="tcp://*:5557",
        replay_endpoint="tcp://0.0.0.0:5600",
        dp_size=3,
        topic="kv",
        block_size=32,
    )
    assert spec.url == "http://10.0.0.5:8000" and spec.worker == spec.url
    assert spec.streams() == [
        StreamSpec(
            worker="http://10.0.0.5:8000",
            dp_rank=r,
            endpoint=f"tcp://10.0.0.5:{5557 + r}",
            replay_endpoint=f"tcp://10.0.0.5:{5600 + r}",
            topic="kv",
            block_size=32,
        )
        for r in range(3)
    ]


def test_explicit_hosts_and_ipc_paths_are_kept() -> None:
    """A named host stays as given; an ipc endpoint gets the per-rank _dp{r} suffix from rank 1."""
    tcp = EngineSpec.create("http://a:1", kv_endpoint="tcp://b:7000", dp_size=2, name="eng")
    assert [s.endpoint for s in tcp.streams()] == ["tcp://b:7000", "tcp://b:7001"]
    assert {s.worker for s in tcp.streams()} == {"eng"}
    ipc = EngineSpec.create("http://a:1", kv_endpoint="ipc:///tmp/kv", dp_size=3)
    assert [s.endpoint for s in ipc.streams()] == [
        "ipc:///tmp/kv",
        "ipc:///tmp/kv_dp1",
        "ipc:///tmp/kv_dp2",
    ]


def test_kind_defaults_to_vllm_when_described_and_kvevents_when_discovered() -> None:
    """A described engine is sent ranks the vLLM way unless told otherwise; a discovered one the SGLang way."""
    assert EngineSpec.create("h:1", kv_endpoint="tcp://h:2").engine_kind == "vllm"
    assert EngineSpec.create("h:1").engine_kind == "kvevents"
    assert EngineSpec.create("h:1", kind="sglang").engine_kind == "sglang"
    assert EngineSpec.create("h:1").streams() == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_endpoint": "tcp://h:0"}, "has port 0"),
        ({"kv_endpoint": "tcp://h:65535", "dp_size": 2}, "above 65535"),
        (
            {"kv_endpoint": "tcp://h:5557", "replay_endpoint": "tcp://h:5558", "dp_size": 2},
            "overlap",
        ),
        ({"kv_endpoint": "udp://h:1"}, "unknown scheme"),
        ({"replay_endpoint": "tcp://h:5600"}, "without kv_endpoint"),
        ({"dp_size": 2}, "without kv_endpoint"),
        ({"kv_endpoint": "tcp://h:1", "dp_size": 0}, "dp_size=0 must be a positive"),
        ({"block_size": -4}, "block_size=-4"),
        ({"kind": "trtllm"}, "kind 'trtllm' is not one of vllm, sglang, kvevents"),
        ({"dp_size": "2", "kv_endpoint": "tcp://h:1"}, "Expected `int | null`"),
        ({"port": 1}, "unknown field(s) port"),
    ],
)
def test_bad_specs_are_refused_naming_the_engine(fields: dict, message: str) -> None:
    """Each invalid description raises ConfigError naming the engine and what is wrong."""
    with pytest.raises(ConfigError) as info:
        EngineSpec.create("http://h:8000", **fields)
    assert message in str(info.value)
    assert "http://h:8000" in str(info.value)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://user:s3cret@h:8000", "credentials in the URL are not sent"),
        ("http://user:s3cret@s3cret@h:8000", "credentials in the URL are not sent"),
        ("http://h:8000/v1?x=1", "a query string or #fragment"),
        ("http://h:8000#part", "a query string or #fragment"),
    ],
)
def test_engine_urls_with_parts_never_used_are_refused(url: str, message: str) -> None:
    """Credentials, a query string or a fragment in an engine's URL would be dropped
    silently from every request: refused, saying what to write, without the secret."""
    with pytest.raises(ConfigError) as info:
        EngineSpec.create(url)
    assert message in str(info.value)
    assert "s3cret" not in str(info.value)
    with pytest.raises(ConfigError) as info:  # refused before any other error names it
        EngineSpec.create(url, port=1)
    assert "s3cret" not in str(info.value)


def test_json_and_toml_files_list_engines(tmp_path: Path) -> None:
    """A JSON file and the same engines as TOML give the same specs, in file order."""
    engines = [
        {
            "url": "http://127.0.0.1:8000",
            "kv_endpoint": "tcp://*:5557",
            "dp_size": 2,
            "topic": "kv",
        },
        {"url": "http://127.0.0.1:30000", "block_size": 16, "kind": "sglang", "name": "sg"},
    ]
    as_json = tmp_path / "engines.json"
    as_json.write_text(json.dumps({"engines": engines}))
    as_toml = tmp_path / "engines.toml"
    as_toml.write_text(
        "[[engines]]\n"
        'url = "http://127.0.0.1:8000"\nkv_endpoint = "tcp://*:5557"\ndp_size = 2\ntopic = "kv"\n'
        "[[engines]]\n"
        'url = "http://127.0.0.1:30000"\nblock_size = 16\nkind = "sglang"\nname = "sg"\n'
    )
    from_json = load_engines_file(as_json)
    assert from_json == load_engines_file(as_toml)
    assert [s.to_dict() for s in from_json] == engines
    bare_list = tmp_path / "list.json"
    bare_list.write_text(json.dumps(engines))
    assert load_engines_file(bare_list) == from_json


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not valid JSON"),
        ('{"engines": []}', "non-empty list of engines"),
        ('{"engine": [{"url": "h:1"}]}', "unknown top-level key(s) engine"),
        ('{"engines": [{"kv_endpoint": "tcp://h:1"}]}', "engines[0] has no 'url'"),
        ('{"engines": [{"url": "h:1"}, {"url": "h:2", "dp": 2}]}', "engines[1]: engine h:2"),
    ],
)
def test_bad_files_name_the_file_and_the_entry(tmp_path: Path, text: str, message: str) -> None:
    """A malformed engines file is a ConfigError naming the file and, for an entry, its index."""
    path = tmp_path / "engines.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_engines_file(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_missing_file_and_bad_toml_are_config_errors(tmp_path: Path) -> None:
    """An unreadable file or invalid TOML raises ConfigError saying which file."""
    with pytest.raises(ConfigError, match="cannot be read"):
        load_engines_file(tmp_path / "absent.json")
    bad = tmp_path / "e.toml"
    bad.write_text("[[engines]\nurl=1")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_engines_file(bad)
    with pytest.raises(ConfigError, match="expected an object"):
        parse_engines_document({"engines": ["http://h:1"]}, "doc")


def _parser(**kwargs: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t", exit_on_error=False)
    parser.add_argument("urls", nargs="*")
    add_engine_arguments(parser, **kwargs)
    return parser


def test_options_after_an_engine_describe_that_engine() -> None:
    """Each --engine takes the options that follow it, so several engines can be given."""
    args = _parser().parse_args(
        [
            "--engine", "http://a:8000", "--kv-endpoint", "tcp://*:5557", "--dp-size", "2",
            "--topic", "kv", "--block-size", "32",
            "--engine", "http://b:30000", "--engine-kind", "sglang", "--name", "b",
        ]
    )  # fmt: skip
    specs = engine_specs(args, ["http://c:1"])
    assert [s.to_dict() for s in specs] == [
        {"url": "http://a:8000", "kv_endpoint": "tcp://*:5557", "dp_size": 2, "topic": "kv", "block_size": 32},
        {"url": "http://b:30000", "kind": "sglang", "name": "b"},
        {"url": "http://c:1"},
    ]  # fmt: skip


def test_router_block_size_before_any_engine_is_global() -> None:
    """With global_block_size, --block-size before the first --engine is the command's own."""
    args = _parser(global_block_size=True).parse_args(
        ["--block-size", "16", "--engine", "http://a:1", "--block-size", "32"]
    )
    assert args.global_block_size == 16
    assert engine_specs(args)[0].block_size == 32


def test_endpoint_streams_take_their_own_options() -> None:
    """With endpoints, --endpoint opens an explicit stream that --name/--dp-rank/--topic amend."""
    args = _parser(endpoints=True).parse_args(
        ["--endpoint", "tcp://h:1", "--name", "s", "--dp-rank", "2", "--topic", "t"]
    )
    assert endpoint_specs(args) == [
        StreamSpec(worker="s", dp_rank=2, endpoint="tcp://h:1", topic="t")
    ]
    assert engine_specs(args) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-endpoint", "tcp://h:1"], "--kv-endpoint belongs to an --engine: give --engine first"),
        (["--engine", "a:1", "--dp-size", "2", "--dp-size", "3"], "--dp-size given twice for --engine a:1"),
        (["--endpoint", "tcp://h:1", "--kv-endpoint", "tcp://h:2"], "does not apply to --endpoint"),
        (["--engine", "a:1", "--dp-rank", "1"], "--dp-rank does not apply to --engine a:1"),
    ],
)  # fmt: skip
def test_misplaced_options_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An option without its opener, or given twice, exits 2 with a message saying where it belongs."""
    with pytest.raises(SystemExit) as info:
        _parser(endpoints=True).parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_same_engine_twice_is_refused() -> None:
    """Giving one engine twice (as --engine and as a URL) is a ConfigError."""
    args = _parser().parse_args(["--engine", "http://a:1"])
    with pytest.raises(ConfigError, match="given twice"):
        engine_specs(args, ["a:1"])


def test_model_names_the_models_an_engine_serves() -> None:
    """--model after an --engine (a comma list), or model in a file (a list), names its models."""
    args = _parser().parse_args(["--engine", "http://a:8000", "--model", "llama, llama-8b"])
    [spec] = engine_specs(args)
    assert spec.models == ("llama", "llama-8b")
    [listed] = parse_engines_document(
        {"engines": [{"url": "http://b:1", "model": ["qwen", "qwen"]}]}, "file"
    )
    assert listed.models == ("qwen",)
    assert EngineSpec.create("http://c:1").models == ()
    with pytest.raises(ConfigError, match="names no model"):
        EngineSpec.create("http://c:1", model=" , ")


@pytest.mark.parametrize("replay", [False, True], ids=["no replay endpoint", "replay endpoint"])
def test_described_streams_without_a_replay_endpoint_are_warned_of(
    caplog: pytest.LogCaptureFixture, replay: bool
) -> None:
    """Following a described engine whose streams have no replay endpoint logs one
    warning that names the engine and the option to give; with one, nothing."""
    spec = EngineSpec.create(
        "127.0.0.1:8000",
        kv_endpoint="tcp://*:5557",
        replay_endpoint="tcp://*:5600" if replay else None,
        dp_size=2,
    )

    class Following:
        def __init__(self) -> None:
            self.streams: list[StreamSpec] = []

        def add_stream(self, stream: StreamSpec) -> None:
            self.streams.append(stream)

    following = Following()
    caplog.set_level(logging.WARNING, logger="kvevents.subscribe.engine_spec")
    spec.follow(following)  # type: ignore[arg-type]
    assert following.streams == spec.streams() and len(following.streams) == 2
    warned = [r.getMessage() for r in caplog.records if "replay endpoint" in r.getMessage()]
    if replay:
        assert warned == []
    else:
        assert len(warned) == 1
        assert "http://127.0.0.1:8000" in warned[0] and "--replay-endpoint" in warned[0]
        assert MISSED_WITHOUT_REPLAY in warned[0]
