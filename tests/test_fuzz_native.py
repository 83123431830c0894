"""A bounded run of scripts/fuzz-native: the native core under ASan and UBSan, fuzzed.

The script builds the extension with the sanitizers and calls every native entry point
with random and adversarial inputs against the Python path; here it runs for a few
seconds with a fixed seed (the long run is in its help and in docs/architecture.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from native_support import compiler

pytestmark = pytest.mark.slow  # runs scripts/fuzz-native as a subprocess

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fuzz-native"


def _libasan(cc: str) -> bool:
    found = subprocess.run(
        [cc, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=60
    ).stdout.strip()
    return Path(found).is_absolute()


def test_the_native_core_survives_a_bounded_sanitized_fuzz() -> None:
    """Eight seconds of fuzzing every native call under AddressSanitizer and UBSan find
    no mismatch with the Python path and no sanitizer report."""
    cc = compiler()
    if cc is None:
        pytest.skip("no C compiler on this machine: the native core is not built here")
    if not _libasan(cc):
        pytest.skip(f"{cc} has no AddressSanitizer runtime (libasan.so)")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--seconds", "8", "--seed", "20261205", "--cc", cc],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fuzz-native: passed:" in done.stdout, done.stdout
    for entry in ("parse", "keys", "sync", "match", "not_held", "scan", "route", "query", "choice"):
        assert f" {entry} 0," not in done.stdout + ",", f"{entry} was never called: {done.stdout}"


def test_the_fuzz_script_refuses_a_budget_of_no_time() -> None:
    """A budget that is not a positive number of seconds is a usage error (exit 2)."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--seconds", "0"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "fuzz-native: error: --seconds 0.0: give a positive number of seconds" in done.stderr
