"""The simulated engine turns snapshots on for its ranks and advertises them only when
every rank serves them."""

from __future__ import annotations

from kvevents import KVEventsConfig
from kvevents.engine.rank import engine_kv_events_config
from kvevents.engine.server_info import BoundPublisher, build_kv_events_block

REPLAY = {"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}


def test_a_rank_publishes_with_snapshots_unless_its_config_decides() -> None:
    """With replay and no snapshot key a rank serves snapshots bounded by twice what its
    cache holds per group; an explicit key, no replay or no publishing leave it as given."""
    on = engine_kv_events_config(KVEventsConfig.from_dict(REPLAY), 1000)
    assert (on.snapshot, on.snapshot_max_blocks) == (True, 2000)
    hybrid = engine_kv_events_config(KVEventsConfig.from_dict(REPLAY), 1000, sliding_window=64)
    assert hybrid.snapshot_max_blocks == 4000
    for given in (
        REPLAY | {"snapshot": False},
        REPLAY | {"snapshot_max_blocks": 7},
        {"publisher": "zmq", "endpoint": "tcp://*:0"},
        {"publisher": "null"},
    ):
        config = KVEventsConfig.from_dict(given)
        assert engine_kv_events_config(config, 1000) == config


def test_server_info_advertises_snapshots_only_when_every_rank_serves_them() -> None:
    """``snapshot: true`` is in the kv_events block when every rank said so in its hello,
    and absent from the JSON otherwise."""
    config = KVEventsConfig.from_dict(REPLAY)

    def block(*snapshots: bool) -> dict[str, object] | None:
        pubs = [
            BoundPublisher(r, f"tcp://*:{5557 + r}", f"tcp://*:{5600 + r}", s)
            for r, s in enumerate(snapshots)
        ]
        return build_kv_events_block(config, pubs, len(pubs), 16)

    assert block(True, True)["snapshot"] is True  # type: ignore[index]
    assert "snapshot" not in block(True, False)  # type: ignore[operator]
    assert "snapshot" not in block(False, False)  # type: ignore[operator]
