"""Reading a vLLM's per-rank load from its Prometheus /metrics text; the load poll's
tolerance of slow answers against a real HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import zmq

from kvevents import BlockStored, KVEventBatch, Subscriber, ZmqEventPublisher
from kvevents.http.upstream import Upstream
from kvevents.router.decide.router import Router
from kvevents.router.fleet import engines as engines_module
from kvevents.router.fleet.engines import (
    SLOW_POLLS_TOLERATED,
    EngineState,
    _poll_load,
    _register,
    cache_config_block_size,
    vllm_rank_loads,
    vllm_scrape,
    watch_engine,
)
from kvevents.router.serve import service as service_module
from kvevents.subscribe.engine_spec import EngineSpec
from kvevents.types import Holder

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 0.0
vllm:num_requests_running{engine="1",model_name="lora-a"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 5.0
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
"""


def test_each_rank_gets_its_running_and_waiting_requests() -> None:
    """The two scheduler gauges per engine label become one entry per rank; models are summed."""
    assert vllm_rank_loads(METRICS) == [
        {"dp_rank": 0, "running": 2, "waiting": 5},
        {"dp_rank": 1, "running": 1, "waiting": 0},
    ]


# vLLM 0.32's line for rank 0 (a Llama, CPU), as its /metrics wrote it
CACHE_CONFIG = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",'
    'effective_attention_block_size="32",enable_prefix_caching="True",engine="0",'
    'hash_block_size="None",mamba_block_size="None",num_gpu_blocks="40",'
    'sliding_window="None",user_specified_block_size="True"} 1.0\n'
)


def test_each_rank_states_its_block_size_in_cache_config_info() -> None:
    """vLLM's cache_config_info gives each rank's block size, read in the same parse as its load."""
    loads, sizes = vllm_scrape(METRICS + CACHE_CONFIG + CACHE_CONFIG.replace('"0"', '"1"'))
    assert loads == vllm_rank_loads(METRICS) and sizes == {0: 32, 1: 32}
    assert vllm_scrape(METRICS)[1] == {}


@pytest.mark.parametrize(
    ("labels", "size"),
    [
        ({"block_size": "16", "effective_attention_block_size": "16"}, 16),
        (
            {
                "block_size": "16",
                "effective_attention_block_size": "16",
                "hash_block_size": "None",
                "mamba_block_size": "None",
                "prefix_match_unit": "None",
            },
            16,
        ),
        ({"effective_attention_block_size": "16", "hash_block_size": "16"}, 16),
        # decode context parallelism of 2: pages of 16, blocks (and events) of 32
        ({"block_size": "16", "effective_attention_block_size": "32"}, 32),
        # an older vLLM states only its page size: not certainly its events' size
        ({"block_size": "16"}, None),
        ({"block_size": "16", "mamba_block_size": "16", "hash_block_size": "None"}, None),
        # hashing, prefix matching or Mamba state at another size
        ({"effective_attention_block_size": "1600", "hash_block_size": "16"}, None),
        ({"effective_attention_block_size": "32", "prefix_match_unit": "16"}, None),
        ({"effective_attention_block_size": "16", "mamba_block_size": "2048"}, None),
        ({"effective_attention_block_size": "None"}, None),
        ({"effective_attention_block_size": "0"}, None),
        ({}, None),
    ],
)
def test_only_a_plainly_stated_block_size_is_taken(
    labels: dict[str, str], size: int | None
) -> None:
    assert cache_config_block_size(labels) == size


def test_a_stated_size_is_declared_once_and_again_once_a_reset_forgot_it() -> None:
    """Each poll's stated size is declared only when the rank's standing declaration does
    not say it: a size other than the operator's --block-size is counted once, not once
    a poll, events at the operator's size still count, and a rank whose declaration a
    reset (a restarted engine) forgot is declared again."""
    router = Router(block_size=16)  # the operator's
    state = EngineState(EngineSpec.create("http://v:8000", kind="vllm"))
    holder = Holder(state.spec.worker, 0)
    router.add_holder(holder, block_size=16, source="configured")
    for _ in range(3):
        engines_module._declare_stated_sizes(router, state, {0: 32}, [0])
    mismatch = router.block_sizes.mismatches[(holder, "metrics", 32)]
    assert mismatch.count == 1 and router.index.block_size == 16
    router.block_sizes.forget(holder)
    engines_module._declare_stated_sizes(router, state, {0: 32}, [0])
    assert router.block_sizes.declared[holder] == 32 and mismatch.count == 2


def test_metrics_without_the_gauges_give_no_ranks_and_garbage_is_refused() -> None:
    """Another server's metrics yield no ranks (the caller then says so); unparsable text is a ValueError."""
    assert vllm_rank_loads("# TYPE up gauge\nup 1.0\n") == []
    with pytest.raises(ValueError):
        vllm_rank_loads("this is {not metrics")


def test_values_that_are_not_finite_counts_are_skipped() -> None:
    """+Inf, NaN or a negative gauge is no request count: skipped, never an overflow."""
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} +Inf\n'
        'vllm:num_requests_running{engine="1"} NaN\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0"} 4.0\n'
        'vllm:num_requests_waiting{engine="1"} -1.0\n'
    )
    assert vllm_rank_loads(text) == [{"dp_rank": 0, "running": 0, "waiting": 4}]


class _SlowLoadEngine(BaseHTTPRequestHandler):
    """A kvevents engine's /load (two ranks, both available), answered after ``delay`` s;
    its /server_info (a 404: nothing to discover) after ``discovery_delay`` s. HTTP/1.1:
    connections stay open; ``load_peers`` holds the client address of every /load."""

    protocol_version = "HTTP/1.1"
    delay = 0.0
    body_delay = 0.0
    discovery_delay = 0.0
    running: ClassVar[tuple[int, int]] = (1, 1)
    """Each rank's running requests in the /load answer."""
    load_peers: ClassVar[list[tuple[str, int]]] = []

    def do_GET(self) -> None:
        if self.path == "/server_info":
            time.sleep(type(self).discovery_delay)
        if self.path == "/load":
            type(self).load_peers.append(self.client_address)
            time.sleep(type(self).delay)
            body = json.dumps(
                {
                    "dp_size": 2,
                    "ranks": [
                        {"dp_rank": r, "running": type(self).running[r], "waiting": 0}
                        for r in (0, 1)
                    ],
                }
            ).encode()
            self.send_response(200)
        else:
            body = b"{}"
            self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()  # the head leaves now
        if self.path == "/load":
            time.sleep(type(self).body_delay)
        with contextlib.suppress(OSError):  # the poller may have given up on the answer
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


async def _until(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def _slow_engine() -> Iterator[str]:
    """A real HTTP server answering as :class:`_SlowLoadEngine`; yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowLoadEngine)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        _SlowLoadEngine.delay = _SlowLoadEngine.discovery_delay = 0.0
        _SlowLoadEngine.body_delay = 0.0
        _SlowLoadEngine.running = (1, 1)
        _SlowLoadEngine.load_peers = []
        server.shutdown()
        thread.join(10.0)
        server.server_close()


@contextlib.asynccontextmanager
async def _watching(router: Router, state: EngineState) -> AsyncIterator[None]:
    """``watch_engine`` polling every 0.05 s with a 0.2 s timeout, stopped on exit."""
    stopping = asyncio.Event()
    upstream = Upstream(timeout=60.0)
    task = asyncio.create_task(
        watch_engine(router, state, upstream, 0.05, stopping, load_timeout=0.2)
    )
    try:
        yield
    finally:
        stopping.set()
        await asyncio.wait_for(task, 10.0)
        await upstream.close()


def _two_rank_engine(url: str) -> tuple[EngineState, list[Holder]]:
    """The watch state of a 2-rank kvevents engine at ``url``, and its two holders."""
    spec = EngineSpec.create(url, kv_endpoint="tcp://127.0.0.1:5557", dp_size=2, kind="kvevents")
    return EngineState(spec), [Holder(spec.worker, r) for r in (0, 1)]


@pytest.mark.slow
def test_a_slow_load_answer_keeps_the_last_known_state_until_the_threshold() -> None:
    """A /load that answers after the poll's timeout is a slow engine, not a dead one: its
    ranks stay available (and /workers' fields say why) for SLOW_POLLS_TOLERATED polls in
    a row; one more is an error that marks them unavailable; the next answer clears both."""
    router = Router(block_size=4)

    async def run(url: str) -> None:
        state, holders = _two_rank_engine(url)

        def available() -> list[bool]:
            return [router.loads[h].available for h in holders if h in router.loads]

        async with _watching(router, state):
            await _until("both ranks available", lambda: available() == [True, True])
            _SlowLoadEngine.delay = 0.6
            await _until("a slow poll", lambda: state.slow_polls >= 1)
            assert available() == [True, True] and state.error is None
            assert state.slow is not None and "keep their last known state" in state.slow
            await _until("the threshold", lambda: state.error is not None)
            assert state.slow_polls == SLOW_POLLS_TOLERATED + 1
            assert available() == [False, False] and state.slow is None
            assert "TimeoutError" in state.error and "4 load polls in a row" in state.error
            _SlowLoadEngine.delay = 0.0
            await _until("the engine back", lambda: state.error is None)
            assert state.slow_polls == 0 and available() == [True, True]

    with _slow_engine() as url:
        asyncio.run(run(url))


@pytest.mark.slow
def test_a_load_answer_whose_body_is_late_is_slow_not_down() -> None:
    """A /load whose head comes at once and whose body comes after the poll's timeout is a
    slow engine like one that answers nothing in time: the ranks keep their state."""
    router = Router(block_size=4)

    async def run(url: str) -> None:
        state, holders = _two_rank_engine(url)
        async with _watching(router, state):
            await _until("both ranks available", lambda: state.load_source == "/load")
            _SlowLoadEngine.body_delay = 0.6
            await _until("a slow poll", lambda: state.slow_polls >= 1)
            assert state.error is None and all(router.loads[h].available for h in holders)
            assert state.slow is not None and "keep their last known state" in state.slow

    with _slow_engine() as url:
        asyncio.run(run(url))


@pytest.mark.slow
def test_a_request_that_ends_while_a_poll_waits_is_taken_out_only_if_counted() -> None:
    """A poll notes what had ended as the engine's answer begins to arrive. A request
    whose end came before the answer began was let go before the engine counted: the
    count is taken as said. One that ends while the answer's body is on its way was in
    the count: it is taken out, so it does not linger as the engine's own request."""
    router = Router(block_size=4)
    heads: list[dict[int, float]] = []
    noted = router.requests_ended

    def noting(worker: str) -> dict[int, float]:
        heads.append(noted(worker))
        return heads[-1]

    router.requests_ended = noting  # type: ignore[method-assign]

    async def run(url: str) -> None:
        state, holders = _two_rank_engine(url)
        upstream = Upstream(timeout=60.0)
        try:
            await _poll_load(router, state, upstream, 5.0)  # one own request per rank
            assert [router.loads[h].engine_requests for h in holders] == [1, 1]
            ticket = router.begin(router.route([1, 2, 3, 4]))
            rank = ticket.holder.dp_rank
            assert router.loads[holders[rank]].engine_requests == 2

            # ended before the engine answered: it no longer counts the request
            _SlowLoadEngine.delay = 0.5
            poll = asyncio.create_task(_poll_load(router, state, upstream, 5.0))
            await asyncio.sleep(0.2)
            assert len(heads) == 1  # the answer has not begun
            router.finish(ticket)
            await poll
            assert [router.loads[h].engine_requests for h in holders] == [1, 1]

            # ends while the answer's body comes: the engine counted it with its own one
            _SlowLoadEngine.delay, _SlowLoadEngine.body_delay = 0.0, 0.5
            ticket = router.begin(router.route([1, 2, 3, 4]))
            rank = ticket.holder.dp_rank
            _SlowLoadEngine.running = (2, 1) if rank == 0 else (1, 2)
            poll = asyncio.create_task(_poll_load(router, state, upstream, 5.0))
            await _until("the answer's head", lambda: len(heads) == 3)
            router.finish(ticket)
            await poll
            assert [router.loads[h].engine_requests for h in holders] == [1, 1]
        finally:
            await upstream.close()

    with _slow_engine() as url:
        asyncio.run(run(url))


@pytest.mark.slow
def test_load_polls_reuse_one_kept_alive_connection() -> None:
    """Polled every 0.05 s, an engine that keeps connections open sees its /load polls
    arrive on one connection (the router's engine client, not a connection per poll)."""
    router = Router(block_size=4)

    async def run(url: str) -> None:
        spec = EngineSpec.create(
            url, kv_endpoint="tcp://127.0.0.1:5557", dp_size=2, kind="kvevents"
        )
        state = EngineState(spec)
        async with _watching(router, state):
            await _until("ten polls", lambda: len(_SlowLoadEngine.load_peers) >= 10)
            assert state.error is None and state.load_source == "/load"
        assert len(set(_SlowLoadEngine.load_peers)) == 1
        assert router.loads[Holder(spec.worker, 1)].engine_requests == 1

    with _slow_engine() as url:
        asyncio.run(run(url))


@pytest.mark.slow
def test_a_slow_discovery_is_tolerated_like_a_slow_load_poll() -> None:
    """An engine found from its URL alone that is slow to answer /server_info (a vLLM busy
    on CPU) keeps the state its ranks have from their streams for SLOW_POLLS_TOLERATED
    polls in a row, instead of being marked unavailable at the first timeout."""
    router = Router(block_size=4)

    async def run(url: str) -> None:
        spec = EngineSpec.create(url)
        holder = Holder(spec.worker, 0)
        router.add_holder(holder)  # known from its stream, as the subscriber finds it
        state = EngineState(spec)
        async with _watching(router, state):
            await _until("a slow discovery", lambda: state.slow_polls >= 1)
            assert not state.registered and state.error is None
            assert state.slow is not None and state.slow.startswith("discovery")
            assert router.loads[holder].available
            await _until("the threshold", lambda: state.error is not None)
            assert state.slow_polls == SLOW_POLLS_TOLERATED + 1
            assert not router.loads[holder].available

    with _slow_engine() as url:
        _SlowLoadEngine.discovery_delay = 0.6
        asyncio.run(run(url))


def test_a_refused_connection_is_an_error_at_once() -> None:
    """An engine that is gone (connection refused) is not tolerated like a slow one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = EngineSpec.create(
        f"http://127.0.0.1:{port}", kv_endpoint="tcp://127.0.0.1:5557", dp_size=2, kind="kvevents"
    )
    router = Router(block_size=4)
    state = EngineState(spec)

    async def run() -> None:
        async with _watching(router, state):
            await _until("the error", lambda: state.error is not None)
            assert state.slow_polls == 0 and "cannot connect" in state.error
            assert not any(load.available for load in router.loads.values())

    asyncio.run(run())


@pytest.mark.slow
def test_start_waits_for_a_hanging_engine_only_as_long_as_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RouterService.start() waits for every engine's first poll, but an engine that hangs
    on /server_info holds it back at most FIRST_POLL_WAIT_S: the router serves without it."""
    monkeypatch.setattr(service_module, "FIRST_POLL_WAIT_S", 0.3)

    async def run(url: str) -> float:
        service = service_module.RouterService(Router(), [url], load_interval=60.0)
        began = time.monotonic()
        await service.start()
        took = time.monotonic() - began
        try:
            (state,) = service.states.values()
            assert not state.registered and not state.first_poll.is_set()
        finally:
            await service.stop()
        return took

    with _slow_engine() as url:
        _SlowLoadEngine.discovery_delay = 3.0
        took = asyncio.run(run(url))
    assert 0.3 <= took < 2.5


class _VllmByUrl(BaseHTTPRequestHandler):
    """A vLLM that says how many DP ranks it runs only in /kv_event_sources (``sources``,
    two by default; a test may change them: the engine restarting); /health, and
    ``metrics`` as its /metrics."""

    protocol_version = "HTTP/1.1"
    sources: ClassVar[dict[str, object]] = {
        str(r): {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}
        | {"endpoint": f"tcp://*:{5557 + r}"}
        for r in (0, 1)
    }
    metrics: ClassVar[str] = METRICS

    def do_GET(self) -> None:
        body = {
            "/kv_event_sources": json.dumps(type(self).sources).encode(),
            "/health": b"",
            "/metrics": type(self).metrics.encode(),
        }.get(self.path)
        self.send_response(404 if body is None else 200)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.slow
def test_a_vllm_given_by_url_alone_gets_every_discovered_ranks_metrics_load() -> None:
    """``--engine URL --engine-kind vllm`` (its ranks found in /kv_event_sources): each
    rank's running and waiting requests from /metrics reach the router, rank 1's too
    (they were dropped: the poll knew only of the one rank its spec named)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _VllmByUrl)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    async def main() -> None:
        router = Router()
        state = EngineState(EngineSpec.create(url, kind="vllm"))
        upstream = Upstream(timeout=10.0)
        try:
            await asyncio.wait_for(_register(router, state, upstream, 5.0), 10.0)
            await asyncio.wait_for(_poll_load(router, state, upstream, 5.0), 10.0)
        finally:
            await upstream.close()
        assert router.holders() == [Holder(url, 0), Holder(url, 1)]
        assert (state.load_source, state.metrics_error) == ("/metrics", None)
        assert router.loads[Holder(url, 0)].engine_requests == 7  # 2 running, 5 waiting
        assert router.loads[Holder(url, 1)].engine_requests == 1

    try:
        asyncio.run(main())
    finally:
        server.shutdown()
        server.server_close()


class _ShrinkingVllm(_VllmByUrl):
    """:class:`_VllmByUrl` whose ranks the test sets; no gauges in its /metrics."""

    sources: ClassVar[dict[str, object]] = {}
    metrics: ClassVar[str] = "# no gauges\n"


@pytest.mark.slow
def test_ranks_an_engine_no_longer_has_are_no_longer_routed_to() -> None:
    """A vLLM known by URL restarts with 2 ranks instead of 4, on new ports: the
    subscriber stops following ranks 2 and 3 (a Removed signal) and the router drops
    them, their cached blocks with them (they stayed routable and won the requests whose
    prefix they had held, for a rank the engine no longer has)."""
    ctx = zmq.Context()
    publishers: list[ZmqEventPublisher] = []

    def start(ranks: int) -> None:
        publishers[:] = [
            ZmqEventPublisher(0, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", bind=True, context=ctx)
            for _ in range(ranks)
        ]
        _ShrinkingVllm.sources = {
            str(r): {"publisher": "zmq", "endpoint": p.endpoint, "topic": ""}
            | {"replay_endpoint": p.replay_endpoint}
            for r, p in enumerate(publishers)
        }

    server = ThreadingHTTPServer(("127.0.0.1", 0), _ShrinkingVllm)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    prompt = list(range(100, 132))
    stored = BlockStored(
        block_hashes=[7, 8],
        parent_block_hash=None,
        token_ids=prompt,
        block_size=16,
        lora_id=None,
        medium="GPU",
    )

    async def main() -> None:
        router = Router(block_size=16)
        subscriber = Subscriber(rediscover_interval=0.2, tail_probe=None)
        spec = EngineSpec.create(url, kind="vllm")
        spec.follow(subscriber)
        service = service_module.RouterService(router, [spec], subscriber=subscriber)
        await service.start()
        try:
            await _until("4 ranks", lambda: len(router.holders()) == 4)
            gone = Holder(url, 3)

            def held() -> bool:
                publishers[3].publish(KVEventBatch(ts=time.time(), events=[stored]))
                return router.index.holder_size(gone) > 0

            await _until("rank 3 holding the prompt", held)
            assert router.route(prompt).holder == gone
            for publisher in publishers:
                publisher.shutdown(timeout=1.0)
            start(2)  # the engine again, with 2 ranks
            await _until("ranks 2 and 3 dropped", lambda: len(router.holders()) == 2)
            assert sorted(h.dp_rank for h in subscriber.stats()) == [0, 1]
            assert router.route(prompt).holder.dp_rank in (0, 1)
            assert router.signals[("removed", gone)] == 1
        finally:
            await service.stop()
            subscriber.close()

    start(4)
    try:
        asyncio.run(main())
    finally:
        for publisher in publishers:
            publisher.shutdown(timeout=1.0)
        server.shutdown()
        server.server_close()
        ctx.term()
