"""Four publishers in four processes, as four schedulers of one engine: pure DP and DP-attention.

Each child process plays one scheduler: it chooses its publisher rank from its
(attn_dp_size, attn_dp_rank, dp_rank), binds base + rank, announces itself, publishes
probes until told to go, then publishes its batches and waits to be stopped. The test
process is the consumer: one SUB connected to every rank's port.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvevents import decode_batch
from kvevents.transport.endpoints import PortPlan, free_port_range
from kvevents.wire.frames import parse_live_frames, parse_replay_reply, replay_request_frames

DP_SIZE = 4
COUNT = 25
TIMEOUT_S = 20.0

CHILD = r"""
import json, select, sys
from kvevents.transport.endpoints import select_kv_publisher_dp_rank
from kvevents.errors import EndpointError
from kvevents.publish.zmq_publisher import ZmqEventPublisher
from kvevents.wire.events import BlockStored, KVEventBatch

args = json.loads(sys.argv[1])
if args["rank_by"] == "select":
    rank = select_kv_publisher_dp_rank(args["attn_dp_size"], args["attn_dp_rank"], args["dp_rank"])
else:  # the original bug: the attention-DP rank alone, 0 for every scheduler under pure DP
    rank = args["attn_dp_rank"]
try:
    pub = ZmqEventPublisher(rank, args["endpoint"], args["replay_endpoint"], bind=True, topic="kv")
except EndpointError as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
    sys.exit(2)
print(json.dumps({"ready": rank, "endpoint": pub.endpoint}), flush=True)

def command(wait_s):
    if select.select([sys.stdin], [], [], wait_s)[0]:
        return sys.stdin.readline().strip()
    return None

while command(0.02) != "go":  # probes let the consumer see its subscription is live
    pub.publish(KVEventBatch(ts=0.0, events=[]))
for i in range(args["count"]):
    event = BlockStored(block_hashes=[rank * 1000 + i], parent_block_hash=None,
                        token_ids=[i] * 4, block_size=4, lora_id=None, medium=None)
    pub.publish(KVEventBatch(ts=float(i), events=[event]))
pub.flush(timeout=10.0)
print(json.dumps({"done": pub.stats.published}), flush=True)
while command(1.0) != "stop":
    pass
pub.shutdown()
"""


def read_json_line(proc: subprocess.Popen[str], timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """The child's next stdout line as JSON, waiting at most ``timeout_s``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        raise AssertionError(f"child {proc.pid} said nothing within {timeout_s} s")
    line = proc.stdout.readline()
    if not line:
        assert proc.stderr is not None
        raise AssertionError(f"child {proc.pid} exited: {proc.stderr.read()}")
    result: dict[str, Any] = json.loads(line)
    return result


def tell(proc: subprocess.Popen[str], command: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start scheduler children; any still running after the test is stopped by its pid."""
    children: list[subprocess.Popen[str]] = []

    def start(
        bases: tuple[str, str],
        *,
        attn_dp_size: int,
        attn_dp_rank: int,
        dp_rank: int | None,
        rank_by: str = "select",
    ) -> subprocess.Popen[str]:
        args = {
            "endpoint": bases[0],
            "replay_endpoint": bases[1],
            "attn_dp_size": attn_dp_size,
            "attn_dp_rank": attn_dp_rank,
            "dp_rank": dp_rank,
            "rank_by": rank_by,
            "count": COUNT,
        }
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        children.append(proc)
        return proc

    yield start
    for proc in children:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=TIMEOUT_S)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def deployment_bases(kind: str, tmp_path: Path) -> tuple[str, str]:
    """Live and replay bases for DP_SIZE ranks: consecutive free tcp ports, or ipc paths."""
    if kind == "ipc":
        return f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    base = free_port_range(2 * DP_SIZE)
    return f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + DP_SIZE}"


def run_deployment(
    spawn: Callable[..., subprocess.Popen[str]],
    zmq_context: zmq.Context[Any],
    ranks_of: Callable[[int], dict[str, Any]],
    bases: tuple[str, str],
) -> None:
    """Start DP_SIZE schedulers, consume every rank from one SUB, check streams and replay."""
    plan = PortPlan.build(DP_SIZE, *bases)
    children = [spawn(bases, **ranks_of(i)) for i in range(DP_SIZE)]
    announced = {read_json_line(child)["ready"]: child for child in children}
    assert sorted(announced) == list(range(DP_SIZE)), "each scheduler must get its own rank"

    sub = zmq_context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    for rank_endpoints in plan:
        sub.connect(str(rank_endpoints.endpoint))
    try:
        # Wait until a probe from every rank has arrived: every subscription is live.
        heard: set[int] = set()
        deadline = time.monotonic() + TIMEOUT_S
        while heard != set(range(DP_SIZE)):
            assert time.monotonic() < deadline, f"probes heard only from ranks {sorted(heard)}"
            if sub.poll(100):
                rank = decode_batch(
                    parse_live_frames(sub.recv_multipart()).payload
                ).data_parallel_rank
                assert rank is not None
                heard.add(rank)
        for child in children:
            tell(child, "go")
        real: dict[int, list[tuple[int, int, int]]] = {r: [] for r in range(DP_SIZE)}
        while sum(len(v) for v in real.values()) < DP_SIZE * COUNT:
            assert sub.poll(int(TIMEOUT_S * 1000)), f"stalled with {real}"
            msg = parse_live_frames(sub.recv_multipart())
            got = decode_batch(msg.payload)
            if got.events:
                block_hash = got.events[0].block_hashes[0]  # type: ignore[union-attr]
                assert isinstance(block_hash, int) and got.data_parallel_rank is not None
                real[got.data_parallel_rank].append(
                    (msg.seq, block_hash // 1000, block_hash % 1000)
                )
        for rank, batches in real.items():
            # Every batch on rank r's stream says rank r, in order, with no seq skipped.
            assert [origin for _, origin, _ in batches] == [rank] * COUNT
            assert [i for _, _, i in batches] == list(range(COUNT))
            seqs = [seq for seq, _, _ in batches]
            assert seqs == list(range(seqs[0], seqs[0] + COUNT))
        for child in children:
            assert read_json_line(child)["done"] >= COUNT
        # Each rank's replay endpoint serves that rank's stream.
        for rank_endpoints in plan:
            dealer = zmq_context.socket(zmq.DEALER)
            dealer.connect(str(rank_endpoints.replay_endpoint))
            try:
                dealer.send_multipart(replay_request_frames(0))
                ranks_seen = set()
                while True:
                    assert dealer.poll(int(TIMEOUT_S * 1000))
                    reply = parse_replay_reply(dealer.recv_multipart())
                    if reply.is_end:
                        break
                    ranks_seen.add(decode_batch(reply.payload).data_parallel_rank)
                assert ranks_seen == {rank_endpoints.rank}
            finally:
                dealer.close(linger=0)
    finally:
        sub.close(linger=0)
    for child in children:
        tell(child, "stop")
        assert child.wait(timeout=TIMEOUT_S) == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_pure_dp_four_processes_four_streams(
    kind: str,
    tmp_path: Path,
    spawn: Callable[..., subprocess.Popen[str]],
    zmq_context: zmq.Context[Any],
) -> None:
    """Under pure DP, four schedulers choosing ranks with select_kv_publisher_dp_rank(1, 0, r) give four complete streams."""
    run_deployment(
        spawn,
        zmq_context,
        lambda r: {"attn_dp_size": 1, "attn_dp_rank": 0, "dp_rank": r},
        deployment_bases(kind, tmp_path),
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_dp_attention_four_processes_four_streams(
    kind: str,
    tmp_path: Path,
    spawn: Callable[..., subprocess.Popen[str]],
    zmq_context: zmq.Context[Any],
) -> None:
    """Under DP-attention (attn_dp_size=4), four schedulers ranked by attn_dp_rank give four complete streams."""
    run_deployment(
        spawn,
        zmq_context,
        lambda r: {"attn_dp_size": DP_SIZE, "attn_dp_rank": r, "dp_rank": None},
        deployment_bases(kind, tmp_path),
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_rank_by_attn_dp_rank_alone_fails_under_pure_dp(
    kind: str, tmp_path: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    """The original bug: ranking by attn_dp_rank alone under pure DP makes ranks 1..3 fail at start, naming the port."""
    bases = deployment_bases(kind, tmp_path)
    first = spawn(bases, attn_dp_size=1, attn_dp_rank=0, dp_rank=0, rank_by="attn_dp_rank")
    assert read_json_line(first)["ready"] == 0
    others = [
        spawn(bases, attn_dp_size=1, attn_dp_rank=0, dp_rank=r, rank_by="attn_dp_rank")
        for r in range(1, DP_SIZE)
    ]
    for child in others:
        error = read_json_line(child)["error"]
        assert error.startswith("EndpointError: ")
        taken = f"port {bases[0].rsplit(':', 1)[1]}" if kind == "tcp" else bases[0]
        assert f"endpoint {bases[0]} of publisher rank 0" in error
        assert f"{taken} is already in use" in error
        assert "select_kv_publisher_dp_rank" in error
        assert child.wait(timeout=TIMEOUT_S) == 2
    tell(first, "go")
    assert read_json_line(first)["done"] >= COUNT
    tell(first, "stop")
    assert first.wait(timeout=TIMEOUT_S) == 0
