"""`kvevents demo --prefill-engines N --decode-engines M`: the disaggregated demo end to end,
its option checks, its baseline's legs and its figures."""

from __future__ import annotations

import asyncio
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from kvevents.cli.main import main
from kvevents.demo.pd_baseline import RoundRobinPrefill
from kvevents.demo.pd_figures import (
    counts_over,
    pooled_bound_hits,
    request_keys,
    summarize_pd,
    targets_met,
    trace_bounds,
    unbounded_hits,
)
from kvevents.demo.replay import Outcome, PolicyRun, Workload, hit_rate, pooled_upper_bound
from kvevents.traces import BLOCK_TOKENS, TraceRequest
from process_support import still_running

DEMO = [sys.executable, "-m", "kvevents.cli.main", "demo"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_short_pd_demo_reports_both_pools_and_stops_everything(tmp_path: Path) -> None:
    """A 300-request P/D demo (2 prefill and 1 decode engines, dp 2): every request served,
    KV-aware prefill choice beats round-robin on the prefill pool's hit rate without
    passing its pooled bound (one cache of the pool's pages), the figures add up, and
    every process it started is stopped."""
    out = tmp_path / "pd.json"
    argv = ["--prefill-engines", "2", "--decode-engines", "1", "--dp-size", "2"]
    proc = subprocess.run(
        [*DEMO, *argv, "--requests", "300", "--json", str(out), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mode"] == "disaggregated" and doc["ok"] is True
    assert doc["settings"]["prefill_engines"] == 2 and doc["settings"]["decode_engines"] == 1
    kv, rr = doc["policies"]["kv_aware"], doc["policies"]["round_robin"]
    for p in (kv, rr):
        assert p["requests"] == 300 and p["failed"] == 0
        assert p["handed_off"] + p["prefills_skipped"] == 300
        assert p["prefill_prompt_tokens"] > 0 and p["blocks_transferred"] > 0
        assert p["prefill_hit_rate"] <= p["prefill_bound_hit_rate"] + 0.005
        assert abs(p["placement_hit_rate"] - p["prefill_hit_rate"]) < 0.01
        # 300 requests fit the pool's 4 x 65,536 pages: the pooled bound's cache evicts
        # nothing, so it hits as the unbounded one does
        assert p["prefill_bound_pages"] == 4 * 65536 and p["bound_of_unbounded"] == 1.0
        assert p["prefill_unbounded_hit_rate"] == p["prefill_bound_hit_rate"]
        assert p["prefill_of_bound"] == p["prefill_of_unbounded"]
        assert p["tokens_computed"] == p["prefill_tokens_computed"] + p["decode_tokens_computed"]
        assert len(p["prompt_tokens_per_rank"]["prefill"]) == 4
        assert len(p["prompt_tokens_per_rank"]["decode"]) == 2
        assert set(p["load_max_over_min"]) == {"prefill", "decode"}
    assert kv["prefill_hit_rate"] > rr["prefill_hit_rate"] > 0
    assert doc["targets"]["beats_round_robin"] is True
    assert doc["trace_bound_hit_rate"] == doc["trace_unbounded_hit_rate"] > 0
    events = doc["events"]
    assert events["lost"] == 0 and events["batches_delivered"] == events["batches_published"] > 0
    assert len(doc["index_consistency"]) == 6  # two runs x three engines
    assert all(c["consistent"] for c in doc["index_consistency"].values())
    assert Path(doc["chart"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Disaggregated serving: the prefill choice" in proc.stdout
    procs = doc["processes"]
    pids = [*procs["prefill"], *procs["decode"], procs["router"], *procs["ranks"]]
    assert len(procs["ranks"]) == 6
    assert still_running(pids) == []


@pytest.mark.slow
def test_sigterm_mid_trace_stops_every_engine_rank_and_the_router() -> None:
    """SIGTERM while the P/D demo replays ends it with code 130, no traceback, and every
    engine, rank and router it started stopped."""
    argv = ["--prefill-engines", "1", "--decode-engines", "1", "--dp-size", "1"]
    proc = subprocess.Popen(
        [*DEMO, *argv, "--requests", "400", "--no-chart"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        engines: list[str] = []
        deadline = time.monotonic() + 90
        while not (line := lines.get(timeout=max(0.1, deadline - time.monotonic()))).startswith(
            "replaying"
        ):
            if " engine ready: " in line:
                engines.append(line.split()[-1])
        ranks = [
            r["pid"]
            for url in engines
            for r in httpx.get(f"{url}/health", timeout=10).json()["ranks"]
        ]
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(p) for p in f.read().split()]
        proc.send_signal(signal.SIGTERM)
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
    assert len(engines) == 2 and len(children) == 3 and len(ranks) == 2
    assert still_running(children + ranks) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill-engines", "2"], "--prefill-engines needs --decode-engines"),
        (["--decode-engines", "1"], "--decode-engines needs --prefill-engines"),
        (
            ["--prefill-engines", "1", "--decode-engines", "1", "--routers", "2"],
            "--routers 2 cannot be combined with --prefill-engines",
        ),
        (
            ["--prefill-engines", "1", "--decode-engines", "1", "--router-args", "--decode x"],
            "--router-args gives --decode",
        ),
    ],
)
def test_bad_pd_option_combinations_exit_2_naming_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A P/D flag without its partner, with --routers, or with pools in --router-args is
    refused before anything starts: exit code 2 and a message naming the option."""
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvevents demo: error: ") and message in err


def test_a_pool_of_no_engines_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    """--prefill-engines 0 is a usage error naming the option."""
    with pytest.raises(SystemExit) as info:
        main(["demo", "--prefill-engines", "0", "--decode-engines", "1"])
    assert info.value.code == 2
    assert "argument --prefill-engines: 0: must be" in capsys.readouterr().err


def test_the_baseline_sends_both_legs_to_prefill_ranks_in_turn() -> None:
    """The baseline keeps the router's decode holder, sends each handed-off request's legs
    with one room to the next prefill rank in turn, and a skipped one to the decode alone."""
    seen: list[tuple[str, dict[str, Any]]] = []
    skip = {3}

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((f"{request.url.host}:{request.url.port}{request.url.path}", body))
        if request.url.path == "/route":
            skipped = len([s for s in seen if s[0].endswith("/route")]) - 1 in skip
            return httpx.Response(
                200, json={"worker": "http://d:1", "dp_rank": 1, "prefill_skipped": skipped}
            )
        n = len(body["input_ids"])
        return httpx.Response(
            200, json={"dp_rank": body["routed_dp_rank"], "prompt_tokens": n, "cached_tokens": 0}
        )

    baseline = RoundRobinPrefill(
        "http://r:9",
        [("http://p1:2", 0), ("http://p1:2", 1), ("http://p2:3", 0)],
        {"http://p1:2": ("p1", 70), "http://p2:3": ("p2", 80)},
    )

    async def go() -> list[Outcome]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            out = []
            for i in range(5):
                body = msgspec.json.encode({"input_ids": [i, 1, 2], "max_new_tokens": 2})
                out.append(await baseline(client, i, body, time.monotonic()))
            return out

    outcomes = asyncio.run(go())
    assert [o.error for o in outcomes] == [None] * 5
    prefills = [(where, b) for where, b in seen if where.startswith("p")]
    assert [(w, b["routed_dp_rank"]) for w, b in prefills] == [
        ("p1:2/generate", 0),
        ("p1:2/generate", 1),
        ("p2:3/generate", 0),
        ("p1:2/generate", 0),
    ]
    decodes = [b for where, b in seen if where.startswith("d")]
    assert len(decodes) == 5 and all(b["routed_dp_rank"] == 1 for b in decodes)
    handed = [b for b in decodes if "bootstrap_room" in b]
    assert len(handed) == 4
    assert [b["bootstrap_room"] for b in handed] == [b["bootstrap_room"] for _, b in prefills]
    assert [b["disagg_prefill_dp_rank"] for b in handed] == [0, 1, 0, 0]
    assert [(b["bootstrap_host"], b["bootstrap_port"]) for _, b in prefills][2] == ("p2", 80)
    assert outcomes[3].routed is not None and outcomes[3].routed["prefill"] is None
    assert outcomes[2].routed is not None
    assert outcomes[2].routed["prefill"] == {"worker": "http://p2:3", "dp_rank": 0}


def test_unbounded_hits_are_the_leading_keys_each_place_has_seen() -> None:
    """A request's hit is the run of its leading keys its place has already seen; other
    places' keys do not count, and unsent requests get None."""
    keys = [[1, 2, 3], [1, 2, 9], [1, 2, 3, 4], [1, 2], [5]]
    partial = [49, 49, 65, 33, 17]  # each prompt ends in a partial block
    assert unbounded_hits(keys, partial, ["a", "a", "b", None, "a"], 16) == [0, 32, 0, None, 0]
    assert unbounded_hits(keys, partial, ["a"] * 5, 16) == [0, 32, 48, 32, 0]


def test_an_unbounded_hit_leaves_out_a_block_aligned_prompts_last_block() -> None:
    """A prompt ending on a block boundary reuses every block but its last, which an engine
    computes again, while all its blocks are stored for the requests after it."""
    keys = [[1, 2, 3], [1, 2, 9], [1, 2, 3, 4], [1, 2], [5]]
    aligned = [48, 48, 64, 32, 16]
    assert unbounded_hits(keys, aligned, ["a"] * 5, 16) == [0, 32, 48, 16, 0]
    assert unbounded_hits([[1, 2], [1, 2]], [32, 33], ["a", "a"], 16) == [0, 32]


def _workload(ids: list[list[int]]) -> Workload:
    """A workload of one request per list of hash ids (each id a block of trace tokens)."""
    requests = tuple(TraceRequest(float(i), len(h) * BLOCK_TOKENS, 4, h) for i, h in enumerate(ids))
    return Workload(requests, 1.0, 4, "test")


def test_the_pooled_bound_is_one_cache_of_the_pools_pages_evicting_as_an_engine_does() -> None:
    """With room for every page the pooled bound's cache hits exactly what the unbounded
    one does; with less, it evicts as an engine does (least recent leaf first); an unsent
    request is neither served nor stored."""
    workload = _workload([[1, 2], [1, 2, 3], [7, 8], [1, 2, 3, 4]])
    keys = request_keys(workload, 16)
    sent = [True, True, True, True]
    unbounded = unbounded_hits(keys, [r.input_length for r in workload.requests], ["pool"] * 4, 16)
    assert pooled_bound_hits(workload, sent, 16, 10_000) == unbounded
    assert unbounded == [0, 2 * BLOCK_TOKENS, 0, 3 * BLOCK_TOKENS]
    # room for three hash ids' pages: [7, 8] evicts the chain 1, 2, 3 leaf first, so its
    # head (id 1) is all the last request finds
    three_ids = 3 * BLOCK_TOKENS // 16
    assert pooled_bound_hits(workload, sent, 16, three_ids) == [
        0,
        2 * BLOCK_TOKENS,
        0,
        BLOCK_TOKENS,
    ]
    assert pooled_bound_hits(workload, [True, False, True, True], 16, 10_000) == [
        0,
        None,
        0,
        2 * BLOCK_TOKENS,
    ]
    assert pooled_bound_hits(workload, [False] * 4, 16, 10_000) == [None] * 4


def test_the_pooled_bound_is_the_one_pool_demos_bound_on_the_legs_sent() -> None:
    """The P/D pooled bound of the requests sent is the one-pool demo's pooled bound of
    those requests alone: one implementation of the pooled cache."""
    workload = _workload([[1, 2], [5, 6], [1, 2, 3], [5, 9], [1, 2, 3, 4], [5, 6, 7]])
    sent = [True, False, True, True, False, True]
    alone = Workload(
        tuple(r for r, s in zip(workload.requests, sent, strict=True) if s), 1.0, 4, "test"
    )
    pages = 5 * BLOCK_TOKENS // 16
    hits = pooled_bound_hits(workload, sent, 16, pages)
    assert [h for h in hits if h is not None] == [
        cached for _, cached in pooled_upper_bound(alone, 16, pages)
    ]


def test_an_unbounded_cache_never_hits_less_than_the_pooled_bound() -> None:
    """On a small workload that makes the pooled bound's cache evict, the unbounded
    cache's hit rate (per request and in all) is at least the pooled bound's, and above it."""
    workload = _workload([[1, 2, 3], [4, 5, 6], [1, 2, 3, 7], [8, 9], [4, 5, 6, 7], [1, 2, 3]])
    keys = request_keys(workload, 16)
    sent = [True] * len(workload)
    pages = 4 * BLOCK_TOKENS // 16
    bounded = pooled_bound_hits(workload, sent, 16, pages)
    lengths = [r.input_length for r in workload.requests]
    unbounded = unbounded_hits(keys, lengths, ["pool"] * len(workload), 16)
    assert all(u >= b for u, b in zip(unbounded, bounded, strict=True))  # type: ignore[operator]
    figures = trace_bounds(workload, keys, 16, pages)
    assert figures["trace_unbounded_hit_rate"] > figures["trace_bound_hit_rate"] > 0
    pairs = pooled_upper_bound(workload, 16, pages)
    assert figures["trace_bound_hit_rate"] == hit_rate(pairs)


def test_pd_figures_add_up_from_outcomes_and_engine_counters() -> None:
    """The prefill hit rate is the engines' counters', the pooled bound, the unbounded
    cache and placement come from the requests sent, skipped and handed-off requests are
    told apart by the router's verdict, and a failed request counts as failed only."""
    b = BLOCK_TOKENS  # one page per hash id

    def handed(rank: int, cached: int = 3 * b) -> Outcome:
        routed = {"prefill": {"worker": "p", "dp_rank": rank}, "prefill_skipped": False}
        return Outcome(0, 4 * b, cached, 0.0, 0.01, routed=routed)

    skipped = Outcome(0, 4 * b, 3 * b, 0.0, 0.02, routed={"prefill": None, "prefill_skipped": True})
    failed = Outcome(-1, 0, 0, 0.0, 0.0, error="HTTP 502")
    run = PolicyRun(
        "kv_aware", [handed(0), handed(1), handed(0, cached=3 * b), skipped, failed], 1.0
    )
    workload = _workload([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 7], [1, 2, 3, 7], [9]])
    keys = request_keys(workload, b)
    counts = {
        "prefill": {("p", 0): (8 * b, 3 * b), ("p", 1): (4 * b, 0)},
        "decode": {("d", 0): (16 * b, 0)},
    }
    figures, curves = summarize_pd(run, workload, keys, counts, page_size=b, pages=10_000)
    assert figures["requests"] == 4 and figures["failed"] == 1
    assert figures["handed_off"] == 3 and figures["prefills_skipped"] == 1
    assert figures["prefill_hit_rate"] == 3 / 12
    assert figures["prefill_bound_pages"] == 10_000
    assert figures["prefill_bound_hit_rate"] == figures["prefill_unbounded_hit_rate"] == 6 / 12
    assert figures["prefill_of_bound"] == figures["prefill_of_unbounded"] == (3 / 12) / (6 / 12)
    assert curves["placement"] == [(4 * b, 0), (4 * b, 0), (4 * b, 3 * b)]
    assert curves["pooled"] == [(4 * b, 0), (4 * b, 3 * b), (4 * b, 3 * b)]
    assert figures["prefill_tokens_computed"] == 9 * b
    assert figures["decode_tokens_computed"] == b + b + b + b
    assert figures["blocks_transferred"] == 12
    assert figures["load_max_over_min"] == {"prefill": 2.0, "decode": 1.0}
    assert counts_over(counts, {"prefill": {("p", 0): (b, b // 2)}, "decode": {}}) == {
        "prefill": {("p", 0): (7 * b, 3 * b - b // 2), ("p", 1): (4 * b, 0)},
        "decode": {("d", 0): (16 * b, 0)},
    }
    rr = dict(figures, prefill_hit_rate=0.1, prefill_of_bound=0.2)
    met = targets_met({"kv_aware": figures, "round_robin": rr})
    assert met["beats_round_robin"] is True and met["prefill_of_bound_met"] is False
    assert met["load_met"] == {"prefill": False, "decode": True}
