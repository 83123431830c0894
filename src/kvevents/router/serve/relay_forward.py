"""One request the OpenAI relay routed, on its way to an engine: where it goes, the bytes
and header lines it is sent with, and the decision's headers for its answer.

It carries the ticket that holds its count in flight until the relay finishes it, once.
"""

from __future__ import annotations

from kvevents.router.decide.router import RouteDecision, Ticket
from kvevents.router.serve.relay_headers import decision_headers, decision_lines

__all__ = ["Forward"]


class Forward:
    """One request routed and on its way to an engine (:meth:`OpenAIRelay._route`)."""

    __slots__ = (
        "content",
        "decision",
        "endpoint",
        "headers",
        "path",
        "prompt_tokens",
        "ticket",
        "url",
    )

    def __init__(
        self,
        chat: bool,
        decision: RouteDecision,
        url: str,
        content: bytes,
        headers: bytes,
        prompt_tokens: int,
        ticket: Ticket,
    ) -> None:
        self.path, self.endpoint = (
            ("/v1/chat/completions", "chat") if chat else ("/v1/completions", "completions")
        )
        self.decision = decision
        self.url = url
        self.content = content
        self.headers = headers
        """The request's header lines for the engine (:func:`_request_lines`)."""
        self.prompt_tokens = prompt_tokens
        self.ticket = ticket

    @property
    def shown(self) -> list[tuple[bytes, bytes]]:
        """The decision's response headers (:func:`decision_headers`)."""
        return decision_headers(self.decision, self.prompt_tokens)

    @property
    def lines(self) -> bytes:
        """The same as the lines a server writes (:func:`decision_lines`)."""
        return decision_lines(self.decision, self.prompt_tokens)
