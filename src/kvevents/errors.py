"""Exceptions raised by kvevents.

Every error the library raises on purpose derives from :class:`KVEventsError`, so a
caller can catch the library's failures with one clause. Errors about bad input also
derive from :class:`ValueError`, so code written against SGLang or vLLM (which raise
plain ``ValueError``) keeps working.

Hierarchy::

    KVEventsError
    ├── EndpointError (ValueError)     an endpoint string or a port plan is invalid
    ├── ConfigError (ValueError)       a --kv-events-config value is invalid
    ├── WireError (ValueError)         bytes that are not a valid frame or payload
    ├── PublisherStateError (RuntimeError)
    │                                  a publisher used before start or after shutdown
    ├── DiscoveryError                 an engine's /server_info cannot be used
    └── SubscriberStateError (RuntimeError)
                                       a subscriber used after close

Messages name the failing input and say how to fix it.
"""

from __future__ import annotations


class KVEventsError(Exception):
    """Base class of every error kvevents raises on purpose."""


class EndpointError(KVEventsError, ValueError):
    """An endpoint string, a per-rank offset or a port plan is invalid."""


class ConfigError(KVEventsError, ValueError):
    """A KV-events configuration value is invalid."""


class WireError(KVEventsError, ValueError):
    """Frames or a payload that do not follow the wire format."""


class PublisherStateError(KVEventsError, RuntimeError):
    """A publisher was used in a lifecycle state that does not allow it."""


class DiscoveryError(KVEventsError):
    """An engine's discovery document is missing, unreachable or invalid.

    ``reached`` is False when the engine did not answer HTTP at all (not up, wrong
    address), True when it answered but what it said is no usable discovery document.
    """

    def __init__(self, message: str, *, reached: bool = True) -> None:
        super().__init__(message)
        self.reached = reached


class SubscriberStateError(KVEventsError, RuntimeError):
    """A subscriber was used after it was closed."""
