"""Shared fixtures: a ZMQ context per test; each test's ``KVEVENTS_*`` environment put back.

The helpers every folder shares (``process_support``, ``router_support``,
``engine_support``, ...) are importable by name: ``pythonpath`` in pyproject.toml.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import zmq


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
