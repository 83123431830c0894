"""``--pd-together``'s clients: each in a process of its own, all started at once.

The engine is a plain HTTP server in a thread of the test process, recording which
client each request came from (the prompt says) in arrival order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvevents.bench.pd_load import ViaRouter
from kvevents.bench.pd_router import pd_bodies
from kvevents.bench.pd_together import run_together
from kvevents.errors import KVEventsError
from thread_engine import ThreadEngine


@pytest.fixture
def engine() -> Iterator[ThreadEngine]:
    server = ThreadEngine()
    yield server
    server.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_each_client_runs_in_a_process_of_its_own_and_both_at_once(engine: ThreadEngine) -> None:
    """Two clients run by run_together each report their own run from a process that is
    neither the caller nor the other's, and their requests reach the engine interleaved:
    each one's first request came before the other's last."""
    sends = {
        "a": ViaRouter(engine.url, [{"prompt": [1]}]),
        "b": ViaRouter(engine.url, [{"prompt": [2]}]),
    }
    runs = run_together(sends, connections=2, duration=0.5, warmup=0.1)
    assert set(runs) == {"a", "b"}
    pids = {runs[name]["client_pid"] for name in runs}
    assert len(pids) == 2 and os.getpid() not in pids
    for run in runs.values():
        assert run["requests"] > 0 and run["errors_all"] == 0
        assert run["client_cpu_us_per_request"] > 0
    seen = [json.loads(body)["prompt"][0] for body in engine.bodies()]
    assert seen.index(1) < len(seen) - 1 - seen[::-1].index(2)
    assert seen.index(2) < len(seen) - 1 - seen[::-1].index(1)
    assert len(seen) == runs["a"]["requests_all"] + runs["b"]["requests_all"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_client_that_fails_is_named_in_the_error(engine: ThreadEngine) -> None:
    """A client whose requests cannot be sent at all (a URL that is not HTTP) ends the
    run with an error naming that client and why."""
    sends = {
        "direct": ViaRouter(engine.url, [{"prompt": [1]}]),
        "via": ViaRouter("ftp://127.0.0.1:1", [{"prompt": [2]}]),
    }
    with pytest.raises(KVEventsError, match=r"the via client failed: ValueError: .*http://"):
        run_together(sends, connections=1, duration=0.3, warmup=0.0)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_pd_together_runs_both_clients_at_once_against_real_engines(tmp_path: Path) -> None:
    """`kvevents bench router --pd-only --quick --pd-together --pd-max-tokens 16` runs one
    round of both clients at once with no errors, each with its own CPU per request and
    the router's over the requests it relayed, and says so in its results."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvevents.cli.main", "bench", "router", "--pd-only", "--quick",
         "--pd-together", "--pd-max-tokens", "16", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    pd = doc["results"]["router"]["pd"]
    assert "--pd-together" in doc["command"]
    assert pd["setup"]["together"] is True and pd["setup"]["max_tokens_spread"] == 2
    assert "at once" in pd["target"]["checked_against"]
    assert pd["direct_prefill_failures"] == 0
    (round_,) = pd["rounds"]
    for side in ("direct", "via"):
        run = round_[side]
        assert run["requests"] > 0 and run["errors_all"] == 0
        assert run["client_cpu_us_per_request"] > 0 and "client_pid" not in run
    assert round_["via"]["router_cpu_us_per_request"] > 0


@pytest.mark.parametrize("tokens", [1, 7, 356])
def test_each_prompt_decodes_its_own_count_near_the_one_asked(tokens: int) -> None:
    """Bodies decode within tokens // 8 of the count asked, not all the same count once
    there is room to differ (equal counts lock requests into cohorts), and are the same
    bodies on every call (both clients send the same)."""
    bodies = pd_bodies(64, tokens)
    counts = [b["max_tokens"] for b in bodies]
    spread = tokens // 8
    assert all(tokens - spread <= c <= tokens + spread for c in counts)
    assert set(counts) == {tokens} if spread == 0 else len(set(counts)) > 1
    assert pd_bodies(64, tokens) == bodies
    assert all(len(b["prompt"]) == 2048 for b in bodies)
