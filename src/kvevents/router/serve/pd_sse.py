"""A decode's event stream with the prefill's input logprobs in its first event.

SGLang's ``/generate`` with ``return_logprob`` and ``stream``: the decode instance
reports logprobs of the tokens it generates, and the prompt's (``input_token_logprobs``)
are the prefill's. :func:`merged_first_event` relays the decode's server-sent events as
they come, except that the first ``data:`` event waits for the prefill's answer and
carries its ``meta_info.input_token_logprobs`` in front of its own
(:func:`~kvevents.router.serve.pd_legs.merge_input_logprobs`). Every later byte passes
unchanged; an event that is not JSON, or a prefill that failed, leaves it unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable

import msgspec

from kvevents.router.serve.pd_exchange import Whole
from kvevents.router.serve.pd_legs import merge_input_logprobs

__all__ = ["merged_first_event"]

_FIRST_EVENT_MAX = 1 << 20
"""Bytes buffered while looking for the first event's end; past it, relayed unchanged."""
_ENCODER = msgspec.json.Encoder()


async def merged_first_event(
    chunks: AsyncIterator[bytes], prefilled: Awaitable[Whole | None]
) -> AsyncIterator[bytes]:
    """``chunks`` (a decode's SSE body) with the first event merged (module docstring)."""
    buffered = b""
    first = True
    async for chunk in chunks:
        if not first:
            yield chunk
            continue
        buffered += chunk
        end = buffered.find(b"\n\n")
        if end < 0 and len(buffered) <= _FIRST_EVENT_MAX:
            continue
        first = False
        if end < 0:
            yield buffered
        else:
            yield await _merged(buffered[:end], prefilled) + buffered[end:]
        buffered = b""
    if buffered:
        yield buffered


async def _merged(event: bytes, prefilled: Awaitable[Whole | None]) -> bytes:
    if not event.startswith(b"data:"):
        return event
    try:
        decoded = msgspec.json.decode(event[5:].strip())
        prefill = await prefilled
        if prefill is None:
            return event
        merged = merge_input_logprobs(msgspec.json.decode(prefill.body), decoded)
    except msgspec.DecodeError:
        return event
    return b"data: " + _ENCODER.encode(merged)
