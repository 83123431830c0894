"""Docstring examples are tests: every ``>>>`` example in the package runs and gives
what it shows, so the documentation cannot drift from the code."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

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
