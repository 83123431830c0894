"""What a router install costs: its size on disk and its time from launch to ready.

    python benchmarks/install_footprint.py [--json OUT] [--update-readme]

Makes a fresh virtual environment in a temporary folder, installs the project into it as
a user would (``pip install PROJECT``: the router's dependencies only, no extras), and
measures the installed packages (site-packages, without pip and setuptools, which every
virtual environment has). Then, from that environment, starts ``kvevents engine`` and
``kvevents router --engine URL`` on OS-chosen ports and measures the router's time from
its launch to its ``ready`` line and to ``GET /ready`` answering 200, and whether its
first ``/route`` was answered by the native core (``/workers`` ``process.native``).
Needs the package registry (pip) and a C compiler for the native core.

Prints the figures, writes them as JSON (default
``benchmarks/results/install_footprint.json``), and with ``--update-readme`` writes them
into README.md between ``<!-- footprint:start -->`` and ``<!-- footprint:end -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_NOT_COUNTED = ("pip", "setuptools", "_distutils_hack", "distutils-precedence.pth", "pkg_resources")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python*/site-packages")
    return found


def _installed_bytes(site: Path) -> int:
    total = 0
    for entry in site.iterdir():
        if entry.name.startswith(_NOT_COUNTED):
            continue
        total += _size(entry) if entry.is_dir() else entry.stat().st_size
    return total


def _ready_line(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the process exited before printing {prefix!r}")
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise RuntimeError(f"no {prefix!r} line within {timeout:g} s")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _launch(venv: Path) -> dict[str, Any]:
    kvevents = str(venv / "bin" / "kvevents")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVEVENTS_")}
    engine = subprocess.Popen(
        [kvevents, "engine", "--port", "0", "--dp-size", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    router = None
    try:
        engine_url = _ready_line(engine, "kvevents engine ready ", 120)
        launched = time.monotonic()
        router = subprocess.Popen(
            [kvevents, "router", "--engine", engine_url, "--port", "0", "--workers", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        url = _ready_line(router, "kvevents router ready ", 120)
        serving = time.monotonic() - launched
        while _get(url + "/ready")[0] != 200:
            if time.monotonic() - launched > 60:
                raise RuntimeError("the router was not ready within 60 s")
            time.sleep(0.02)
        ready = time.monotonic() - launched
        body = json.dumps({"input_ids": list(range(1, 2049))}).encode()
        request = urllib.request.Request(
            url + "/route", data=body, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            routed = answer.status
        native = json.loads(_get(url + "/workers")[1])["process"]["native"]
        return {
            "router_serving_s": serving,
            "router_ready_s": ready,
            "first_route_status": routed,
            "native_loaded": native.get("loaded"),
            "native_calls_after_first_route": native.get("calls"),
        }
    finally:
        for proc in (router, engine):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


def measure(project: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvevents-footprint-") as folder:
        venv = Path(folder) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        started = time.monotonic()
        subprocess.run([*pip, str(project)], check=True)
        install_s = time.monotonic() - started
        site = _site_packages(venv)
        figures: dict[str, Any] = {
            "installed_bytes": _installed_bytes(site),
            "install_s": install_s,
            "packages": sorted(
                re.sub(r"-[^-]*\.dist-info$", "", p.name) for p in site.glob("*.dist-info")
            ),
        }
        figures.update(_launch(venv))
    figures["measured"] = time.strftime("%Y-%m-%d")
    figures["python"] = sys.version.split()[0]
    return figures


def markdown(figures: dict[str, Any]) -> str:
    mb = figures["installed_bytes"] / 1e6
    return (
        f"Measured with `python benchmarks/install_footprint.py --update-readme` on "
        f"{figures['measured']}, Python {figures['python']}:\n\n"
        "| `pip install kvevents` (the router, no extras) | measured |\n"
        "| --- | ---: |\n"
        f"| installed packages, pip and setuptools left out | {mb:.0f} MB |\n"
        f"| `kvevents router` launch to its ready line | {figures['router_serving_s']:.2f} s |\n"
        f"| launch to `GET /ready` 200 (its engine running) | {figures['router_ready_s']:.2f} s |\n"
        f"| native core loaded before the first request | "
        f"{'yes' if figures['native_loaded'] else 'no'} |\n"
    )


def update_readme(text: str, block: str) -> str:
    start, end = "<!-- footprint:start -->", "<!-- footprint:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"README.md has no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{block}{end}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks" / "results" / "install_footprint.json"
    )
    parser.add_argument("--update-readme", action="store_true")
    parser.add_argument("--project", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        print("note: no C compiler: the native core will not be built", file=sys.stderr)
    figures = measure(args.project)
    print(json.dumps({k: v for k, v in figures.items() if k != "packages"}, indent=2))
    print(markdown(figures))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(figures, indent=2) + "\n")
    if args.update_readme:
        readme = ROOT / "README.md"
        readme.write_text(update_readme(readme.read_text(), markdown(figures)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
