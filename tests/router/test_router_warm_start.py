"""Warm restarts (issue 13): a router killed with SIGKILL and started again with
``--peer URL`` ends with an index equal to every rank's ``/kv_blocks``, whether the
engine's replay buffer still holds everything, has wrapped, or does not exist."""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import pytest
from router_support import Engine, RouterProc, wait_until

from kvevents import BlockStored, KVEventBatch
from kvevents.cli.router import add_arguments, build_service
from kvevents.index.prefix_index import PrefixIndex
from kvevents.router.decide.router import Router
from kvevents.router.fleet.warm_start import load_from_peers
from kvevents.types import Holder
from process_support import run_kvevents

DP = 2
PAGE = 4

CONFIGS = {
    "replay": {"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"},
    "wrapped-replay": {
        "publisher": "zmq",
        "endpoint": "tcp://*:0",
        "replay_endpoint": "tcp://*:0",
        "buffer_steps": 4,
    },
    "no-replay": {"publisher": "zmq", "endpoint": "tcp://*:0"},
}


def settled(engine: Engine, router: RouterProc) -> bool:
    index = PrefixIndex.from_bytes(router.http.get("/dump").content)
    return all(index.holder_hashes(Holder(engine.url, r)) == engine.kv_blocks(r) for r in range(DP))


def traffic(engine: Engine, rng: random.Random, count: int) -> None:
    """Prompts straight to the engine, each rank in turn, each with a fresh tail."""
    for i in range(count):
        tokens = [1, 2, 3, 4] + [rng.randrange(100, 60000) for _ in range(rng.randrange(4, 13))]
        engine.generate(tokens, rank=i % DP)


def holders(router: RouterProc) -> list[dict[str, Any]]:
    holders: list[dict[str, Any]] = router.http.get("/workers").json()["holders"]
    return holders


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_router_restarted_with_a_peer_ends_equal_to_every_rank(config: str) -> None:
    """Killed and restarted with --peer while the engine went on, the router's index
    equals every rank's /kv_blocks without reporting a loss, and keeps following."""
    rng = random.Random(13)
    engine = Engine(["--dp-size", str(DP), "--page-size", str(PAGE)], CONFIGS[config])
    try:
        peer = RouterProc([engine.url])
        restarted: RouterProc | None = None
        try:
            victim = RouterProc([engine.url])
            try:
                for r in (peer, victim):
                    wait_until(lambda r=r: r.connected() == DP, 20, "every stream connected")
                traffic(engine, rng, 10)
                for r in (peer, victim):
                    wait_until(lambda r=r: settled(engine, r), 20, "both routers to match")
            finally:
                victim.stop(signal.SIGKILL, expect=None)
            traffic(engine, rng, 30)  # far more batches than a 4-step buffer holds
            wait_until(lambda: settled(engine, peer), 20, "the peer to match")

            restarted = RouterProc([engine.url], "--peer", peer.url)
            warm = restarted.http.get("/workers").json()["warm_start"]
            assert warm["peer"] == peer.url and warm["streams"] == DP, warm
            assert warm["blocks"] > 0 and warm["snapshot_bytes"] > 0
            assert 0 < warm["fetch_seconds"] + warm["load_seconds"] <= warm["seconds"]
            wait_until(lambda: settled(engine, restarted), 20, "the restarted router to match")
            assert all(h["signals"].get("loss", 0) == 0 for h in holders(restarted))

            traffic(engine, rng, 6)  # it follows on from there
            wait_until(lambda: settled(engine, restarted), 20, "it to match after more traffic")
        finally:
            if restarted is not None:
                restarted.stop()
            peer.stop()
    finally:
        engine.stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_with_no_reachable_peer_the_router_starts_empty_and_says_why() -> None:
    """A --peer that does not answer leaves the router starting as without one."""
    engine = Engine(["--dp-size", str(DP), "--page-size", str(PAGE)], CONFIGS["replay"])
    try:
        rng = random.Random(7)
        traffic(engine, rng, 4)
        dead = f"http://127.0.0.1:{_closed_port()}"
        router = RouterProc([engine.url], "--peer", dead)
        try:
            warm = router.http.get("/workers").json()["warm_start"]
            assert warm["peer"] is None and warm["blocks"] == 0
            assert len(warm["errors"]) == 1 and warm["errors"][0].startswith(dead)
            wait_until(lambda: settled(engine, router), 20, "the index to fill by replay")
        finally:
            router.stop()
    finally:
        engine.stop()


@pytest.mark.slow
def test_a_peer_with_an_older_snapshot_version_is_refused_by_name() -> None:
    """A peer running an older kvevents answers a version 3 snapshot: it is not loaded,
    and the error names the version and what to do (the router then starts empty)."""
    v3 = msgspec.msgpack.encode([3, 4, 100, [1.0, 0.5, 0.25], 64, [["e", 0]], [4], [[7, b"\x01"]]])

    class OldPeer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(v3)))
            self.end_headers()
            self.wfile.write(v3)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), OldPeer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        index, warm = load_from_peers([url], timeout=10.0)
    finally:
        server.shutdown()
        thread.join(10.0)
        server.server_close()
    assert index is None and warm.peer is None
    assert len(warm.errors) == 1 and warm.errors[0].startswith(url)
    assert "snapshot version 3 is not supported" in warm.errors[0]
    assert "older kvevents" in warm.errors[0] and "without --peer" in warm.errors[0]


@contextlib.contextmanager
def _peer_serving(snapshot: bytes, asked: list[str] | None = None) -> Iterator[str]:
    """A peer router's /dump (only that) on a real HTTP server; yields its URL.
    ``asked``: each request's path is appended to it."""

    class Peer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if asked is not None:
                asked.append(self.path)
            self.send_response(200 if self.path == "/dump" else 404)
            self.send_header("Content-Length", str(len(snapshot)))
            self.end_headers()
            self.wfile.write(snapshot)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Peer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_a_peers_ranks_the_engine_does_not_have_are_dropped() -> None:
    """The peer's snapshot has ranks 2 and 3 of an engine that now runs 2 (its view was
    older, or it was told another --dp-size): once the router has read the engine's
    /server_info, those ranks and their blocks are gone from its index (they were
    adopted, routable, and won the requests whose prefix they held)."""
    engine = Engine(["--dp-size", str(DP), "--page-size", str(PAGE)], CONFIGS["replay"])
    try:
        prompt = list(range(500, 516))
        peer_index = PrefixIndex(block_size=PAGE)
        for rank in range(4):
            peer_index.add_holder(Holder(engine.url, rank))
        stale = Holder(engine.url, 3)
        peer_index.apply(stale, KVEventBatch(ts=1.0, events=[_stored(prompt)]))
        peer_index.applied_seqs[stale] = 41
        with _peer_serving(peer_index.to_bytes()) as peer:
            router = RouterProc([engine.url], "--peer", peer)
            try:
                assert router.http.get("/workers").json()["warm_start"]["peer"] == peer
                wait_until(
                    lambda: sorted(h["dp_rank"] for h in holders(router)) == [0, 1],
                    20,
                    "ranks 2 and 3 dropped",
                )
                matches = router.post("/query", {"input_ids": prompt}).json()["matches"]
                assert all(m["dp_rank"] < DP and m["matched_tokens"] == 0 for m in matches)
            finally:
                router.stop()
    finally:
        engine.stop()


def _stored(tokens: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=list(range(1, len(tokens) // PAGE + 1)),
        parent_block_hash=None,
        token_ids=tokens,
        block_size=PAGE,
        lora_id=None,
        medium=None,
    )


@pytest.mark.slow
def test_a_peers_ranks_past_an_engine_described_here_are_not_adopted() -> None:
    """An engine described on the command line with --dp-size 2: the peer's ranks 2 and
    3 of it are dropped as its snapshot is restored."""
    engine = "http://127.0.0.1:9"  # never contacted: described, and nothing is started
    peer_index = PrefixIndex(block_size=PAGE)
    for rank in range(4):
        peer_index.add_holder(Holder(engine, rank))
    prompt = list(range(500, 516))
    peer_index.apply(Holder(engine, 3), KVEventBatch(ts=1.0, events=[_stored(prompt)]))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with _peer_serving(peer_index.to_bytes()) as peer:
        described = ["--kv-endpoint", "tcp://127.0.0.1:5557", "--dp-size", "2"]
        args = parser.parse_args(
            ["--engine", engine, *described, "--block-size", str(PAGE), "--peer", peer]
        )
        service = build_service(args, warn=False)
    try:
        assert service.router.holders() == [Holder(engine, 0), Holder(engine, 1)]
        assert service.router.index.num_blocks == 0
    finally:
        assert service.subscriber is not None
        service.subscriber.close()


@pytest.mark.slow
def test_a_peer_url_with_credentials_is_never_asked_nor_shown() -> None:
    """``http://user:password@host`` as a peer: skipped, with the reason and the URL
    masked in ``errors`` (and so in /workers and the log), and the next peer is used;
    before, the password was shown in ``warm_start`` and logged."""
    index = PrefixIndex(block_size=PAGE)
    index.add_holder(Holder("http://e", 0))
    asked: list[str] = []
    with _peer_serving(index.to_bytes(), asked) as peer, _peer_serving(index.to_bytes()) as good:
        secret = peer.replace("http://", "http://ops:hunter2@")
        loaded, warm = load_from_peers([secret, good], timeout=10.0)
    assert loaded is not None and warm.peer == good and asked == []
    assert warm.errors == [
        f"--peer {peer.replace('http://', 'http://***@')}: credentials in a peer's URL are "
        "refused (it would be shown in /workers and the log); the peer is asked with this "
        "router's --api-key (or --api-key-file, KVEVENTS_API_KEY): write http://HOST:PORT"
    ]
    assert "hunter2" not in msgspec.json.encode(warm).decode()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("peer", "message"),
    [
        ("http://ops:hunter2@127.0.0.1:1", "--peer http://***@127.0.0.1:1: credentials in"),
        ("http://ops:hunter2@127.0.0.1:8x", "--peer http://***@127.0.0.1:8x: not a URL"),
    ],
)
def test_kvevents_router_refuses_a_peer_url_with_credentials_or_unreadable(
    peer: str, message: str
) -> None:
    """Refused at start (exit 2), as an engine URL with credentials is, without showing
    the password; an unreadable URL ended in a traceback (httpx.InvalidURL)."""
    done = run_kvevents("router", "--engine", "http://127.0.0.1:9", "--peer", peer)
    assert done.returncode == 2, done.stderr
    assert f"kvevents router: error: {message}" in done.stderr
    assert "hunter2" not in done.stderr and "Traceback" not in done.stderr


def _snapshot(worker: str, page: int, prompt: list[int]) -> PrefixIndex:
    """A peer's index at block size ``page``: ``prompt`` stored on rank 1 of ``worker``."""
    index = PrefixIndex(block_size=page)
    for rank in range(DP):
        index.add_holder(Holder(worker, rank))
    stored = BlockStored(
        block_hashes=list(range(1, len(prompt) // page + 1)),
        parent_block_hash=None,
        token_ids=prompt,
        block_size=page,
        lora_id=None,
        medium=None,
    )
    index.apply(Holder(worker, 1), KVEventBatch(ts=1.0, events=[stored]))
    index.applied_seqs[Holder(worker, 1)] = 41
    return index


def _described_router(peers: list[str], *before: str, after: tuple[str, ...] = ()) -> Any:
    """``build_service`` of a router following one engine described here (never contacted);
    ``before``/``after``: options before its ``--engine`` (global) and after (the engine's)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engine = ["--engine", "http://127.0.0.1:9", "--kv-endpoint", "tcp://127.0.0.1:5557"]
    argv = [*before, *engine, "--dp-size", str(DP), *after]
    for peer in peers:
        argv += ["--peer", peer]
    return build_service(parser.parse_args(argv), warn=False)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["global", "the engine's"])
def test_a_snapshot_at_another_block_size_is_refused_and_the_next_peer_tried(where: str) -> None:
    """With --block-size 8 (the router's, or its engine's), a peer's snapshot at 4 is
    skipped with the reason and the next peer's, at 8, adopted; before, the first was
    adopted with its keys (cut at 4) kept under 8: nothing matched, nothing said why."""
    engine, prompt = "http://127.0.0.1:9", list(range(500, 516))
    at4, at8 = _snapshot(engine, 4, prompt), _snapshot(engine, 8, prompt)
    size = ("--block-size", "8")
    with _peer_serving(at4.to_bytes()) as wrong, _peer_serving(at8.to_bytes()) as right:
        if where == "global":
            service = _described_router([wrong, right], *size)
        else:
            service = _described_router([wrong, right], after=size)
    try:
        warm = service.warm_start
        assert warm.peer == right and warm.blocks == 2, warm
        assert warm.errors == [
            f"{wrong}: its snapshot is at block size 4, this router keys requests at 8: its "
            "blocks would match nothing (give the replicas one block size)"
        ]
        router = service.router
        assert router.index.block_size == 8
        assert router.query([*prompt, 0])[Holder(engine, 1)].gpu == 2
    finally:
        service.subscriber.close()
    at8_router = Router(block_size=8)
    with pytest.raises(ValueError, match="snapshot at block size 4 cannot be restored"):
        at8_router.restore_index(_snapshot(engine, 4, prompt))


@pytest.mark.slow
def test_a_peer_with_none_of_our_ranks_is_skipped_and_counts_are_of_what_is_kept() -> None:
    """The first peer follows only another engine: skipped with the reason, and the next
    peer asked. The next one follows ours and another: what /workers reports (blocks,
    streams) is what was kept. Before, the first snapshot that decoded was adopted, its
    holders dropped only afterwards: the router started empty, the good peer was never
    asked, and warm_start reported the foreign snapshot's blocks and streams."""
    ours, other, prompt = "http://127.0.0.1:9", "http://10.9.9.9:30000", list(range(500, 516))
    both = _snapshot(ours, PAGE, prompt)
    elsewhere = _snapshot(other, PAGE, list(range(700, 732)))
    for holder in elsewhere.holders():  # the good peer follows the other engine too
        both.add_holder(holder)
        both.applied_seqs[holder] = 7
    both.apply(Holder(other, 0), KVEventBatch(ts=1.0, events=[_stored(list(range(900, 932)))]))
    with (
        _peer_serving(elsewhere.to_bytes()) as foreign,
        _peer_serving(both.to_bytes()) as good,
    ):
        service = _described_router([foreign, good], "--block-size", str(PAGE))
    try:
        warm, index = service.warm_start, service.router.index
        assert warm.peer == good, warm
        assert warm.errors == [
            f"{foreign}: its snapshot holds none of the ranks this router follows (only of "
            f"{other}): nothing of it is usable"
        ]
        assert index.holders() == [Holder(ours, 0), Holder(ours, 1)]
        assert (warm.blocks, warm.streams) == (index.num_blocks, 1) == (4, 1)
        assert service.router.query([*prompt, 0])[Holder(ours, 1)].gpu == 4
    finally:
        service.subscriber.close()


def test_a_snapshot_past_this_routers_memory_bound_is_pruned_as_it_is_restored() -> None:
    """A peer with a larger --max-entries hands over more than this router may hold: it
    keeps its own bound at once, the least recently used blocks going first, as a store
    past it would. Before, the bound was only applied at the next store."""
    holder = Holder("http://engine", 0)
    peer = PrefixIndex(block_size=4, max_entries=10_000)
    prompts = [[p * 1000 + t for t in range(40)] for p in range(20)]  # 10 blocks each
    for prompt in prompts:
        peer.store_keys(holder, peer.keys_for(prompt))
    assert len(peer) == 200
    router = Router(block_size=4, max_entries=100)
    router.restore_index(PrefixIndex.from_bytes(peer.to_bytes()))
    assert 0 < len(router.index) <= 100 and router.index.max_entries == 100
    assert router.index.stats.pruned_entries == 200 - len(router.index)
    # the newest prompt stayed, the oldest went
    assert router.route([*prompts[-1], 0]).matched_tokens == 40
    assert router.route(prompts[0]).matched_tokens == 0
