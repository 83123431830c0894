"""What a load note costs: the in-process measure against a real nats-server, and the
interleaved wrk rounds' summary and headline rows."""

from __future__ import annotations

import pytest
from nats_support import NatsServer

from kvevents.bench.note_cost import _summary, note_cpu_in_process
from kvevents.bench.report import headlines


@pytest.mark.slow
def test_in_process_note_cost_publishes_one_note_per_recorded_decision() -> None:
    """With notes on, every recorded decision becomes a note published to NATS; with
    them off, none; both sides are timed in every round."""
    server = NatsServer()
    try:
        doc = note_cpu_in_process(server.url, rounds=2, count=500)
    finally:
        server.kill()
    assert doc["connected"]
    assert doc["notes_sent"] == 2 * 500  # the "on" side of both rounds, nothing else
    assert doc["notes_dropped"] == 0
    assert len(doc["us_per_decision_off"]) == len(doc["us_per_decision_on"]) == 2
    assert all(us > 0 for us in doc["us_per_decision_off"] + doc["us_per_decision_on"])


def _run(rate: float, cpu: float) -> dict[str, float]:
    return {
        "requests_per_s": rate,
        "p99_ms": 10.0,
        "requests": 1000,
        "errors": 0,
        "cpu_us_per_request": cpu,
    }


def test_summary_takes_medians_and_the_report_judges_the_5_percent_target() -> None:
    """The cost is 1 - median(on)/median(off) of throughput; per-round ratios show the
    spread; CPU per request is compared the same way; the headline says met or not."""
    runs = {
        "off": [_run(1000, 400), _run(900, 420), _run(1100, 380)],
        "on": [_run(960, 410), _run(990, 430), _run(800, 390)],
    }
    before = {"notes": {"sent": 10}, "sync": {"dropped": 0}}
    after = {"notes": {"sent": 3010}, "sync": {"dropped": 0, "connected": True}}
    doc = _summary(runs, before, after)
    assert doc["cost"] == 1 - 960 / 1000
    assert doc["round_ratios_on_over_off"] == [0.96, 990 / 900, 800 / 1100]
    assert doc["cpu_cost"] == 410 / 400 - 1
    assert doc["notes_sent"] == 3000 == doc["requests_on"]
    rows = {f.what: f for f in headlines({"router": {"runs": {}, "note_cost": doc}})}
    row = rows["/route recording, --sync off / on (median of 3 interleaved rounds)"]
    assert row.met is True and "4.0%" in row.measured
    runs["on"] = [_run(900, 410), _run(900, 430), _run(900, 390)]
    doc = _summary(runs, before, after)
    rows = {f.what: f for f in headlines({"router": {"runs": {}, "note_cost": doc}})}
    assert rows["/route recording, --sync off / on (median of 3 interleaved rounds)"].met is False
