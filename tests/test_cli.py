"""The `kvevents` command line as a user meets it: version, help, errors, option names."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from kvevents.cli.main import _COMMANDS
from process_support import run_kvevents

pytestmark = pytest.mark.slow  # every test runs the command as a process

kvevents = run_kvevents


def test_version_prints_the_installed_version() -> None:
    """`kvevents --version` prints the distribution's version and exits 0."""
    result = kvevents("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kvevents {importlib.metadata.version('kvevents')}"


@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_every_help_shows_the_defaults(command: str) -> None:
    """Every command's --help says what each option defaults to."""
    result = kvevents(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "(default:" in result.stdout


@pytest.mark.parametrize("command", ["engine", "router", "watch"])
def test_long_running_commands_take_a_log_level(command: str) -> None:
    """engine, router and watch accept --log-level, and refuse a level that does not exist."""
    assert "--log-level" in kvevents(command, "--help").stdout
    result = kvevents(command, "--log-level", "loud")
    assert result.returncode == 2
    assert f"kvevents {command}: error: argument --log-level: invalid choice" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # found by argparse: a bound declared in kvevents.types
        (("engine", "--max-blocks", "0"), "argument --max-blocks: 0: must be an integer >= 1"),
        (("router", "--engine", "x", "--port", "70000"), "argument --port: 70000: must be a port"),
        (("watch", "--endpoint", "tcp://h:1", "--duration", "-1"), "argument --duration: -1"),
        # found by the command: a KVEventsError that is a ValueError
        (("router",), "give at least one --engine URL"),
        (("watch",), "give at least one engine URL"),
        (("engine", "--kv-events-config", "{"), "is not valid JSON"),
    ],
)
def test_errors_have_one_format_and_exit_2(args: tuple[str, ...], message: str) -> None:
    """A usage or configuration error prints `kvevents CMD: error: message` on stderr and exits 2,
    with no Python class name or traceback in it."""
    result = kvevents(*args)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvevents {args[0]}: error: "), result.stderr
    assert message in last
    assert not re.search(r"\b[A-Z][A-Za-z]*Error: ", result.stderr), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("spelling", ["--block-size", "--page-size"])
def test_block_size_has_one_name_and_keeps_the_old_one(spelling: str) -> None:
    """The engine's tokens per block is --block-size, as in router and watch; SGLang's
    --page-size is the same option (a bad value names both)."""
    result = kvevents("engine", spelling, "0")
    assert result.returncode == 2
    assert "argument --block-size/--page-size: 0: must be an integer >= 1" in result.stderr
    assert "--block-size B, --page-size B" in kvevents("engine", "--help").stdout


def test_demo_takes_the_old_page_size_spelling() -> None:
    """`kvevents demo --page-size` is still accepted (hidden), checked like --block-size."""
    result = kvevents("demo", "--page-size", "0")
    assert result.returncode == 2
    assert "kvevents demo: error: argument --page-size: 0: must be an integer >= 1" in (
        result.stderr
    )
    assert "--page-size" not in kvevents("demo", "--help").stdout


def test_watch_jsonl_is_the_name_and_json_is_kept() -> None:
    """watch's JSON Lines output is --jsonl (shown in --help); --json is the hidden old name."""
    help_text = kvevents("watch", "--help").stdout
    assert "--jsonl" in help_text
    assert re.search(r"--json\b(?!l)", help_text) is None
    for spelling in ("--jsonl", "--json"):
        result = kvevents("watch", spelling, "--count", "0", "--endpoint", "tcp://h:1")
        assert result.returncode == 2  # parsed: the spelling is known, the count is refused
        assert "argument --count: 0" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("router", "--engin", "http://127.0.0.1:30000"), "--engin (did you mean --engine?)"),
        (
            ("engine", "--dp-sise", "2", "--prot", "0"),
            "--dp-sise (did you mean --dp-size?) --prot (did you mean --port?)",
        ),
        (("watch", "--jsn"), "--jsn (did you mean --jsonl?)"),
        # an abbreviation is no option: it would turn ambiguous as options are added
        (
            ("router", "--engine", "http://h:1", "--sync-nam", "a"),
            "--sync-nam (did you mean --sync-name?)",
        ),
        (("engine", "--qqqq=1"), "--qqqq"),
        (("router", "--engine", "http://h:1", "stray"), "stray"),
    ],
)
def test_an_unknown_option_is_named_with_the_one_meant(args: tuple[str, ...], message: str) -> None:
    """An argument the command does not know exits 2 with the command's own usage (not
    kvevents') and one line naming it, with the option meant when one is close."""
    result = kvevents(*args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"usage: kvevents {args[0]} "), result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"kvevents {args[0]}: error: unrecognized arguments: {message}"
