"""Lifecycle states are enums whose members are their strings, so the JSON shown stays the same."""

from __future__ import annotations

import json
import threading
from typing import get_args

import msgspec
import pytest

from kvevents import EngineSpec
from kvevents.engine.supervisor import RankState
from kvevents.router.decide.router import POLICIES, Policy
from kvevents.subscribe import ENGINE_KINDS, DiscoveryState, EngineKind, StreamStats, StreamStatus
from kvevents.subscribe.engine_watcher import EngineWatcher
from kvevents.subscribe.loop import Command
from kvevents.types import StrEnum


@pytest.mark.parametrize(
    ("states", "names"),
    [
        (StreamStatus, ["connecting", "connected", "disconnected", "unreachable", "refused"]),
        (DiscoveryState, ["discovering", "unreachable", "invalid", "subscribed"]),
        (RankState, ["starting", "running", "killing", "restarting", "stopped", "dead"]),
    ],
)
def test_states_are_str_enums_with_the_old_strings(states: type[StrEnum], names: list[str]) -> None:
    """Each state set is a closed enum; a member equals, prints and encodes as its old string."""
    assert [s.value for s in states] == names
    for state in states:
        assert state == state.value and str(state) == f"{state}" == state.value
        assert json.dumps(state) == msgspec.json.encode(state).decode() == f'"{state.value}"'


def test_stream_and_engine_status_encode_as_before() -> None:
    """A fresh stream's stats and an engine not yet discovered serialize with plain strings."""
    stats = StreamStats.empty("w", 0, "tcp://h:1", None)
    assert msgspec.to_builtins(stats)["status"] == "connecting"
    watcher = EngineWatcher(
        "http://h:1",
        "w",
        timeout=1.0,
        retry_initial=1.0,
        retry_max=1.0,
        closing=threading.Event(),
        add_spec=lambda spec: None,
        report=lambda signal: None,
    )
    assert msgspec.to_builtins(watcher.status())["state"] == "discovering"


def test_engine_kinds_and_policies_are_literals() -> None:
    """Engine kinds and routing policies are Literal types; the tuples the CLI offers are
    read from them, and an EngineSpec holds only a declared kind."""
    assert ENGINE_KINDS == get_args(EngineKind) == ("vllm", "sglang", "kvevents")
    assert POLICIES == get_args(Policy) == ("kv-aware", "round-robin")
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"url": "http://h:1", "kind": "trtllm"}, EngineSpec)


def test_loop_commands_are_a_closed_set() -> None:
    """The subscriber loop takes exactly five commands."""
    assert [c.value for c in Command] == ["add", "replace", "remove", "signal", "stop"]
