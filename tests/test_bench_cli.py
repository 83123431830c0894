"""`kvevents bench`: one entry point, one JSON document, and the README section made from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvevents.bench.report import (
    MARKER_END,
    MARKER_START,
    headlines,
    render_markdown,
    splice_readme,
)
from kvevents.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
UPDATE_SCRIPT = ROOT / "scripts" / "update-readme-performance"


def _routing_result(kv: float = 0.15, rr: float = 0.06, bound: float = 0.16) -> dict[str, Any]:
    """The fields of a routing (demo) results document that the headlines read."""
    return {
        "settings": {"requests": 1000, "max_blocks_per_rank": 65536, "page_size": 16},
        "policies": {
            "kv_aware": {"hit_rate": kv, "load_max_over_min": 1.1},
            "round_robin": {"hit_rate": rr, "load_max_over_min": 1.05},
        },
        "upper_bound_hit_rate": bound,
        "events": {"batches_published": 10, "batches_delivered": 10, "lost": 0},
        "elapsed_s": 61.0,
    }


@pytest.mark.slow
def test_bench_index_quick_end_to_end(tmp_path: Path) -> None:
    """`kvevents bench index --quick --json OUT` runs the index benchmark, writes one JSON document and prints the headline table."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvevents.cli.main",
            "bench",
            "index",
            "--quick",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "COLUMNS": "160"},
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["command"] == f"kvevents bench index --quick --json {out}"
    assert doc["quick"] is True and doc["errors"] == {}
    assert set(doc["results"]) == {"index"}
    figures = doc["results"]["index"]["results"]["8"]
    assert figures["match_p99_us"] > 0 and figures["ingest_block_ops_per_s"] > 0
    assert "W=8: match p50 / p99" in proc.stdout
    assert "ingest block-ops/s" in proc.stdout

    markdown = subprocess.run(
        [sys.executable, "-m", "kvevents.cli.main", "bench", "--markdown", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert markdown.returncode == 0, markdown.stderr
    assert f"Measured with `kvevents bench index --quick --json {out}`" in markdown.stdout
    assert "| W=8: ingest block-ops/s |" in markdown.stdout
    assert "(quick settings: smoke figures only)" in markdown.stdout


def test_markdown_of_a_missing_results_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Asking for the README section without a results file exits 2 and says to run the benchmarks first."""
    missing = tmp_path / "none.json"
    assert main(["bench", "--markdown", "--json", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"kvevents bench: error: --json {missing}: cannot read it" in err
    assert "run `kvevents bench all` first" in err


def test_unknown_benchmark_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown benchmark name is refused by the parser with exit code 2, listing the choices."""
    with pytest.raises(SystemExit) as info:
        main(["bench", "gpu"])
    assert info.value.code == 2
    assert "invalid choice: 'gpu'" in capsys.readouterr().err


def test_routing_headlines_check_the_targets() -> None:
    """The routing headlines compare KV-aware with the bound (>= 90%) and round-robin, and load max/min with 1.3."""
    rows = {f.what: f for f in headlines({"routing": _routing_result()})}
    assert rows["KV-aware / upper bound"].measured == "93.8%"
    assert rows["KV-aware / upper bound"].met is True
    assert rows["KV-aware / round-robin"].measured == "2.50x"
    assert rows["load max/min, KV-aware"].met is True
    assert rows["batches published / delivered / lost"].met is True
    weak = {f.what: f for f in headlines({"routing": _routing_result(kv=0.12)})}
    assert weak["KV-aware / upper bound"].met is False


def test_headlines_of_unreadable_results_say_so() -> None:
    """A results document missing a field yields a row saying so instead of crashing."""
    rows = headlines({"engine": {"total": {}}})
    assert [(f.benchmark, f.what, f.met) for f in rows] == [("engine", "results unreadable", False)]


def test_markdown_lists_failed_benchmarks() -> None:
    """A benchmark that failed appears in the README section with its error."""
    doc = {
        "command": "kvevents bench all",
        "date": "2026-01-01",
        "machine": {"cpus": 2, "python": "3.11.7", "machine": "x86_64"},
        "results": {"routing": _routing_result()},
        "errors": {"publisher": "RuntimeError: boom"},
    }
    text = render_markdown(doc)
    assert text.startswith("Measured with `kvevents bench all` on 2026-01-01, on a 2-core")
    assert "| KV-aware / upper bound | 93.8% | >= 90% | yes |" in text
    assert "- `publisher` did not run: RuntimeError: boom" in text


def test_splice_replaces_only_the_marked_section() -> None:
    """Only the text between the markers changes; missing markers are added under a Performance heading."""
    readme = f"# x\n\nintro\n\n## Performance\n\n{MARKER_START}\nold\n{MARKER_END}\n\n## After\n"
    out = splice_readme(readme, "new table\n")
    assert (
        out
        == f"# x\n\nintro\n\n## Performance\n\n{MARKER_START}\nnew table\n{MARKER_END}\n\n## After\n"
    )
    assert splice_readme(out, "new table") == out
    added = splice_readme("# x\n", "fresh")
    assert added == f"# x\n\n## Performance\n\n{MARKER_START}\nfresh\n{MARKER_END}\n"
    with pytest.raises(ValueError, match="only one of"):
        splice_readme(f"# x\n{MARKER_END}\n", "fresh")


@pytest.mark.slow
def test_update_script_rewrites_and_checks_a_readme(tmp_path: Path) -> None:
    """scripts/update-readme-performance writes the section from a results file, then --check finds it current."""
    results = tmp_path / "bench.json"
    doc = {"command": "kvevents bench routing", "date": "2026-01-01", "machine": {}}
    results.write_text(json.dumps(doc | {"results": {"routing": _routing_result()}}))
    readme = tmp_path / "README.md"
    readme.write_text("# kvevents\n\nSome text.\n")
    args = [sys.executable, str(UPDATE_SCRIPT), "--json", str(results), "--readme", str(readme)]
    check = subprocess.run([*args, "--check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 1 and "out of date" in check.stdout
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = readme.read_text()
    assert text.startswith("# kvevents\n\nSome text.\n\n## Performance\n")
    assert "| hit rate, KV-aware | 15.0% |  |  |" in text
    check = subprocess.run([*args, "--check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "current" in check.stdout


def test_a_failing_benchmark_is_recorded_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One benchmark raising leaves its error in the document while the next one still runs."""
    from rich.console import Console

    from kvevents.bench import main as bench

    def broken(quick: bool) -> dict[str, Any]:
        raise RuntimeError("subscriber process died")

    monkeypatch.setitem(bench.BENCHMARKS, "publisher", broken)
    monkeypatch.setitem(bench.BENCHMARKS, "index", lambda quick: {"quick": quick})
    doc = bench.run_benchmarks(
        ["publisher", "index"], quick=True, command="kvevents bench", console=Console(quiet=True)
    )
    assert doc["errors"] == {"publisher": "RuntimeError: subscriber process died"}
    assert doc["results"] == {"index": {"quick": True}}


@pytest.mark.parametrize(
    ("via", "shown", "met"), [(30.5, "(+2.5 ms)", False), (27.0, "(-1.0 ms)", True)]
)
def test_the_completions_headline_signs_what_the_router_adds(
    via: float, shown: str, met: bool
) -> None:
    """The router's added p50 is written with its sign either way (a negative one as
    ``-1.0``, not ``+-1.0``) and compared with +2 ms."""
    runs = {"completions_direct": {"p50_ms": 28.0}, "completions_via_router": {"p50_ms": via}}
    rows = {f.what: f for f in headlines({"router": {"runs": runs}})}
    row = rows["/v1/completions p50: engine direct / through the router"]
    assert row.measured.endswith(shown) and row.met is met
