"""ZMQ addressing used by both ends of the plane: endpoints with per-rank ports, CURVE keys.

* :mod:`~kvevents.transport.endpoints`: parsed endpoints and the publisher's rank rule;
* :mod:`~kvevents.transport.curve_keys`: CURVE key pairs, their text form and files.
"""
