"""Shared fixtures: a ZMQ context per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context]:
    """A fresh ZMQ context, terminated (linger 0) after the test."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)
