"""The README's promises: its two commands and its library example; and the layout map
(docs/layout.md) naming every module."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LAYOUT = ROOT / "docs" / "layout.md"
CI_SCRIPT = ROOT / ".ci" / "run"


def code_blocks(language: str) -> list[str]:
    text = README.read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_first_block_has_exactly_the_two_commands() -> None:
    """The README opens with one code block of two lines: install+demo, then install+tests."""
    first = re.search(r"```\w*\n(.*?)```", README.read_text(), flags=re.S)
    assert first is not None
    lines = first.group(1).strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("pip install") and lines[0].endswith("kvevents demo")
    assert "pytest" in lines[1]


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run takes its test command from the README rather than keeping a copy of it."""
    script = CI_SCRIPT.read_text()
    assert "README.md" in script and 'bash -c "$test_cmd"' in script


@pytest.mark.slow
def test_library_example_runs() -> None:
    """The ten-line example publishes a chain, a late subscriber replays it, and the match is 2 blocks."""
    (example,) = [b for b in code_blocks("python") if "ZmqEventPublisher(" in b]
    live, replay = free_port(), free_port()
    example = example.replace("5557", str(live)).replace("5600", str(replay))
    done = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "HolderMatch(gpu=2, cpu=0, disk=0)" in done.stdout


def _layout_modules() -> set[str]:
    """Module paths the layout map (the first code block of docs/layout.md) names:
    `name.py` at the top, `pkg/` then its indented `module.py` lines (several may share a
    line, comma-separated), packages nested by indentation (`router/` then `  serve/`
    then `    app.py`)."""
    text = LAYOUT.read_text()
    block = re.search(r"```\n(.*?)```", text, flags=re.S)
    assert block is not None
    named: set[str] = set()
    packages: list[tuple[int, str]] = []  # (indent, path) of the packages enclosing a line
    for line in block.group(1).splitlines():
        if not line.startswith("  ") or line.startswith("src/"):
            continue
        indent = len(line) - len(line.lstrip())
        head = line.strip().split("  ")[0]
        if not head.endswith((".py", "/")) and "," not in head:
            continue  # a description carried over to its own line
        while packages and packages[-1][0] >= indent:
            packages.pop()
        prefix = packages[-1][1] + "/" if packages else ""
        if head.endswith("/"):
            packages.append((indent, prefix + head[:-1]))
        else:
            named.update(prefix + n.strip() for n in head.split(",") if n.strip())
    return named


def test_layout_map_names_every_module() -> None:
    """docs/layout.md's map and the tree agree: every module is named, nothing else is."""
    src = ROOT / "src" / "kvevents"
    modules = {
        str(path.relative_to(src))
        for path in src.rglob("*.py")
        if path.name != "__init__.py" or path.parent == src
    }
    assert _layout_modules() == modules
