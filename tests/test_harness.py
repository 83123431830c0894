"""The test harness itself: the fast lane's guard and marks, the native core's switch put
back between tests, and the fleet fixtures stopping what they started.

The two switch tests run in file order on purpose: the first leaves the state as a test
could, the second fails unless the conftest put it back in between.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from collections.abc import Callable

import pytest
from router_support import Engine

from fleet_support import Fleet
from kvevents import kernels
from kvevents.kernels import native
from native_support import NativeSwitch, native_core


def test_a_fast_test_that_starts_a_subprocess_fails_naming_it() -> None:
    """A test not marked slow fails as it starts a subprocess, before the process exists."""
    with pytest.raises(
        pytest.fail.Exception, match=r"starts a process \(subprocess .*\) but is not marked slow"
    ):
        subprocess.Popen([sys.executable, "-c", "print('never')"])


def test_a_fast_test_that_starts_a_multiprocessing_process_fails() -> None:
    """A test not marked slow fails as it starts a multiprocessing process."""
    process = multiprocessing.get_context("spawn").Process(target=print)
    with pytest.raises(pytest.fail.Exception, match="multiprocessing"):
        process.start()
    assert process.pid is None


@pytest.mark.slow
def test_a_slow_test_may_start_a_process() -> None:
    """A test marked slow starts processes as it likes."""
    done = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, timeout=60)
    assert done.stdout.strip() == b"42"


def test_users_of_the_process_fixtures_are_marked_slow(
    request: pytest.FixtureRequest, make_engine: Callable[..., Engine]
) -> None:
    """A test asking for ``make_engine`` is marked slow without a mark of its own."""
    assert request.node.get_closest_marker("slow") is not None


def test_a_switch_read_is_put_back_whatever_was_changed() -> None:
    """NativeSwitch.restore puts back the core and the loaded whole-request calls."""
    before = NativeSwitch.read()
    kernels._kernels, native._module = None, object()  # type: ignore[assignment]
    before.restore()
    assert NativeSwitch.read() == before


def test_loading_the_whole_request_calls_keeps_them_for_the_process() -> None:
    """native.load() keeps the calls once loaded (the state the next test must not see)."""
    native_core()
    assert native.load() is not None
    assert native._module is not None


def test_a_test_after_one_that_loaded_the_calls_can_still_turn_them_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KVEVENTS_NATIVE=0 set in a test turns the whole-request calls off, whatever ran before."""
    native_core()
    monkeypatch.setenv("KVEVENTS_NATIVE", "0")
    assert native.load() is None
    assert native.status() == "off: KVEVENTS_NATIVE=0"


@pytest.mark.slow
def test_the_fleet_stops_every_process_still_running_newest_first() -> None:
    """Fleet.stop_all stops the router and engine a test left running, skips a stopped one,
    and a second call has nothing left to do."""
    fleet = Fleet()
    try:
        eng = fleet.engine(["--dp-size", "1"])
        left = fleet.router([eng.url], streams=1)
        stopped = fleet.router([eng.url])
        stopped.stop()
    finally:
        fleet.stop_all()
    assert (eng.exit_code, left.exit_code, stopped.exit_code) == (0, 0, 0)
    assert eng.proc.poll() == 0 and left.proc.poll() == 0
    assert fleet.started == []
    fleet.stop_all()


def test_no_test_module_edits_sys_path() -> None:
    """Helpers are found through pytest's ``pythonpath`` (pyproject.toml), so no test or
    helper under tests/ inserts into ``sys.path`` (a script outside tests/ may be loaded by
    path: tests/real_engines loads scripts/real_vllm that way)."""
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    editing = [
        str(path.relative_to(tests))
        for path in sorted(tests.rglob("*.py"))
        if "sys.path.insert" in path.read_text(encoding="utf-8")
        and path.name not in ("test_harness.py", "real_vllm_helpers.py")
    ]
    assert editing == [], f"use pytest's pythonpath instead of sys.path.insert in {editing}"
