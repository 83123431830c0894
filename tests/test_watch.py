"""``kvevents watch`` as a user runs it: a subprocess against a real publisher process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvevents.transport.endpoints import free_port_range
from process_support import run_kvevents
from subscriber_support import EngineProcess

pytestmark = (
    pytest.mark.slow
)  # every test runs kvevents watch (and publishers or engines) as processes

PUBLISHER = r"""
import json, sys
from kvevents.publish.zmq_publisher import ZmqEventPublisher
from kvevents.wire.events import BlockStored, BlockRemoved, KVEventBatch

n = int(sys.argv[1])
pub = ZmqEventPublisher(3, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", bind=True, topic="kv")
for i in range(n):
    events = [BlockStored(block_hashes=[i, -i - 1], parent_block_hash=None, token_ids=list(range(4)),
                          block_size=2, lora_id=None, medium="GPU")]
    if i % 3 == 2:
        events.append(BlockRemoved(block_hashes=[i - 2]))
    pub.publish(KVEventBatch(ts=1000.0 + i, events=events))
print(json.dumps({"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}), flush=True)
sys.stdin.read()  # run until the test closes stdin
pub.shutdown()
"""


kvevents = run_kvevents


@pytest.fixture
def publisher() -> Iterator[dict[str, str]]:
    """A real ZmqEventPublisher (rank 3, topic "kv") in its own process, 25 batches already published."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, "25"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()  # the script prints once it is bound
        assert line, "the publisher process exited before binding"
        yield json.loads(line)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        finally:
            assert proc.stdout is not None
            proc.stdout.close()


def test_json_lines_carry_every_batch_in_order(publisher: dict[str, str]) -> None:
    """--json --count prints one JSON object per batch, from seq 0 (replayed), with events as plain dicts."""
    result = kvevents(
        "watch",
        "--endpoint",
        publisher["endpoint"],
        "--replay-endpoint",
        publisher["replay_endpoint"],
        "--topic",
        "kv",
        "--name",
        "pub",
        "--dp-rank",
        "3",
        "--json",
        "--count",
        "25",
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    assert [x["seq"] for x in lines] == list(range(25))
    assert {(x["worker"], x["dp_rank"]) for x in lines} == {("pub", 3)}
    assert lines[0]["ts"] == 1000.0
    assert lines[0]["events"][0]["type"] == "BlockStored"
    assert lines[0]["events"][0]["block_hashes"] == [0, -1]
    assert lines[2]["events"][1] == {
        "type": "BlockRemoved",
        "block_hashes": [0],
        "medium": None,
        "group_idx": None,
    }


def test_unreachable_endpoint_is_a_json_signal() -> None:
    """An endpoint where nothing listens prints an "unreachable" signal line and exits 0 at --duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    result = kvevents("watch", "--endpoint", address, "--jsonl", "--duration", "1.5")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    assert lines and lines[0]["signal"] == "unreachable"
    assert lines[0]["worker"] == address and lines[0]["dp_rank"] == 0


def test_table_shows_each_stream(publisher: dict[str, str]) -> None:
    """The default table names each stream with its status and last seq."""
    result = kvevents(
        "watch",
        "--endpoint",
        publisher["endpoint"],
        "--replay-endpoint",
        publisher["replay_endpoint"],
        "--topic",
        "kv",
        "--name",
        "pub-a",
        "--count",
        "25",
        "--duration",
        "20",
    )
    assert result.returncode == 0, result.stderr
    assert "pub-a" in result.stdout
    assert "connected" in result.stdout
    assert "24" in result.stdout  # last seq


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "give at least one engine URL, --engine, --engines-file or --endpoint"),
        (("--replay-endpoint", "tcp://127.0.0.1:1"), "give --engine or --endpoint first"),
        (
            ("--endpoint", "tcp://*:5557"),
            "kvevents watch: error: endpoint 'tcp://*:5557' has a wildcard host",
        ),
        (("--endpoint", "tcp://127.0.0.1:x"), "kvevents watch: error: endpoint"),
        (
            ("--endpoint", "tcp://127.0.0.1:1", "--count", "0"),
            "argument --count: 0: must be an integer >= 1",
        ),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args: tuple[str, ...], message: str) -> None:
    """Bad arguments exit with status 2 and say what is wrong."""
    result = kvevents("watch", *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_watch_engine_url_follows_every_rank() -> None:
    """`kvevents watch URL --json` discovers every rank of a real engine and prints its batches."""
    config = {"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}
    engine = EngineProcess(["--port", "0", "--dp-size", "2"], config)
    try:
        engine.generate(list(range(48)), rank=0)
        engine.generate(list(range(200, 248)), rank=1)
        result = kvevents("watch", engine.url, "--json", "--count", "2", "--duration", "30")
        assert result.returncode == 0, result.stderr
        lines = [json.loads(x) for x in result.stdout.splitlines()]
        batches = [x for x in lines if "seq" in x]
        assert sorted((x["worker"], x["dp_rank"], x["seq"]) for x in batches) == [
            (engine.url, 0, 0),
            (engine.url, 1, 0),
        ]
        stored = {x["dp_rank"]: x["events"][0] for x in batches}
        assert stored[0]["type"] == "BlockStored" and stored[0]["token_ids"] == list(range(48))
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def fixed_port_engine() -> Iterator[tuple[EngineProcess, int]]:
    """A dp-2 engine (page size 4) publishing on base + r, replaying on base + 2 + r; one batch per rank."""
    base = free_port_range(4)
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{base}",
        "replay_endpoint": f"tcp://*:{base + 2}",
    }
    engine = EngineProcess(["--port", "0", "--dp-size", "2", "--page-size", "4"], config)
    try:
        engine.generate(list(range(16)), rank=0)
        engine.generate(list(range(100, 108)), rank=1)
        yield engine, base
    finally:
        engine.stop()


def test_watch_engine_described_by_flags_follows_every_rank(
    fixed_port_engine: tuple[EngineProcess, int],
) -> None:
    """--engine URL --kv-endpoint tcp://*:BASE --dp-size 2 subscribes rank r at BASE + r on the URL's host."""
    engine, base = fixed_port_engine
    result = kvevents(
        "watch", "--engine", engine.url, "--kv-endpoint", f"tcp://*:{base}",
        "--replay-endpoint", f"tcp://*:{base + 2}", "--dp-size", "2", "--name", "sim",
        "--json", "--count", "2", "--duration", "30",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    batches = {x["dp_rank"]: x for x in lines if "seq" in x}
    assert {(x["worker"], x["seq"]) for x in batches.values()} == {("sim", 0)}
    assert batches[0]["events"][0]["token_ids"] == list(range(16))
    assert batches[1]["events"][0]["token_ids"] == list(range(100, 108))
    assert not [x for x in lines if x.get("signal") == "block_size_mismatch"]


def test_watch_reports_a_block_size_mismatch_from_an_engines_file(
    fixed_port_engine: tuple[EngineProcess, int], tmp_path: Path
) -> None:
    """An engines file configuring block size 8 for a page-4 engine prints one block_size_mismatch line per rank."""
    engine, base = fixed_port_engine
    path = tmp_path / "engines.toml"
    path.write_text(
        f'[[engines]]\nurl = "{engine.url}"\nkv_endpoint = "tcp://*:{base}"\n'
        f'replay_endpoint = "tcp://*:{base + 2}"\ndp_size = 2\nblock_size = 8\n'
    )
    result = kvevents(
        "watch", "--engines-file", str(path), "--json", "--count", "2", "--duration", "30"
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    mismatches = [x for x in lines if x.get("signal") == "block_size_mismatch"]
    assert sorted(
        (m["dp_rank"], m["expected"], m["observed"], m["source"]) for m in mismatches
    ) == [
        (0, 8, 4, "events"),
        (1, 8, 4, "events"),
    ]
    assert len([x for x in lines if "seq" in x]) == 2  # the batches are still shown
    assert f"engine {engine.url} rank 0 sends BlockStored events with block_size 4" in result.stderr


def test_watch_refuses_a_bad_engine_description() -> None:
    """A described engine with an invalid endpoint exits 2 naming the engine."""
    result = kvevents("watch", "--engine", "http://h:1", "--kv-endpoint", "tcp://h:0")
    assert result.returncode == 2
    assert (
        "kvevents watch: error: engine http://h:1: kv_endpoint tcp://h:0 has port 0"
        in result.stderr
    )


def test_malformed_frames_and_impossible_seqs_are_json_signal_lines(zmq_context: Any) -> None:
    """--json prints a "malformed" line for frames it skips (bad layout, seq 2**64-1) and no
    loss of 1.8e19 batches; the batches around them are printed as usual."""
    from kvevents.wire.codec import encode_batch
    from kvevents.wire.events import KVEventBatch
    from kvevents.wire.frames import live_frames
    from subscriber_support import bind_local, wait_subscribed

    xpub, address = bind_local(zmq_context, zmq.XPUB)
    argv = ["watch", "--endpoint", address, "--json", "--count", "2", "--duration", "30"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvevents.cli.main", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_subscribed(xpub, timeout=30)
        payload = encode_batch(KVEventBatch(ts=1.0, events=[]))
        xpub.send_multipart(live_frames(b"", 0, payload))
        xpub.send_multipart([b"", b"\x00\x01", payload])  # 2-byte seq
        xpub.send_multipart(live_frames(b"", 2**64 - 1, payload))
        xpub.send_multipart(live_frames(b"", 1, payload))
        out, err = proc.communicate(timeout=60)
    finally:
        xpub.close(linger=0)
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x.get("seq") for x in lines if "seq" in x] == [0, 1]
    bad = [x for x in lines if x.get("signal") == "malformed"]
    assert sum(x["count"] for x in bad) == 2 and bad[0]["source"] == "live"
    assert bad[0]["worker"] == address and bad[0]["dp_rank"] == 0 and bad[0]["reason"]
    assert not [x for x in lines if x.get("signal") == "loss"]
