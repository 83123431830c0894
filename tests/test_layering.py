"""The layering contract in pyproject.toml holds, and it is not toothless."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs lint-imports as a subprocess

ROOT = Path(__file__).resolve().parent.parent


def _lint_imports(src: Path, config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
            "--config",
            str(config),
            "--no-cache",
        ],
        cwd=src,
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_keeps_every_contract() -> None:
    """lint-imports passes on the package as it is."""
    result = _lint_imports(ROOT / "src", ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_router_import_of_the_engine_breaks_the_contract(tmp_path: Path) -> None:
    """One import of the simulated engine from the router is reported as a broken contract."""
    shutil.copytree(ROOT / "src" / "kvevents", tmp_path / "kvevents")
    scoring = tmp_path / "kvevents" / "router" / "decide" / "scoring.py"
    scoring.write_text(scoring.read_text() + "\nimport kvevents.engine.cache  # noqa\n")
    result = _lint_imports(tmp_path, ROOT / "pyproject.toml")
    assert result.returncode != 0
    assert "The simulated engine and the router never import each other BROKEN" in result.stdout
    assert "kvevents.router.decide.scoring -> kvevents.engine.cache" in result.stdout
