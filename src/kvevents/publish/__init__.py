"""What an engine embeds to publish its KV events.

* :mod:`~kvevents.publish.base`: the publisher interface, lifecycle, counters, and the
  null publisher;
* :mod:`~kvevents.publish.zmq_publisher`: :class:`ZmqEventPublisher` and
  :class:`EventPublisherFactory`;
* :mod:`~kvevents.publish.sockets`: binding a rank's sockets, with errors that say how
  to fix them;
* :mod:`~kvevents.publish.send_queue`: the lock-free queue and its sender thread;
* :mod:`~kvevents.publish.replay_server`: the replay ring and its ROUTER thread;
* :mod:`~kvevents.publish.block_state`: each rank's current block set, kept when
  snapshots are on; :mod:`~kvevents.publish.snapshot`: that set as the events that
  rebuild it, in parts;
* :mod:`~kvevents.publish.curve_server`: CURVE on both sockets, one ZAP authenticator per
  ZMQ context, refused handshakes counted.

Nothing here imports the consumer side (``subscribe``, ``index``, ``router``).
"""

from kvevents.publish.base import EventPublisher, NullEventPublisher, PublisherState, PublisherStats
from kvevents.publish.zmq_publisher import EventPublisherFactory, ZmqEventPublisher

__all__ = [
    "EventPublisher",
    "EventPublisherFactory",
    "NullEventPublisher",
    "PublisherState",
    "PublisherStats",
    "ZmqEventPublisher",
]
