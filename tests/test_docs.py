"""The documentation cannot drift: README.md and docs/*.md are checked against the code.

Every relative link resolves (the file, and the ``#anchor`` by GitHub's heading slugs);
every ``kvevents ...`` command line of their shell blocks is parsed by the command's own
argument parser (and the engines, keys and kv-events config it names are accepted); the
pages' Python examples run and their engines files load; the deployment page's bounds
table states the parsers' defaults; the performance table lives where
``scripts/update-readme-performance`` writes it; and the README's quickstarts with the
simulated engine really route, run as the processes a user starts. Parsing in process
(``kvevents.cli.main.build_parser``) rather than running ``--help`` keeps the hundreds of
lines fast.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from router_support import wait_until

from docs_support import (
    ROOT,
    Block,
    Command,
    code_blocks,
    commands,
    doc_pages,
    links,
    segments,
    slugs,
)
from kvevents.cli.engine_args import curve_options, endpoint_specs, engine_specs, pool_specs
from kvevents.cli.main import build_parser, main
from kvevents.publish.config import KVEventsConfig
from kvevents.subscribe.engine_spec import load_engines_file
from quickstart_support import quickstart_blocks, run_quickstart, send_curl, value_of

PAGES = doc_pages()
COMMANDS = [command for page in PAGES for command in commands(page)]
README = ROOT / "README.md"
UPDATE_SCRIPT = ROOT / "scripts" / "update-readme-performance"


def _parse(argv: list[str]) -> Any:
    """``kvevents ARGV`` parsed in process by the command's parser; AssertionError with
    argparse's message when it refuses."""
    err = io.StringIO()
    command = argv[0] if argv else ""
    try:
        with contextlib.redirect_stderr(err):
            return build_parser(command).parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"kvevents {shlex.join(argv)}: {err.getvalue().strip()}") from exc


PLACEHOLDERS = {"URL": "http://127.0.0.1:30000", "PORT": "30000", "N": "2", "FILE": "engines.toml"}
"""Words a command line may use in place of a value, and the value checked instead."""


def _filled(argv: list[str]) -> list[str]:
    """``argv`` with placeholders and shell expansions (``--curve-server-key="$(...)"``,
    the one a page uses) given valid values."""
    filled = []
    for word in argv:
        flag, equals, value = word.partition("=")
        if equals and "$" in value and flag == "--curve-server-key":
            word = f"{flag}={zmq.curve_keypair()[0].decode()}"
        filled.append(PLACEHOLDERS.get(word, word))
    return filled


def test_every_page_is_read() -> None:
    """The pages read are the README and every docs page, and their command lines are found."""
    names = {page.name for page in PAGES}
    assert {"README.md", "deployment.md", "security.md", "performance.md"} <= names
    assert len(names) >= 10
    assert len(COMMANDS) >= 20, [str(c) for c in COMMANDS]


def test_anchors_follow_github_slugs(tmp_path: Path) -> None:
    """Headings become GitHub's anchors: lower case, punctuation and code marks dropped,
    spaces as hyphens, repeats numbered; headings inside code blocks are none."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n## The replicas' NATS bus (`--sync`)\n## 5. Layers\n"
        "## Quickstart: disaggregated prefill/decode\n## Title\n```\n## not a heading\n```\n"
    )
    assert slugs(page) == {
        "title",
        "the-replicas-nats-bus---sync",
        "5-layers",
        "quickstart-disaggregated-prefilldecode",
        "title-1",
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link of the page names a file that exists, and an anchor that is
    one of the target page's headings."""
    broken = []
    for link in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link.target):  # https:, mailto:
            continue
        path, _, anchor = link.target.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{page.name}:{link.line}: {link.target}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in slugs(target):
            broken.append(f"{page.name}:{link.line}: {link.target}: no such heading")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_command_line_parses(
    command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command line parses with the command's own parser, the engines it names are
    valid engine descriptions, and its key files and kv-events config are accepted once
    the page's earlier ``kvevents keygen`` lines have made the keys (in the folders the
    page makes for them)."""
    monkeypatch.chdir(tmp_path)
    for earlier in COMMANDS:
        if (
            earlier.page == command.page
            and earlier.argv[0] == "keygen"
            and earlier.line < command.line
        ):
            (tmp_path / value_of(earlier.argv, "--dir", ".")).mkdir(parents=True, exist_ok=True)
            assert main(earlier.argv) == 0, earlier
    args = _parse(_filled(command.argv))
    if args.command in ("router", "watch"):
        engine_specs(args)
        pool_specs(args) if args.command == "router" else endpoint_specs(args)
        key_file = args.curve_secret_key_file
        if key_file is None or Path(key_file).exists():
            curve_options(args)
    if args.command == "engine" and args.kv_events_config is not None:
        KVEventsConfig.from_json(args.kv_events_config)


@pytest.mark.parametrize(
    "block",
    [b for page in PAGES for b in code_blocks(page) if "[[engines]]" in b.text],
    ids=lambda b: f"{b.page.name}:{b.line}",
)
def test_engines_file_example_loads(block: Block, tmp_path: Path) -> None:
    """An engines file shown in the docs is one ``--engines-file`` reads."""
    path = tmp_path / f"engines.{block.language}"
    path.write_text(block.text)
    specs = load_engines_file(path)
    assert specs and all(spec.url.startswith("http") for spec in specs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "block",
    [b for page in PAGES if page != README for b in code_blocks(page) if b.language == "python"],
    ids=lambda b: f"{b.page.name}:{b.line}",
)
def test_python_example_runs(block: Block) -> None:
    """A docs page's Python example runs to its end (its fixed ports made OS-chosen; the
    README's example is tests/test_readme.py's)."""
    code = block.text.replace(":5557", ":0").replace(":5600", ":0")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


def test_a_wrong_command_line_is_caught() -> None:
    """The check refuses what the command refuses: an unknown option, or an option given
    before the --engine it belongs to."""
    with pytest.raises(AssertionError, match="unrecognized arguments: --no-such-flag"):
        _parse(["router", "--engine", "http://127.0.0.1:30000", "--no-such-flag"])
    with pytest.raises(AssertionError, match="--kv-endpoint belongs to an --engine"):
        _parse(["router", "--kv-endpoint", "tcp://127.0.0.1:5557"])


_UNITS = {"s": 1, "MiB": 1 << 20, "KiB": 1 << 10, "entries": 1, "": 1}


def _bounds() -> Iterator[tuple[str, str, float]]:
    """(command, flag, default) of each row of deployment.md's bounds table that names a
    command's flags and a number for each."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    table = text[text.index("## Bounds") :]
    for row in re.findall(r"^\| (router|engine) (.*?) \| (.*?) \| .*\|$", table, flags=re.M):
        command, what, defaults = row
        flags = re.findall(r"`(--[a-z-]+)`", what.split(":")[0])
        values = [v.strip() for v in defaults.split(",") if v.strip()] if flags else []
        if len(values) != len(flags):  # a number written with thousands separators
            values = [defaults.strip()]
        for flag, value in zip(flags, values, strict=False):
            number = re.fullmatch(r"([\d,.]+) ?(s|MiB|KiB|entries|)", value)
            if number:
                yield command, flag, float(number.group(1).replace(",", "")) * _UNITS[number[2]]


def test_bounds_table_states_the_defaults() -> None:
    """Each default of deployment.md's bounds table is the command's parser default."""
    rows = list(_bounds())
    assert len(rows) >= 10, rows
    defaults = {cmd: vars(_parse([cmd])) for cmd in ("router", "engine")}
    wrong = [
        f"{cmd} {flag}: the table says {value:g}, the parser {defaults[cmd][flag[2:].replace('-', '_')]}"
        for cmd, flag, value in rows
        if defaults[cmd][flag[2:].replace("-", "_")] != value
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_performance_table_lives_in_docs_performance(tmp_path: Path) -> None:
    """The generated table sits between docs/performance.md's markers, the README holds no
    copy, and the update script checks that page by default."""
    page = (ROOT / "docs" / "performance.md").read_text()
    assert page.count("<!-- performance:start -->") == page.count("<!-- performance:end -->") == 1
    assert "<!-- performance:" not in README.read_text()
    results = tmp_path / "bench.json"
    results.write_text(json.dumps({"command": "kvevents bench index", "date": "2026-01-01"}))
    done = subprocess.run(
        [sys.executable, str(UPDATE_SCRIPT), "--json", str(results), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert (
        done.stdout.strip()
        == f"{ROOT / 'docs' / 'performance.md'}: performance section out of date"
    )


@pytest.mark.slow
def test_simulated_engine_quickstart_routes() -> None:
    """The README's first quickstart, run as written: the completion is answered, /route
    answers 200, and once the router's index holds the completion's blocks /route
    chooses the rank the completion went to, with those blocks matched."""
    (block,) = quickstart_blocks(README, "Quickstart: the simulated engine")
    with contextlib.ExitStack() as stack:
        (completion, route), urls = run_quickstart(block, stack)
        assert completion.status_code == 200, completion.text
        assert route.status_code == 200, route.text
        rank = int(completion.headers["x-kvevents-dp-rank"])
        (curl,) = [w for _, _, w in segments(block) if w[0] == "curl" and "/route" in " ".join(w)]
        answers: list[dict[str, Any]] = []

        def matched() -> bool:
            answers.append(send_curl(curl, urls).json())
            return bool(answers[-1]["scores"][0]["matched"]["gpu"])

        wait_until(matched, timeout=30.0, what="the completion's blocks in the router's index")
        assert answers[-1]["dp_rank"] == rank, answers[-1]


@pytest.mark.slow
def test_disaggregated_quickstart_routes() -> None:
    """The README's disaggregated quickstart with the simulated engine, run as written:
    the completion is answered through a prefill and a decode instance, and says so."""
    (block,) = quickstart_blocks(README, "Quickstart: disaggregated prefill/decode")
    with contextlib.ExitStack() as stack:
        (completion,), _ = run_quickstart(block, stack)
        assert completion.status_code == 200, completion.text
        assert completion.headers["x-kvevents-prefill"] in ("cache", "prediction", "load")
        assert completion.json()["choices"][0]["text"], completion.json()
