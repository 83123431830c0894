"""``kvevents router --help`` and ``kvevents engine --help`` read top to bottom: the basic
options first, then one group per concern; every option listed once, each help saying
what its own option does; and each bound described as docs/deployment.md's table does."""

from __future__ import annotations

import argparse
import re

import pytest

from docs_support import ROOT
from kvevents.cli.main import build_parser

COMMANDS = ("engine", "router", "watch")

SECTIONS = {
    "router": [
        "options",
        "engines",
        "tuning: routing",
        "tuning: timeouts and bounds",
        "security",
        "replicas",
        "disaggregation",
    ],
    "engine": [
        "options",
        "simulation",
        "tuning: timeouts and bounds",
        "security",
        "disaggregation",
    ],
}
"""The sections of each command's --help, in order: its basic options first."""

PLACED = {
    "router": {
        "options": ["--host", "--port", "--tokenizer", "--tokenize-endpoint", "--log-level"],
        "engines": ["--engine", "--prefill", "--decode", "--engines-file", "--block-size"],
        "tuning: routing": ["--policy", "--load-weight", "--balance-weight", "--load-interval"],
        "tuning: timeouts and bounds": ["--forward-timeout", "--max-body-bytes"],
        "security": ["--api-key", "--ssl-certfile", "--engine-api-key", "--curve-server-key"],
        "replicas": ["--workers", "--peer", "--peer-timeout", "--sync", "--sync-user"],
        "disaggregation": ["--pd-protocol", "--max-local-prefill-tokens", "--prefill-timeout"],
    },
    "engine": {
        "options": ["--dp-size", "--host", "--port", "--block-size", "--kv-events-config"],
        "simulation": ["--max-blocks", "--hash-scheme", "--decode-steps-per-s"],
        "tuning: timeouts and bounds": ["--request-timeout", "--max-body-bytes"],
        "security": ["--api-key", "--ssl-certfile"],
        "disaggregation": ["--disaggregation-mode", "--transfer-us-per-block"],
    },
}
"""Where a platform team looks for an option: a sample of each section's options."""


def _parser(command: str) -> argparse.ArgumentParser:
    """``kvevents COMMAND``'s own parser, as ``kvevents`` builds it."""
    (commands,) = [
        a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction)
    ]
    parser: argparse.ArgumentParser = commands.choices[command]
    return parser


def _shown(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]


def _sections(help_text: str) -> dict[str, list[str]]:
    """The --help text's sections (headings, ``title:``), each with the options it lists."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in help_text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            sections[current] = []
        elif current is not None and (match := re.match(r"^  (--?[a-z][a-z0-9-]*)", line)):
            sections[current].append(match.group(1))
    return sections


@pytest.mark.parametrize("command", sorted(SECTIONS))
def test_help_lists_the_basic_options_first_then_a_group_per_concern(command: str) -> None:
    """--help's sections come in order, basic options first, each option in the section
    of its concern, and every option of the command is listed exactly once."""
    found = _sections(_parser(command).format_help())
    titles = list(found)
    assert titles == SECTIONS[command]
    for title, options in PLACED[command].items():
        assert set(options) <= set(found[title]), (title, set(options) - set(found[title]))
    listed = [o for options in found.values() for o in options]
    assert sorted(listed) == sorted(a.option_strings[0] for a in _shown(_parser(command)))


@pytest.mark.parametrize("command", sorted(SECTIONS))
def test_usage_names_the_ways_to_run_not_every_option(command: str) -> None:
    """The usage line is a few lines naming how the command is run, not its whole list."""
    usage = _parser(command).format_help().split("\n\n")[0]
    assert usage.startswith(f"usage: kvevents {command} ")
    assert len(usage.splitlines()) <= 4
    assert "--api-key" not in usage


@pytest.mark.parametrize("command", COMMANDS)
def test_each_help_describes_its_own_option_once(command: str) -> None:
    """No help has a sentence about another option spliced in (a sentence that starts
    with another option's name), nor says its default twice."""
    for action in _shown(_parser(command)):
        text = action.help or ""
        for opener in re.findall(r"(?:^|[.;]\s+)(--[a-z][a-z0-9-]*)", text):
            assert opener in action.option_strings, (action.option_strings, text)
        assert text.count("default") <= 1, (action.option_strings, text)


def test_the_engine_key_help_is_about_the_engine_key() -> None:
    """--engine-api-key's help says where the key goes, and nothing of --ssl-ca-certs'
    job; --ssl-ca-certs says what it verifies."""
    actions = {a.option_strings[0]: a.help or "" for a in _shown(_parser("router"))}
    key = actions["--engine-api-key"]
    assert "engines" in key and "Authorization: Bearer KEY" in key
    assert "--ssl-ca-certs" not in key and "--peer" not in key
    assert "--tokenize-endpoint and --peer" in actions["--ssl-ca-certs"]


def _bounds_table() -> list[tuple[str, list[str], str, str]]:
    """(command, flags, what, past it) of each row of deployment.md's bounds table."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    table = text[text.index("## Bounds") :]
    rows = []
    for command, named, past in re.findall(
        r"^\| (router|engine) (.*?) \| .*? \| (.*?) \|$", table, flags=re.M
    ):
        flags_part, _, what = named.partition(": ")
        flags = re.findall(r"`(--[a-z-]+)`", flags_part)
        if flags:
            rows.append((command, flags, what, past))
    return rows


def test_each_bound_is_described_once_in_help_and_table_alike() -> None:
    """A bound the table describes alone has, as its --help, the table's words (code marks
    aside) and what happens past it; and every option of a command's bounds group is in
    the table."""
    rows = _bounds_table()
    assert len(rows) >= 12, rows
    for command in ("router", "engine"):
        parser = _parser(command)
        helps = {a.option_strings[0]: a.help for a in _shown(parser)}
        named = {f for cmd, flags, _, _ in rows if cmd == command for f in flags}
        (bounds,) = [g for g in parser._action_groups if g.title == "tuning: timeouts and bounds"]
        assert {a.option_strings[0] for a in bounds._group_actions} <= named, command
        for cmd, flags, what, past in rows:
            if cmd == command and len(flags) == 1:
                expected = f"{what}; past it: {past}".replace("`", "")
                assert helps[flags[0]] == expected, (command, flags[0])
    alone = {(cmd, flags[0]) for cmd, flags, _, _ in rows if len(flags) == 1}
    assert {("router", "--max-body-bytes"), ("engine", "--max-body-bytes")} <= alone
