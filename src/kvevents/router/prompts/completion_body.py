"""The fields of a ``/v1/completions`` body the relay reads, without a Python int per token.

The relay forwards a completions body as it came and reads only a few of its members:
the prompt (to route), ``model``, ``cache_salt``, ``stream``, and whether a rank is named.
Decoding the whole body would build a Python int per token and then check them all, a
cost that grows with the prompt and exceeds the rest of the relay's work on long ones.
:func:`token_prompt` reads the prompt's array straight into an ``array("I")`` with the
native core's token parser (:mod:`kvevents.kernels`) and has msgspec decode only the
other members into :class:`RelayFields`; a body it cannot read that way is decoded with
the prompt kept as its JSON text (``msgspec.Raw``), which the parser then reads.

It takes only the plain case, one prompt of token ids, and only when the native core is
loaded; every other body (text, a batch, anything to refuse) gives None and is decoded
whole, so the errors a client sees are the same either way.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from kvevents import kernels

__all__ = ["RelayFields", "token_prompt"]


class RelayFields(msgspec.Struct):
    """The members of a completions or chat body the relay reads (unknown keys ignored)."""

    model: Any = None
    cache_salt: Any = None
    stream: Any = None
    names_rank: bool = False
    """The body has a ``routed_dp_rank`` or ``data_parallel_rank`` member, however its
    key is spelled (escapes are decoded): the relay must then rewrite the body, not
    append the rank to it."""

    @classmethod
    def of(cls, body: dict[str, Any]) -> RelayFields:
        """The fields of a body decoded whole."""
        names_rank = _ROUTED_RANK in body or _CLIENT_RANK in body
        return cls(body.get("model"), body.get("cache_salt"), body.get("stream"), names_rank)

    @property
    def model_name(self) -> str | None:
        return self.model if isinstance(self.model, str) else None

    @property
    def salt(self) -> str | None:
        return self.cache_salt if isinstance(self.cache_salt, str) else None

    @property
    def wants_stream(self) -> bool:
        """``stream`` read as the engines read it (pydantic's lax booleans): true, 1 and
        1.0, and the strings ``true``, ``1``, ``yes``, ``on``, ``t``, ``y`` in any case.
        Anything else is no stream; a value the engine refuses comes back as its 400."""
        value = self.stream
        if isinstance(value, str):
            return value.lower() in _TRUE_WORDS
        return value is True or (type(value) in (int, float) and value == 1)


_ROUTED_RANK, _CLIENT_RANK = "routed_dp_rank", "data_parallel_rank"
_TRUE_WORDS = frozenset({"true", "1", "yes", "on", "t", "y"})


class _PromptBody(RelayFields):
    prompt: msgspec.Raw = msgspec.Raw()
    """The prompt's JSON text; empty when the body has none."""
    routed_dp_rank: Any = msgspec.UNSET
    data_parallel_rank: Any = msgspec.UNSET


_DECODER = msgspec.json.Decoder(_PromptBody)
_WRAP_HEAD = b'{"input_ids":'
_PROMPT_KEY = b'"prompt"'
_WHITESPACE = b" \t\r\n"


def token_prompt(raw: bytes) -> tuple[array[int], RelayFields] | None:
    """The token ids and fields of a body whose ``prompt`` is one non-empty list of
    uint32 ids; None for every other body (or when the native core is off)."""
    compiled = kernels.loaded()
    if compiled is None:
        return None
    return _beside_the_prompt(compiled, raw) or _around_the_prompt(compiled, raw)


def _beside_the_prompt(
    compiled: kernels.Kernels, raw: bytes
) -> tuple[array[int], RelayFields] | None:
    """The usual body, read without decoding the prompt twice: the kernel reads the
    array after the first ``"prompt"`` in the text, and msgspec decodes the body with
    that array replaced by ``0`` (a few hundred bytes). The array was the object's own
    ``prompt`` exactly when that decode finds a valid object whose ``prompt`` is that
    ``0`` and the shortened text has no other ``"prompt"`` and no ``\\u`` escape (so no
    other key can decode to ``prompt``); the two texts are then valid JSON alike, as
    they differ only in one member's value. None otherwise, and the body is read the
    slower way."""
    at = raw.find(_PROMPT_KEY)
    opened = raw.lstrip(_WHITESPACE)
    if at < 0 or not opened.startswith(b"{"):
        return None
    lead = raw[len(raw) - len(opened) + 1 : at + len(_PROMPT_KEY)].lstrip(_WHITESPACE)
    parsed = compiled.parse_input_ids(raw, lead)
    if parsed is None:
        return None
    tokens, end = parsed
    shortened = raw[: at + len(_PROMPT_KEY)] + b":0" + raw[end:]
    if shortened.count(_PROMPT_KEY) != 1 or b"\\u" in shortened or not tokens:
        return None
    try:
        body = _DECODER.decode(shortened)
    except (msgspec.DecodeError, RecursionError):
        return None
    if bytes(body.prompt) != b"0":
        return None
    return tokens, _fields(body)


def _around_the_prompt(
    compiled: kernels.Kernels, raw: bytes
) -> tuple[array[int], RelayFields] | None:
    """Any other body: msgspec decodes it whole, the prompt kept as its JSON text,
    which the kernel then reads."""
    try:
        body = _DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None  # the whole decode words the error
    prompt = bytes(body.prompt)
    if not prompt.startswith(b"["):
        return None  # no prompt, text, or something to refuse
    # The kernel reads a leading "input_ids" array: give it the prompt's text as one.
    parsed = compiled.parse_input_ids(_WRAP_HEAD + prompt + b"}")
    if parsed is None:
        return None  # a batch of prompts, an id past uint32, ...
    tokens, end = parsed
    if not tokens or end != len(_WRAP_HEAD) + len(prompt):
        return None
    return tokens, _fields(body)


def _fields(body: _PromptBody) -> RelayFields:
    unset = msgspec.UNSET
    names_rank = body.routed_dp_rank is not unset or body.data_parallel_rank is not unset
    return RelayFields(body.model, body.cache_salt, body.stream, names_rank)
