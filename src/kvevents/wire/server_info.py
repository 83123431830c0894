"""The ``kv_events`` block of an engine's ``GET /server_info``: one schema, two sides.

The simulated engine builds a :class:`KVEventsBlock` from what its ranks really bound
(:mod:`kvevents.engine.server_info`) and serves its JSON form; discovery
(:mod:`kvevents.subscribe.server_info`) decodes an engine's JSON back into the same
struct. The block (docs/architecture.md, "Discovery")::

    {
      "publisher": "zmq",
      "endpoint_host": "*",                 # as configured; a wildcard means "the engine's host"
      "endpoint_port_base": 5557,           # rank r publishes on base + r; null if not consecutive
      "replay_endpoint_port_base": 5600,    # only when replay is on; null if not consecutive
      "topic": "",
      "block_size": 16,
      "dp_size": 4,
      "ports_consecutive": true,
      "publishers": [{"dp_rank": 0, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"}, ...],
      "curve_public_key": "...",            # kvevents only, when the streams use CURVE
      "snapshot": true                      # kvevents only, when every rank serves snapshots
    }

``curve_public_key`` is the publishers' CURVE public key (Z85; public, safe to serve):
a consumer with a key pair the publishers allow needs nothing else to connect. It is
absent from plain streams' blocks (encoded only when set).

``snapshot`` says every rank's replay socket answers a snapshot request with the rank's
whole current block set (:mod:`kvevents.wire.frames`). It is encoded only when set; a
consumer sends that request to no publisher whose block lacks it (upstream SGLang's never
has it).

Field order is the JSON's key order. Upstream SGLang sends the same block without
``ports_consecutive`` and ``publishers``, and may leave out ``topic``, ``block_size`` and
``dp_size`` (``/server_info`` then has top-level ``page_size`` and ``dp_size``); every
field therefore decodes when absent (``publisher`` as ``"zmq"``, as discovery always
read it), and ``null`` reads as absent.
``replay_endpoint_port_base`` is :data:`msgspec.UNSET` when the key is absent, so that a
block without replay encodes without the key, while a replay range that is not
consecutive still encodes as ``null``.

Which fields a consumer then needs (``endpoint_host`` and ``endpoint_port_base`` when no
``publishers`` list is given) is discovery's business: it names the missing one.

>>> block = KVEventsBlock(endpoint_host="*", endpoint_port_base=5557, topic="", block_size=16,
...                       dp_size=1, ports_consecutive=True,
...                       publishers=[AdvertisedPublisher(dp_rank=0, endpoint="tcp://*:5557")])
>>> encode_kv_events_block(block)[:60]
b'{"publisher":"zmq","endpoint_host":"*","endpoint_port_base":'
>>> decode_kv_events_block({"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557})
KVEventsBlock(publisher='zmq', endpoint_host='*', endpoint_port_base=5557, replay_endpoint_port_base=UNSET, topic=None, block_size=None, dp_size=None, ports_consecutive=None, publishers=None, curve_public_key=UNSET, snapshot=UNSET)
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

__all__ = [
    "LOCAL_PREFILL_KEY",
    "AdvertisedPublisher",
    "KVEventsBlock",
    "decode_kv_events_block",
    "encode_kv_events_block",
    "kv_events_block_to_builtins",
]


LOCAL_PREFILL_KEY = "disaggregation_decode_local_prefill"
"""A top-level ``/server_info`` member beside ``disaggregation_mode``: ``true`` on a decode
instance that prefills a request sent without a prefill itself (the simulated engine's).
An SGLang decode server cannot (it serves every request from a prefill's KV) and never
sends it; a vLLM instance serves any request alone, whatever it says."""


class AdvertisedPublisher(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's publisher as advertised: its live and replay endpoint, real ports.

    The host is the configured one (possibly a wildcard, which the consumer replaces by
    the engine's host).
    """

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None


class KVEventsBlock(msgspec.Struct, frozen=True, kw_only=True):
    """The ``kv_events`` block of ``/server_info`` (see the module docstring)."""

    publisher: str = "zmq"
    endpoint_host: str | None = None
    endpoint_port_base: int | None = None
    replay_endpoint_port_base: int | UnsetType | None = UNSET
    topic: str | None = None
    block_size: int | None = None
    dp_size: int | None = None
    ports_consecutive: bool | None = None
    publishers: list[AdvertisedPublisher] | None = None
    curve_public_key: str | UnsetType | None = UNSET
    snapshot: bool | UnsetType | None = UNSET


_encoder = msgspec.json.Encoder()


def kv_events_block_to_builtins(block: KVEventsBlock) -> dict[str, Any]:
    """The block as a JSON-ready dict, keys in field order, the replay base only when set."""
    built: dict[str, Any] = msgspec.to_builtins(block)
    return built


def encode_kv_events_block(block: KVEventsBlock) -> bytes:
    """The block as compact JSON bytes."""
    return _encoder.encode(block)


def decode_kv_events_block(obj: Any) -> KVEventsBlock:
    """A parsed JSON object (a ``dict``) as a :class:`KVEventsBlock`.

    Raises :class:`msgspec.ValidationError` naming the path of a field of the wrong type,
    e.g. ``Expected `int`, got `str` - at `$.endpoint_port_base```; unknown fields are
    ignored, so newer engines' additions do not break older consumers.
    """
    return msgspec.convert(obj, KVEventsBlock)
