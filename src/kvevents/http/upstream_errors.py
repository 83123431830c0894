"""Why an engine's answer did not come: the engine client's errors.

:class:`UpstreamError` is an engine that could not be reached, a connection closed
midway or an answer that is not HTTP; :class:`HeadTooLarge` an answer head past the
client's bound. :class:`MidwayError` is raised only once an answer's status was read:
the engine took the request, so it is never sent again; it carries that status and the
cause.
"""

from __future__ import annotations

from kvevents.errors import KVEventsError

__all__ = ["HeadTooLarge", "MidwayError", "UpstreamError"]


class UpstreamError(KVEventsError, ConnectionError):
    """The engine could not be reached, or did not answer in HTTP to its end."""


class HeadTooLarge(UpstreamError):
    """The engine's answer head went past the client's bound (``max_head_bytes``)."""


class MidwayError(UpstreamError):
    """The engine's answer began (``status``) but did not arrive whole: ``cause`` says why
    (an :class:`UpstreamError`, or a :class:`TimeoutError` past the deadline)."""

    def __init__(self, status: int, cause: BaseException) -> None:
        super().__init__(f"the answer ({status}) stopped midway: {cause or type(cause).__name__}")
        self.status = status
        self.cause = cause
