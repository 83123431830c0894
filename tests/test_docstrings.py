"""Docstring examples are tests: every ``>>>`` example in the package runs and gives
what it shows, so the documentation cannot drift from the code. Module docstrings state
what a module is for, its invariants and its reasons, not its history: no measurements,
dates, issue numbers or apologies for its size, and no lab notebook's length."""

from __future__ import annotations

import ast
import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import kvevents

# kvevents.__main__ runs the command line when imported; it has no examples.
MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(kvevents.__path__, prefix="kvevents.")
    if info.name != "kvevents.__main__"
)


def test_every_module_is_checked() -> None:
    """The walk finds the whole package, subpackages included, so a new module is checked too."""
    assert "kvevents.subscribe.subscriber" in MODULES
    assert "kvevents.wire.server_info" in MODULES
    assert len(MODULES) > 60


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    """Every example in the module's docstrings gives the output it shows."""
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        # Objects re-exported from another module are checked where they are defined.
        runner.run(test)
    failed, attempted = runner.summarize(verbose=False)
    assert failed == 0, f"{failed} of {attempted} docstring examples in {name} failed (see above)"


ROOT = Path(__file__).resolve().parents[1]

SOURCES = sorted(
    [
        *(ROOT / "src" / "kvevents").rglob("*.py"),
        *(ROOT / "benchmarks").glob("*.py"),
        *(ROOT / "scripts").rglob("*.py"),
        *(
            path
            for path in (ROOT / "scripts").iterdir()
            if path.is_file()
            and path.read_text(errors="replace").startswith("#!/usr/bin/env python")
        ),
    ]
)
"""Every Python file whose module docstring a reader meets: the package, benchmarks, scripts."""

FORBIDDEN = {
    "an apology for the module's size (say what it is for instead)": re.compile(
        r"\b300 lines\b", re.IGNORECASE
    ),
    "an issue number (state the fact it stands for)": re.compile(
        r"\bissues?\s*#?\d+|(?<![\w&/])#\d+\b", re.IGNORECASE
    ),
    "a microsecond figure (a measurement: state the reason it supports; figures live in "
    "docs/router-performance.md and the benchmarks' results)": re.compile(r"\d\s*(?:us|µs)\b"),
    "a date (history belongs to git)": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
}
"""What a module docstring never holds, each with what to write instead."""

MAX_MODULE_DOCSTRING_LINES = 60
"""A ceiling, not the aim (a few lines, about 20): only a wire format, a protocol or an
invariant list the code implements gets near it."""


def _module_docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(), str(path)), clean=False) or ""


def test_sources_are_found() -> None:
    """The docstring rules read the package, the benchmarks and the scripts, extension-less
    Python scripts included."""
    names = {path.relative_to(ROOT).as_posix() for path in SOURCES}
    assert {
        "src/kvevents/index/mask_table.py",
        "benchmarks/index.py",
        "scripts/real_vllm/route_trace.py",
        "scripts/fuzz-native",
    } <= names
    assert len(names) > 150


@pytest.mark.parametrize(
    ("text", "caught"),
    [
        ("Over 300 lines on purpose: the loops stay together.", True),
        ("A little over 300 lines: one command.", True),
        ("Targets (issue 14): a hit rate.", True),
        ("see #12 for the discussion", True),
        ("the CPU per request went from 222 to 219 us", True),
        ("a match costs 14 µs", True),
        ("every /route before 2026-12-03 scored every holder", True),
        ("``match_p99_us`` is the slowest match of the run", False),
        ("a sender id is ``SEAT#RUN``", False),
        ("``--transfer-us-per-block`` per block", False),
        ("at most 60 tokens per block, 2**40 batches", False),
    ],
)
def test_rules_catch_the_lab_notebook(text: str, caught: bool) -> None:
    """The forbidden patterns match size apologies, issue numbers, microsecond figures and
    dates, and leave names that merely contain ``us`` or ``#`` alone."""
    assert any(rule.search(text) for rule in FORBIDDEN.values()) is caught


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_docstring_is_timeless(path: Path) -> None:
    """The module docstring holds no size apology, issue number, microsecond figure or date,
    and stays under the ceiling of lines."""
    doc = _module_docstring(path)
    found = [
        f"line {number}: {why}: {line.strip()!r}"
        for number, line in enumerate(doc.splitlines(), 1)
        for why, rule in FORBIDDEN.items()
        if rule.search(line)
    ]
    assert not found, f"{path.relative_to(ROOT)}'s module docstring holds:\n" + "\n".join(found)
    lines = len(doc.splitlines())
    assert lines <= MAX_MODULE_DOCSTRING_LINES, (
        f"{path.relative_to(ROOT)}'s module docstring is {lines} lines: say what the module is "
        f"for, its invariants and its reasons in a few (at most {MAX_MODULE_DOCSTRING_LINES})"
    )
