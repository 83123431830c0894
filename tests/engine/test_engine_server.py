"""`kvevents engine` HTTP API, lifecycle and bad input, against the real subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from engine_support import Engine, RankStreams, pid_alive

from kvevents import BlockStored

pytestmark = pytest.mark.slow

KV_CONFIG = {"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine(["--dp-size", "3", "--page-size", "4", "--max-blocks", "64"], KV_CONFIG)


def test_generate_round_robin_and_routed(engine: Engine) -> None:
    """Without a rank requests go round-robin; routed_dp_rank and data_parallel_rank pick the rank."""
    ranks = [engine.generate([5, 6, 7, 8, 9])["dp_rank"] for _ in range(6)]
    assert sorted(ranks) == [0, 0, 1, 1, 2, 2]
    assert engine.generate([1, 2, 3, 4], rank=2)["dp_rank"] == 2
    assert engine.generate([1, 2, 3, 4], data_parallel_rank=1)["dp_rank"] == 1


def test_generate_text_with_byte_tokenizer(engine: Engine) -> None:
    """A text prompt is tokenized one token per UTF-8 byte; a repeat on the same rank is served from cache."""
    body = {
        "text": "héllo, kv world!",
        "routed_dp_rank": 0,
        "sampling_params": {"max_new_tokens": 3},
    }
    first = engine.http.post("/generate", json=body).json()
    second = engine.http.post("/generate", json=body).json()
    assert first["prompt_tokens"] == len("héllo, kv world!".encode())
    assert (first["completion_tokens"], len(first["text"])) == (3, 3)
    assert second["cached_tokens"] == 16 and second["meta_info"]["cached_tokens"] == 16


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"not json", "not a JSON object"),
        (json.dumps({"input_ids": [1, "x"]}).encode(), "$.input_ids[1]"),
        (json.dumps({"input_ids": [1, -3]}).encode(), "$.input_ids[1]"),
        (json.dumps({"max_new_tokens": 2}).encode(), "input_ids"),
        (json.dumps({"input_ids": []}).encode(), "empty"),
        (json.dumps({"input_ids": [1], "routed_dp_rank": 3}).encode(), "routed_dp_rank=3"),
        (json.dumps({"input_ids": [1], "max_new_tokens": -1}).encode(), "$.max_new_tokens"),
    ],
)
def test_malformed_generate_is_400_naming_the_field(
    engine: Engine, body: bytes, field: str
) -> None:
    """A malformed /generate body answers 400 with an error that names the offending field."""
    response = engine.http.post("/generate", content=body)
    assert response.status_code == 400
    assert field in response.json()["error"]


@pytest.mark.parametrize("query", ["", "?dp_rank=x", "?dp_rank=3", "?dp_rank=-1"])
def test_kv_blocks_bad_rank_is_400(engine: Engine, query: str) -> None:
    """/kv_blocks without a valid dp_rank answers 400 naming dp_rank and the valid range."""
    response = engine.http.get("/kv_blocks" + query)
    assert response.status_code == 400
    assert "dp_rank" in response.json()["error"] and "0..2" in response.json()["error"]


def test_load_and_health_report_every_rank(engine: Engine) -> None:
    """/load and /health list every rank with its figures and state."""
    load = engine.http.get("/load").json()
    assert load["dp_size"] == 3
    for r, figures in enumerate(load["ranks"]):
        assert figures["dp_rank"] == r and figures["available"]
        assert figures["blocks_total"] == 64
        assert {"running", "waiting", "blocks_used", "hit_rate"} <= set(figures)
    health = engine.http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert [r["state"] for r in health.json()["ranks"]] == ["running"] * 3


def test_load_counts_a_request_until_its_answer_leaves() -> None:
    """A request is in /load's running count for as long as its step takes, even when the
    step finishes it: a 1-token request of 300 tokens prefilled at 100 tokens/s is counted
    while its answer is still 3 s away, and not once the answer has come."""
    eng = Engine(["--prefill-tokens-per-s", "100"], None)
    answered: dict[str, Any] = {}

    def generate() -> None:
        body = {"input_ids": list(range(1, 301)), "max_new_tokens": 1}
        answered["response"] = eng.http.post("/generate", json=body, timeout=30.0)

    thread = threading.Thread(target=generate, daemon=True)
    try:
        thread.start()
        seen = 0
        deadline = time.monotonic() + 2.0  # well inside the step's 3 s
        while seen < 1 and time.monotonic() < deadline:
            seen = eng.http.get("/load").json()["ranks"][0]["running"]
            time.sleep(0.05)
        assert seen == 1 and "response" not in answered
        thread.join(timeout=30.0)
        assert answered["response"].status_code == 200
        assert eng.http.get("/load").json()["ranks"][0]["running"] == 0
    finally:
        eng.stop()


def test_flush_one_rank(engine: Engine) -> None:
    """POST /flush_cache?dp_rank=r empties only rank r."""
    engine.generate(list(range(40, 48)), rank=0)
    engine.generate(list(range(40, 48)), rank=1)
    assert engine.http.post("/flush_cache", params={"dp_rank": 1}).json() == {"flushed": [1]}
    assert engine.kv_blocks(1) == set()
    assert engine.kv_blocks(0)


def test_server_info_shows_the_kv_events_config_the_ranks_publish_with(engine: Engine) -> None:
    """Given no snapshot keys, the ranks serve snapshots bounded by twice their cache, and
    /server_info's kv_events_config string says so, as its kv_events block does."""
    info = engine.server_info()
    config = json.loads(info["kv_events_config"])
    assert (config["snapshot"], config["snapshot_max_blocks"]) == (True, 2 * 64), config
    assert info["kv_events"]["snapshot"] is True


def test_restart_rank_keeps_ports_and_restarts_at_seq_zero(engine: Engine) -> None:
    """/admin/restart_rank restarts one rank on the same ports; its new stream starts at seq 0 with an empty cache."""
    before = engine.server_info()["kv_events"]["publishers"]
    old_pid = engine.rank_pids()[2]
    engine.generate(list(range(100, 108)), rank=2)
    response = engine.http.post("/admin/restart_rank", params={"dp_rank": 2})
    assert response.status_code == 200, response.text
    assert response.json()["restarts"] == 1 and response.json()["pid"] != old_pid
    assert not pid_alive(old_pid)
    assert engine.server_info()["kv_events"]["publishers"] == before
    assert engine.kv_blocks(2) == set()
    engine.generate([7, 7, 7, 7], rank=2)
    ctx = zmq.Context()
    streams = RankStreams(ctx, engine.server_info()["kv_events"], engine.url)
    try:
        streams.fill_by_replay(2)
        assert sorted(streams.batches[2]) == [0]
        (stored,) = streams.batches[2][0].events
        assert isinstance(stored, BlockStored) and stored.token_ids == [7, 7, 7, 7]
    finally:
        streams.close()
        ctx.destroy(linger=0)


def test_sigint_stops_every_rank() -> None:
    """Ctrl-C (SIGINT) stops the engine with exit code 0 and leaves no rank process behind."""
    eng = Engine(["--dp-size", "2"], KV_CONFIG)
    pids = eng.rank_pids()
    assert all(pid_alive(p) for p in pids)
    eng.stop(signal.SIGINT, expect=0)
    assert not any(pid_alive(p) for p in pids)


def test_dead_rank_shows_in_health_then_engine_exits_nonzero() -> None:
    """A rank process killed from outside shows as dead in /health (503), then the engine exits 1."""
    eng = Engine(["--dp-size", "2", "--dead-rank-grace", "10"], KV_CONFIG)
    try:
        victim = eng.rank_pids()[1]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        health = eng.http.get("/health")
        while health.status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)  # the engine's watchdog looks every 0.1 s
            health = eng.http.get("/health")
        assert health.status_code == 503
        assert health.json()["dead_ranks"] == [1]
        assert health.json()["ranks"][1]["exit_code"] == -9
    finally:
        code = eng.stop(signal.SIGTERM, expect=None)
    assert code == 1
    assert "dp_rank 1" in eng.stderr


def test_null_publisher_has_no_kv_events_block() -> None:
    """With publishing off, /server_info has dp_size and page_size but no kv_events block."""
    eng = Engine(["--dp-size", "2", "--page-size", "8"], {"publisher": "null"})
    try:
        info = eng.server_info()
        assert (info["dp_size"], info["page_size"]) == (2, 8)
        assert "kv_events" not in info
        assert eng.generate([1, 2, 3, 4, 5, 6, 7, 8])["prompt_tokens"] == 8
    finally:
        eng.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [
                "--dp-size",
                "4",
                "--kv-events-config",
                json.dumps(
                    {
                        "publisher": "zmq",
                        "endpoint": "tcp://*:6000",
                        "replay_endpoint": "tcp://*:6002",
                    }
                ),
            ],
            # bound as --kv-events-host (loopback by default) in place of the wildcard
            "127.0.0.1:6000-6003 and replay endpoints 127.0.0.1:6002-6005 overlap",
        ),
        (
            [
                "--dp-size",
                "4",
                "--kv-events-config",
                json.dumps({"publisher": "zmq", "endpoint": "tcp://*:65534"}),
            ],
            "65534-65537, above 65535",
        ),
        (["--dp-size", "3", "--enable-dp-attention", "--tp-size", "4"], "--tp-size 4"),
        (["--kv-events-config", '{"publisher": "zmq", "endpont": "tcp://*:1"}'], "'endpont'"),
    ],
)
def test_bad_plans_refuse_to_start(args: list[str], message: str) -> None:
    """An overlapping or overflowing port plan, or a bad topology or config, exits 2 naming the problem before any rank starts."""
    result = subprocess.run(
        [sys.executable, "-m", "kvevents.cli.main", "engine", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert "ready" not in result.stdout


def test_vllm_hash_scheme_end_to_end() -> None:
    """With --hash-scheme vllm the engine holds and reports vLLM's sha256_cbor hashes for the seed given."""
    from kvevents.wire.hashing import vllm_block_hashes

    eng = Engine(
        ["--dp-size", "1", "--page-size", "4", "--hash-scheme", "vllm", "--hash-seed", "5"],
        KV_CONFIG,
    )
    try:
        tokens = list(range(1, 14))
        eng.generate(tokens, rank=0)
        assert eng.kv_blocks(0) == set(vllm_block_hashes(tokens, 4, seed="5"))
        assert eng.server_info()["hash_scheme"] == "vllm"
    finally:
        eng.stop()
