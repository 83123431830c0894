"""Exceptions raised by kvevents: one tree, rooted at :class:`KVEventsError`.

Every error the library raises on purpose derives from :class:`KVEventsError`, so a
caller can catch the library's failures with one clause. Errors about bad input also
derive from :class:`ValueError`, so code written against SGLang or vLLM (which raise
plain ``ValueError``) keeps working. The classes defined here are the shared roots;
the leaves marked with a module live next to the code that raises them (they carry
what that code needs, such as an HTTP status), and derive from a class here.

Hierarchy (HTTP status where a service answers with it)::

    KVEventsError
    ├── EndpointError (ValueError)     an endpoint string or a port plan is invalid
    ├── ConfigError (ValueError)       a --kv-events-config value or an option is invalid
    ├── WireError (ValueError)         bytes that are not a valid frame or payload
    ├── PublisherStateError (RuntimeError)
    │                                  a publisher used before start or after shutdown
    ├── DiscoveryError                 an engine's /server_info cannot be used
    ├── SubscriberStateError (RuntimeError)
    │                                  a subscriber used after close
    ├── HandoffClosed                  subscribe.handoff: the item queue was closed
    ├── ChatError (ValueError)         text.chat: messages the chat template cannot render
    ├── UpstreamError (ConnectionError)
    │   │                              http.upstream_errors: an engine unreachable or not
    │   │                              answering
    │   ├── HeadTooLarge               http.upstream_errors: an answer head past the client's
    │   │                              bound
    │   └── MidwayError                http.upstream_errors: an answer begun but not received
    │                                  whole
    ├── RouterNotReadyError (ValueError)
    │                                  no engine rank to route to yet, or none available: 503
    ├── TokenizeError                  router.prompts.tokenize: the engine's /tokenize
    │   │                              failed: 502, or the engine's own 400/413/422
    │   └── ChatUnsupported            router.prompts.tokenize: no chat template: 501
    ├── TokenizeFailed                 router.serve.service: a TokenizeError, as the routes
    │                                  answer it
    ├── OpenAIError                    router.serve.relay_answer: any error in OpenAI's shape,
    │                                  own status
    ├── UnknownModelError              router.decide.models: a model no engine serves: 404
    ├── UnknownModel                   engine.models: a model the simulated engine does not serve: 404
    ├── BodyTooLarge                   router.serve.bodies: a body over --max-body-bytes: 413
    ├── RequestError                   a request body or parameter a service refuses: 400
    │   ├── BadRequest                 router.prompts.token_body: the router's
    │   └── BadRequest                 engine.server: the simulated engine's
    ├── QueueFullError (RuntimeError)  engine.scheduler: a rank's waiting queue is full: 503
    ├── DisaggregationError            engine.transfer_registry: a P/D leg refused or failed:
    │                                  own status
    └── EngineRankError (RuntimeError) engine.supervisor: a rank failed or is busy: own status

Argument checks of constructors and functions (a negative size, an unknown scheme
name) raise plain :class:`ValueError` or :class:`TypeError`, as Python's own do.
Private control-flow exceptions that never leave their module are not part of the tree.

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


class RouterNotReadyError(KVEventsError, ValueError):
    """The router cannot route yet: no engine rank is known, none is available, or (for a
    prefix query) no block size is known. The HTTP service answers 503; retry later."""


class RequestError(KVEventsError):
    """A request a service refuses because of its body or parameters (answered with 400)."""
