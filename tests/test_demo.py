"""`kvevents demo`: end to end as a subprocess, its cleanup on signals, and its parts."""

from __future__ import annotations

import asyncio
import http.server
import itertools
import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from kvevents import ConfigError, KVEventsError
from kvevents.cli.main import main
from kvevents.demo.chart import cumulative, rolling
from kvevents.demo.plane import _metric_sum
from kvevents.demo.procs import Child
from kvevents.demo.replay import (
    Outcome,
    PolicyRun,
    Workload,
    hit_rate,
    pooled_upper_bound,
    replay,
)
from kvevents.demo.report import summarize
from kvevents.demo.restart import RestartStep, restart_figures
from kvevents.engine.cache import PrefixCache
from kvevents.results import finite_json
from kvevents.traces import request_tokens
from process_support import still_running

DEMO = [sys.executable, "-m", "kvevents.cli.main", "demo"]


@pytest.mark.slow
def test_short_demo_orders_the_policies_and_stops_everything(tmp_path: Path) -> None:
    """A 300-request demo: KV-aware beats round-robin, the pooled bound beats both, nothing is lost, every process it started is stopped."""
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [*DEMO, "--requests", "300", "--json", str(out), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    kv, rr = doc["policies"]["kv_aware"], doc["policies"]["round_robin"]
    assert kv["requests"] == rr["requests"] == 300
    assert kv["failed"] == rr["failed"] == 0
    assert kv["hit_rate"] > rr["hit_rate"] > 0
    assert doc["upper_bound_hit_rate"] >= kv["hit_rate"]
    assert kv["load_max_over_min"] < 2.0
    events = doc["events"]
    assert events["lost"] == 0
    assert events["batches_delivered"] == events["batches_published"] > 0
    assert events["events_applied"] == events["events_published"]
    assert all(c["consistent"] for c in doc["index_consistency"].values())
    chart = Path(doc["chart"])
    assert chart.parent == tmp_path
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Prefix-cache hit rate by routing policy" in proc.stdout
    procs = doc["processes"]
    pids = [procs["engine"], procs["router"], *procs["ranks"]]
    assert len(procs["ranks"]) == 4
    assert still_running(pids) == []


def _read_lines(pipe: Any, lines: queue.Queue[str]) -> None:
    for line in pipe:
        lines.put(line)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_demo_stops_engine_router_and_ranks(sig: signal.Signals) -> None:
    """A signal while the trace replays ends the demo with code 130 and stops the engine, its ranks and the router."""
    proc = subprocess.Popen(
        [*DEMO, "--requests", "300", "--no-chart"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        engine_url = None
        deadline = time.monotonic() + 60
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line.startswith("engine ready:"):
                engine_url = line.split()[-1]
            if line.startswith("replaying"):
                break
        assert engine_url is not None
        ranks = [r["pid"] for r in httpx.get(f"{engine_url}/health", timeout=10).json()["ranks"]]
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(p) for p in f.read().split()]
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        stderr = proc.stderr.read() if proc.stderr else ""
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    assert code == 130, stderr
    assert "Traceback" not in stderr, stderr
    assert len(children) >= 2 and len(ranks) == 4
    assert still_running(children + ranks) == []


def test_bad_options_exit_2_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Invalid demo options fail before anything starts, with exit code 2 and a message naming the option."""
    # numeric bounds are refused by the parser (SystemExit), the rest by the command
    for argv, message in (
        (
            ["--requests", "0"],
            "kvevents demo: error: argument --requests: 0: must be an integer >= 1",
        ),
        (["--dp-size", "0"], "argument --dp-size: 0: must be"),
    ):
        with pytest.raises(SystemExit) as info:
            main(["demo", *argv])
        assert info.value.code == 2
        assert message in capsys.readouterr().err
    bad = tmp_path / "trace.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main(["demo", "--trace", str(bad)]) == 2
    assert f"{bad}:1: not a Mooncake trace request" in capsys.readouterr().err
    assert main(["demo", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read it" in capsys.readouterr().err


@pytest.mark.slow
def test_child_that_exits_early_is_reported_with_its_stderr() -> None:
    """A subcommand that exits before its ready line raises an error naming it, its exit code and its stderr."""
    child = Child("engine", ["--port", "0", "--dp-size", "0"])
    with pytest.raises(KVEventsError) as info:
        child.start(timeout=60)
    message = str(info.value)
    assert "`kvevents engine` exited with code 2 before it was ready" in message
    assert "--dp-size 0" in message
    assert child.process is not None and child.process.poll() == 2
    assert child.stop() == 2  # idempotent after the failure


def test_workload_compresses_arrivals_and_caps_outputs() -> None:
    """Arrival offsets are the trace's divided by the speedup, and output tokens are capped."""
    w = Workload.load(None, 50, speedup=10.0, max_new_tokens=7)
    assert len(w) == 50
    last = w.requests[-1]
    assert w.arrival_s(0) == 0.0
    assert w.arrival_s(49) == pytest.approx((last.timestamp - w.requests[0].timestamp) / 10_000)
    assert all(w.new_tokens(i) == min(7, r.output_length) for i, r in enumerate(w.requests))
    body = json.loads(w.body(3))
    assert body["input_ids"] == request_tokens(w.requests[3]).tolist()
    assert "routed_dp_rank" not in body
    with pytest.raises(ConfigError, match="--speedup 0"):
        Workload.load(None, 5, speedup=0.0, max_new_tokens=1)


class _FakeEngine(http.server.BaseHTTPRequestHandler):
    """Answers /generate by the request's position: a good answer, a 500, or one missing fields."""

    counter = itertools.count()
    in_flight = 0
    most_in_flight = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        cls = type(self)
        with cls.lock:
            n = next(cls.counter)
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        time.sleep(0.02)
        with cls.lock:
            cls.in_flight -= 1
        if n % 3 == 1:
            status, answer = 500, {"error": "rank down"}
        elif n % 3 == 2:
            status, answer = 200, {"text": "no figures"}
        else:
            status, answer = (
                200,
                {"dp_rank": n % 2, "prompt_tokens": len(body["input_ids"]), "cached_tokens": 16},
            )
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.slow
def test_replay_records_failed_and_malformed_answers_and_bounds_concurrency() -> None:
    """Every request gets an outcome in trace order; error statuses and answers without figures are recorded as failures; at most `concurrency` are in flight."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeEngine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        w = Workload.load(None, 12, speedup=1e9, max_new_tokens=1)
        url = f"http://127.0.0.1:{server.server_address[1]}/generate"
        run = asyncio.run(replay("kv_aware", w, url, concurrency=2))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    outcomes = [o for o in run.outcomes if o is not None]
    assert len(outcomes) == 12
    assert sum(o.error is None for o in outcomes) == 4
    assert sum("HTTP 500" in (o.error or "") for o in outcomes) == 4
    assert sum("answer lacks dp_rank" in (o.error or "") for o in outcomes) == 4
    assert all(o.cached_tokens == 16 and o.dp_rank in (0, 1) for o in outcomes if o.error is None)
    assert _FakeEngine.most_in_flight <= 2


def test_pooled_upper_bound_equals_one_big_cache() -> None:
    """The upper bound is exactly what one cache of the summed capacity reports on the same requests."""
    w = Workload.load(None, 40, speedup=1.0, max_new_tokens=1)
    pairs = pooled_upper_bound(w, 16, 4 * 2048)
    cache = PrefixCache(16, 4 * 2048)
    for r in w.requests:
        cache.release(cache.admit(request_tokens(r)))
    assert hit_rate(pairs) == pytest.approx(cache.stats.hit_rate)
    assert sum(p for p, _ in pairs) == cache.stats.prompt_tokens
    assert hit_rate(pairs) > 0  # the conversation trace reuses its shared first block


def test_summary_hit_rate_and_load_balance() -> None:
    """Hit rate sums cached over prompt tokens; load max/min compares prompt tokens per rank; failures are counted apart."""
    run = PolicyRun(
        "kv_aware",
        [
            Outcome(0, 100, 50, 0.0, 0.01),
            Outcome(1, 200, 0, 0.0, 0.02),
            Outcome(1, 100, 100, 0.0, 0.03),
            Outcome(-1, 0, 0, 0.0, 0.04, error="HTTP 502: boom"),
            None,
        ],
        wall_s=2.0,
    )
    s = summarize(run, dp_size=2)
    assert s["hit_rate"] == pytest.approx(150 / 400)
    assert s["prompt_tokens_per_rank"] == [100, 300]
    assert s["load_max_over_min"] == pytest.approx(3.0)
    assert s["failed"] == 1 and s["errors"] == ["HTTP 502: boom"]
    assert s["requests"] == 3 and s["requests_per_s"] == pytest.approx(1.5)
    idle = summarize(PolicyRun("round_robin", [Outcome(0, 10, 0, 0.0, 0.1)], 1.0), dp_size=2)
    assert finite_json(idle)["load_max_over_min"] is None  # a rank served nothing


def test_chart_series() -> None:
    """Cumulative and rolling hit rates over (prompt, cached) pairs."""
    pairs = [(100, 0), (100, 100), (200, 0), (100, 100)]
    assert cumulative(pairs) == pytest.approx([0.0, 0.5, 0.25, 0.4])
    assert rolling(pairs, 2) == pytest.approx([0.0, 0.5, 1 / 3, 1 / 3])


def test_metric_sum_reads_prometheus_text() -> None:
    """Every sample of a metric family is summed, and no other family's."""
    text = (
        "# TYPE kvevents_router_events_total counter\n"
        'kvevents_router_events_total{type="BlockStored",outcome="ok"} 12.0\n'
        'kvevents_router_events_total{type="BlockRemoved",outcome="ok"} 3.0\n'
        "kvevents_router_events_created 1.7e9\n"
        "kvevents_router_events_total_extra 99\n"
    )
    assert _metric_sum(text, "kvevents_router_events_total") == 15.0


class _CountingEngine(http.server.BaseHTTPRequestHandler):
    """Answers every /generate with good figures, counting the requests per server port."""

    seen: ClassVar[dict[int, int]] = {}
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        port = self.server.server_address[1]
        with type(self).lock:
            self.seen[port] = self.seen.get(port, 0) + 1
        answer = {"dp_rank": 0, "prompt_tokens": len(body["input_ids"]), "cached_tokens": 0}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.slow
def test_replay_across_several_urls_takes_them_in_turn() -> None:
    """Given three targets (router replicas), request i goes to target i mod 3."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CountingEngine) for _ in range(3)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        w = Workload.load(None, 9, speedup=1e9, max_new_tokens=1)
        urls = [f"http://127.0.0.1:{s.server_address[1]}/generate" for s in servers]
        run = asyncio.run(replay("replicas_sync", w, urls, concurrency=3))
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
        for t in threads:
            t.join(timeout=10)
    assert run.failed == []
    assert sorted(_CountingEngine.seen.values()) == [3, 3, 3]


def test_routers_must_be_at_least_one(capsys: pytest.CaptureFixture[str]) -> None:
    """--routers 0 is refused by name with exit code 2."""
    with pytest.raises(SystemExit) as info:
        main(["demo", "--routers", "0"])
    assert info.value.code == 2
    assert "argument --routers: 0: must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_a_request_whose_target_is_gone_is_sent_to_the_next_one() -> None:
    """A target that refuses connections (a killed replica) costs no failed request: each
    request sent to it goes once more to the next target, and is counted as resent."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/generate"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CountingEngine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _CountingEngine.seen.clear()
    try:
        w = Workload.load(None, 6, speedup=1e9, max_new_tokens=1)
        live = f"http://127.0.0.1:{server.server_address[1]}/generate"
        run = asyncio.run(replay("replicas_restart", w, [live, dead], concurrency=2))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert run.failed == []
    assert run.retried == 3
    assert sum(_CountingEngine.seen.values()) == 6
    assert {o.target for o in run.outcomes if o is not None} == {live}


def test_restart_figures_count_requests_that_missed_the_prefix_the_router_counted_on() -> None:
    """Between the kill and the moment the index is equal, a request misses when the engine
    cached fewer tokens than the whole blocks the router counted as cached; hit rates are
    split between the restarted replica and the others."""
    new = "http://127.0.0.1:2/generate"
    old = "http://127.0.0.1:1/generate"
    outcomes: list[Outcome | None] = [
        Outcome(0, 64, 64, 1.0, 0.1, target=old, router_cached_blocks=4.0),  # before the kill
        Outcome(0, 64, 32, 5.0, 0.1, target=old, router_cached_blocks=4.0),  # missed
        Outcome(1, 64, 48, 6.0, 0.1, target=new, router_cached_blocks=3.5),  # 3 whole: ok
        Outcome(1, 64, 0, 6.5, 0.1, target=new, router_cached_blocks=1.0),  # missed
        Outcome(2, 64, 16, 7.0, 0.1, target=old, router_cached_blocks=0.0),  # more than counted
        Outcome(0, 64, 0, 12.0, 0.1, target=new, router_cached_blocks=4.0),  # after: not counted
    ]
    run = PolicyRun("replicas_restart", outcomes, wall_s=20.0, started=100.0, retried=2)
    step = RestartStep("http://e", 4, [], [], after=1, startup_timeout=5.0)
    step.killed_at, step.launched_at, step.ready_at, step.equal_at = 104.0, 104.2, 106.0, 108.0
    step.new_url, step.old_url = new.removesuffix("/generate"), old.removesuffix("/generate")
    doc = restart_figures(step, run, page_size=16)
    assert doc["done"] and doc["index_caught_up"]
    assert doc["killed_at_s"] == pytest.approx(4.0)
    assert doc["caught_up_after_launch_s"] == pytest.approx(3.8)
    assert doc["meanwhile_requests"] == 4
    assert doc["meanwhile_missed_predicted_prefix"] == 2
    assert doc["meanwhile_missed_via_restarted"] == 1
    assert doc["meanwhile_requests_via_restarted"] == 2
    assert doc["meanwhile_hit_rate_via_restarted"] == pytest.approx(48 / 128)
    assert doc["meanwhile_hit_rate_via_others"] == pytest.approx(48 / 128)
    assert doc["retried_requests"] == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_with_replicas_kills_one_and_its_successor_ends_equal(tmp_path: Path) -> None:
    """`--routers 2`: the synced replicas, the replicas alone, and a replay in which one
    synced replica is SIGKILLed and restarted with --peer; nothing fails, and the
    restarted replica's index ends equal to the engine's blocks."""
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [
            *DEMO,
            *("--requests", "120", "--speedup", "40", "--dp-size", "2", "--routers", "2"),
            *("--no-chart", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["policies"]) == {
        "kv_aware",
        "replicas_sync",
        "replicas_alone",
        "replicas_restart",
        "round_robin",
    }
    assert all(p["failed"] == 0 and p["requests"] == 120 for p in doc["policies"].values())
    restart = doc["restart"]["replicas_restart"]
    assert restart["done"] and restart["error"] is None
    assert restart["killed_url"] != restart["restarted_url"]
    assert restart["warm_start"]["peer"] is not None  # it loaded the survivor's snapshot
    assert doc["index_consistency"]["restarted_replica"]["consistent"]
    assert restart["index_exactly_equal_after_trace"] is True
    assert "restarted with --peer" in proc.stdout
