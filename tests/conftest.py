"""Shared fixtures: a ZMQ context per test; each test's ``KVEVENTS_*`` environment and the
native core's switch put back; engines and routers started through one factory each.

The helpers every folder shares (``process_support``, ``router_support``,
``engine_support``, ...) are importable by name: ``pythonpath`` in pyproject.toml.

The fast lane (``pytest -m 'not slow'``, ``lane_support``): a test that starts a process
is marked slow, by its module or itself, or by using ``make_engine``/``make_router``
(directly or through ``engine``/``router``); a fast test that starts one fails.

Processes (``fleet_support``): ``make_engine(args, kv_config)`` and
``make_router(engine_urls, *options, streams=N)`` start ready processes on OS-chosen
ports and stop them all at the end of the module. ``engine`` is the shared engine (its
arguments the ``engine_args`` fixture: override it in a module, or parametrize it
indirectly) and ``router`` a router following it (options ``router_args``), ready when
every rank's stream is connected and every rank is a holder.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import zmq
from router_support import Engine, RouterProc, wait_until

from fleet_support import Fleet
from lane_support import ProcessGuard, slow_by_fixture
from native_support import NativeSwitch

_GUARD = ProcessGuard()
_NATIVE_AT_START = NativeSwitch.read()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark slow what uses a process fixture, before ``-m`` selects (see lane_support)."""
    slow_by_fixture(items)


def pytest_sessionstart(session: pytest.Session) -> None:
    _GUARD.install()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _GUARD.uninstall()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """While a test that is not slow runs (setup to teardown), starting a process fails it."""
    _GUARD.fast_test = None if item.get_closest_marker("slow") else item.nodeid
    try:
        yield
    finally:
        _GUARD.fast_test = None


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context]:
    """A fresh ZMQ context, terminated (linger 0) after the test."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(autouse=True)
def kvevents_environment() -> Iterator[None]:
    """Whatever a test sets or removes of the ``KVEVENTS_*`` variables is undone after it,
    so no test sees another's (the variables set for the whole run stay)."""
    before = {k: v for k, v in os.environ.items() if k.startswith("KVEVENTS_")}
    yield
    for key in [k for k in os.environ if k.startswith("KVEVENTS_") and k not in before]:
        del os.environ[key]
    os.environ.update(before)


@pytest.fixture(autouse=True)
def native_switch() -> Iterator[None]:
    """The native core's process-wide switch is as the session began before every test:
    on or off as ``KVEVENTS_KERNELS`` said at import, the whole-request calls not yet
    loaded (so ``KVEVENTS_NATIVE`` is read afresh), whatever earlier tests did."""
    _NATIVE_AT_START.restore()
    yield
    _NATIVE_AT_START.restore()


@pytest.fixture(scope="module")
def kvevents_fleet() -> Iterator[Fleet]:
    """The engines and routers this module starts, all stopped at its end."""
    started = Fleet()
    yield started
    started.stop_all()


@pytest.fixture(scope="module")
def make_engine(kvevents_fleet: Fleet) -> Callable[..., Engine]:
    """``make_engine(args, kv_config=KV_CONFIG, *, env=None)``: a ready engine subprocess
    on OS-chosen ports (live and replay), stopped at the end of the module."""
    return kvevents_fleet.engine


@pytest.fixture(scope="module")
def make_router(kvevents_fleet: Fleet) -> Callable[..., RouterProc]:
    """``make_router(engine_urls, *options, streams=None, env=None)``: a ready router
    subprocess on an OS-chosen port (with ``streams``, once that many streams are
    connected), stopped at the end of the module (before the engines)."""
    return kvevents_fleet.router


@pytest.fixture(scope="module")
def engine_args(request: pytest.FixtureRequest) -> list[str]:
    """The shared engine's arguments: two ranks, 4-token pages (``param`` when the
    fixture is parametrized indirectly; a module may override the fixture)."""
    return list(getattr(request, "param", ["--dp-size", "2", "--page-size", "4"]))


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine], engine_args: list[str]) -> Engine:
    """The module's engine: ``engine_args``, live and replay streams on OS-chosen ports."""
    return make_engine(engine_args)


@pytest.fixture(scope="module")
def router_args(request: pytest.FixtureRequest) -> list[str]:
    """The shared router's options beyond its engine (none unless overridden or
    parametrized indirectly)."""
    return list(getattr(request, "param", []))


@pytest.fixture(scope="module")
def router(
    make_router: Callable[..., RouterProc], engine: Engine, router_args: list[str]
) -> RouterProc:
    """A router following ``engine`` with ``router_args``: ready once every rank's
    stream is connected and every rank is a holder (bounded waits)."""
    ranks = int(engine.server_info()["dp_size"])
    proc = make_router([engine.url], *router_args, streams=ranks)
    wait_until(
        lambda: len(proc.http.get("/workers").json()["holders"]) >= ranks,
        30,
        f"the router to know all {ranks} ranks as holders",
    )
    return proc
