"""Everything a command reads at run time ships in the wheel.

The wheel is built from a copy of the project (so the checkout gets no build folders),
installed into a folder of its own, and run from there with no access to the source
tree: the router benchmark finds its wrk script and the demo finds its bundled trace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package as a wheel would install it (``pip install --target``)."""
    work = tmp_path_factory.mktemp("wheel")
    project = work / "project"
    project.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(
        ROOT / "src",
        project / "src",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"),
    )
    wheels = work / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*build, "-w", str(wheels), str(project)], check=True, timeout=600, capture_output=True
    )
    (wheel,) = wheels.glob("kvevents-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvevents/bench/data/post_bodies.lua" in names
    assert "kvevents/data/conversation_trace.jsonl" in names
    target = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return target


def _run(site: Path, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with the installed copy first on the path and the checkout nowhere."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=site,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_router_benchmark_finds_its_wrk_script_in_the_wheel(installed: Path) -> None:
    """`kvevents bench router --help` runs from the wheel, and its wrk script is there."""
    code = (
        "import kvevents, sys; from pathlib import Path;"
        "from kvevents.bench.router import _lua_script as s;"
        "p = Path(s()); print(kvevents.__file__); print(p); sys.exit(0 if p.is_file() else 1)"
    )
    found = _run(installed, code)
    assert found.returncode == 0, found.stderr
    assert found.stdout.splitlines()[0].startswith(str(installed))
    helped = _run(installed, "from kvevents.cli.main import main; main(['bench', '--help'])")
    assert "router" in helped.stdout, helped.stderr


def test_the_demo_finds_its_bundled_trace_in_the_wheel(installed: Path) -> None:
    """The demo's default trace is read from the installed package."""
    code = (
        "from kvevents.traces import bundled_trace_path as p;"
        "path = p(); print(path); print(sum(1 for _ in open(path)))"
    )
    found = _run(installed, code)
    assert found.returncode == 0, found.stderr
    path, lines = found.stdout.split()
    assert path.startswith(str(installed)) and int(lines) > 1000
