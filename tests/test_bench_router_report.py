"""The router benchmark's throughput rows: run names, row labels, shares of the bare ceiling."""

from __future__ import annotations

from typing import Any

from kvevents.bench.report import Figure, headlines
from kvevents.bench.router import _summarise


def _run(requests_per_s: float, p99_ms: float = 2.0) -> dict[str, Any]:
    """The fields of one wrk run that the headlines and the summary read."""
    return {"requests_per_s": requests_per_s, "p50_ms": 1.0, "p99_ms": p99_ms}


def _runs() -> dict[str, Any]:
    """Runs of one benchmark: the bare ceiling and the router at one and two processes."""
    return {
        "bare_2048": _run(20_000),
        "route_2048_workers1": _run(16_000),
        "route_2048_workers2": _run(6_000),
        "query_2048_workers1": _run(15_000),
        "bare_8192": _run(10_000),
        "route_8192_workers1": _run(2_500),
    }


def _rows(result: dict[str, Any]) -> dict[str, Figure]:
    return {f.what: f for f in headlines({"router": result}) if f.benchmark == "router"}


def test_throughput_rows_are_labelled_by_path_prompt_and_workers_only() -> None:
    """Each bare, /route and /query run is one row named by path, prompt length and --workers, with no server label."""
    rows = _rows({"runs": _runs()})
    assert list(rows) == [
        "bare server (parse only), 2048-token prompts",
        "/route, 2048-token prompts, --workers 1",
        "/route, 2048-token prompts, --workers 2",
        "/query, 2048-token prompts, --workers 1",
        "bare server (parse only), 8192-token prompts",
        "/route, 8192-token prompts, --workers 1",
    ]
    assert not any("[" in what for what in rows)


def test_throughput_rows_check_targets_against_the_bare_ceiling() -> None:
    """A row shows its share of the bare run of the same prompts; one process must reach 75% of it."""
    rows = _rows({"runs": _runs()})
    one = rows["/route, 2048-token prompts, --workers 1"]
    assert one.measured.endswith("(80% of bare)")
    assert one.target == ">= 4,000 req/s, p99 <= 10 ms, >= 75% of bare" and one.met is True
    two = rows["/route, 2048-token prompts, --workers 2"]
    assert two.target == ">= 7,000 req/s, p99 <= 10 ms" and two.met is False
    assert rows["/route, 8192-token prompts, --workers 1"].met is True
    slow = _runs() | {"route_2048_workers1": _run(14_000)}
    assert _rows({"runs": slow})["/route, 2048-token prompts, --workers 1"].met is False


def test_results_of_the_former_second_server_are_left_out() -> None:
    """An older results file with suffixed runs and server lists in its setup shows only the unsuffixed runs."""
    older = _runs() | {
        "bare_2048_granian": _run(30_000),
        "route_2048_workers1_granian": _run(1_000),
    }
    setup = {"http_servers": ["uvicorn", "granian"], "http_servers_skipped": {"x": "gone"}}
    assert _rows({"runs": older, "setup": setup}) == _rows({"runs": _runs()})


def test_summary_divides_each_run_by_the_bare_run_of_its_prompts() -> None:
    """The summary's share of bare uses the unsuffixed run names: route_2048_workers1 over bare_2048."""
    results: dict[str, Any] = {"runs": _runs()}
    _summarise(results)
    summary = results["summary"]
    assert summary["route_2048_workers1_share_of_bare"] == 0.8
    assert summary["query_2048_workers1_share_of_bare"] == 0.75
    assert summary["route_8192_workers1_share_of_bare"] == 0.25
    assert not any(key.startswith("bare_") for key in summary)
