"""The body of a request the router keys: token ids, text or a chat, and how it is decoded.

:func:`decode_tokens_body` is the one decoder of every body the router matches
(``/route``, ``/query``, ``/generate``, the benchmark's bare ceiling). A body whose first
member is a plain ``"input_ids"`` array (the usual ``/route`` body) is read by the native
core (:mod:`kvevents.kernels`): the ids go straight into an ``array("I")`` and only the
members after the array are decoded by msgspec. Every other body, and any body while the
core is off, is decoded whole by msgspec; errors are always that decoder's.

A ``/route`` or ``/query`` body is the router's own: a member it does not know is a 400
naming it (a misspelt ``"top"`` or ``"input_id"`` would otherwise be ignored in silence),
on every path, since the native one decodes the members after the ids with the same
strict struct. An engine's ``/generate`` body is decoded with ``strict=False``: its other
members are the engine's (sampling parameters...) and are forwarded as they are.
"""

from __future__ import annotations

import difflib
import re
from array import array
from typing import Annotated, Any

import msgspec

from kvevents import kernels
from kvevents.errors import RequestError

__all__ = [
    "DEFAULT_TOP",
    "PLAIN_BODY",
    "BadRequest",
    "GenerateBody",
    "TokensBody",
    "decode_tokens_body",
]

DEFAULT_TOP = 4
"""Scores in a ``/route`` answer unless the body asks otherwise: the choice and 3 more."""


class TokensBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request given as token ids, text or chat messages; any other member is refused.

    ``messages`` are rendered as ``/v1/chat/completions`` renders them (the body's
    template fields included), so a gateway asking ``/route`` about a chat gets the rank
    the chat endpoint would choose.
    """

    input_ids: list[int] | None = None
    """Token ids, each in 0..2**32-1: checked by the conversion to ``array("I")`` in
    :func:`decode_tokens_body`, which the keys need anyway (a Meta bound per id would
    check each twice). None after the compiled path, which returns the ids apart."""
    text: str | None = None
    messages: list[Any] | None = None
    lora: str | None = None
    lora_path: str | None = None
    """SGLang's ``/generate`` name for the adapter: the same as ``lora`` (see :attr:`adapter`)."""
    cache_salt: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    """Per block, the keys the engine adds to its hash (vLLM's ``BlockStored.extra_keys``
    shape: image identifiers with their offsets), for gateways that know them; see
    :mod:`kvevents.index.extra_keys`."""
    model: str | None = None
    """Only the engines serving this model are candidates; an adapter's name keys the
    request under it (:mod:`kvevents.router.decide.models`)."""
    record: bool = False
    """``/route`` only: count the choice as sent (the caller forwards the request)."""
    top: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_TOP
    """``/route`` only: how many scores to answer, the chosen holder's first."""
    all_scores: bool = False
    """``/route`` only: answer every holder's score (``top`` is then ignored)."""
    add_generation_prompt: bool | None = None
    """This and the members below: a chat's template fields
    (:data:`~kvevents.router.prompts.tokenize.CHAT_TEMPLATE_FIELDS`), read by the tokenizer
    that renders ``messages``."""
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None

    @property
    def adapter(self) -> str | None:
        """The adapter the request runs under: ``lora``, else ``lora_path``."""
        return self.lora if self.lora is not None else self.lora_path


class GenerateBody(TokensBody, frozen=True, forbid_unknown_fields=False):
    """An engine's ``/generate`` body as the router keys it: :class:`TokensBody`'s members,
    and any others (the engine's own) ignored here and forwarded."""


PLAIN_BODY = TokensBody()
"""The body of a request given as ``input_ids`` alone, as the compiled path decodes it
(the same object each time: a caller may test ``body is PLAIN_BODY``)."""


class BadRequest(RequestError):
    """A request body the router cannot use; answered with 400."""


_DECODER = msgspec.json.Decoder(TokensBody)
_GENERATE_DECODER = msgspec.json.Decoder(GenerateBody)
_MEMBERS = TokensBody.__struct_fields__
_BodyDecoder = msgspec.json.Decoder[TokensBody] | msgspec.json.Decoder[GenerateBody]
_LONE_HIGH_SURROGATE = re.compile(
    # a \u escape of a high surrogate (its backslash not itself escaped) with no low one
    rb"(?<!\\)(?:\\\\)*\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
)
_WHITESPACE = b" \t\r\n"


def decode_tokens_body(
    raw: bytes, *, chat: bool = True, strict: bool = True
) -> tuple[array[int] | None, TokensBody]:
    """The body's token ids (None when it gives text or messages instead) and the body.

    :class:`BadRequest` for a body the router cannot use: not a JSON object of the
    fields above, a member it does not take (``strict``: named; ``strict=False`` for an
    engine's ``/generate`` body, whose other members are the engine's), not exactly one
    of ``input_ids``, ``text`` and ``messages``, an id outside uint32, or ``messages``
    when ``chat`` is False (an engine's ``/generate`` takes no chat).
    """
    decoder: _BodyDecoder = _DECODER if strict else _GENERATE_DECODER
    compiled = kernels.loaded()
    if compiled is not None:
        fast = _decode_compiled(compiled, raw, decoder)
        if fast is not None:
            if fast[1].lora_path is not None:
                _check_adapter(fast[1])
            return fast
    try:
        body = decoder.decode(raw)
    except msgspec.ValidationError as exc:
        unknown = _unknown_members(raw)
        if unknown:
            raise BadRequest(_unknown_message(unknown)) from None
        raise BadRequest(f"request body: {exc}") from None
    except msgspec.DecodeError as exc:
        if _LONE_HIGH_SURROGATE.search(raw):  # msgspec calls it truncated input
            raise BadRequest(
                "request body: a string is not valid Unicode: a \\ud800-\\udbff escape "
                "must be followed by a \\udc00-\\udfff one (a surrogate pair)"
            ) from None
        raise BadRequest(f"request body: {exc}") from None
    except RecursionError:  # a 500 on /generate otherwise (found by test_http_api.py)
        raise BadRequest("request body: JSON nested too deeply") from None
    if body.lora_path is not None:
        _check_adapter(body)
    if body.messages is not None and not chat:
        raise BadRequest('"messages" is for chats: send them to /v1/chat/completions')
    given = [body.input_ids, body.text, body.messages]
    if sum(x is not None for x in given) != 1:
        raise BadRequest(
            'give exactly one of "input_ids" (token ids), "text" or "messages" (a chat)'
        )
    if body.input_ids is None:
        return None, body
    try:
        return array("I", body.input_ids), body
    except OverflowError:
        raise BadRequest(f"input_ids: every token id must be an int in 0..{2**32 - 1}") from None


def _unknown_members(raw: bytes) -> list[str]:
    """The members of the JSON object ``raw`` that :class:`TokensBody` does not take
    (:class:`BadRequest` when it is nested too deeply to read them)."""
    try:
        whole = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return []
    except RecursionError:
        raise BadRequest("request body: JSON nested too deeply") from None
    return [key for key in whole if key not in _MEMBERS] if isinstance(whole, dict) else []


def _unknown_message(unknown: list[str]) -> str:
    first = unknown[0]
    hint = difflib.get_close_matches(first, _MEMBERS, n=1, cutoff=0.75)
    maybe = f" (did you mean {hint[0]!r}?)" if hint else ""
    named = ", ".join(repr(key) for key in unknown)
    return (
        f"request body: unknown member{'s' if len(unknown) > 1 else ''} {named}{maybe}; "
        f"accepted members: {', '.join(_MEMBERS)}"
    )


def _check_adapter(body: TokensBody) -> None:
    if body.lora is not None and body.lora != body.lora_path:
        raise BadRequest(
            f'"lora" is {body.lora!r} but "lora_path" is {body.lora_path!r}: name the adapter once'
        )


def _decode_compiled(
    compiled: kernels.Kernels, raw: bytes, decoder: _BodyDecoder
) -> tuple[array[int], TokensBody] | None:
    """The compiled path, or None to decode ``raw`` whole (any body but the plain case,
    and every body that must be refused, an unknown member's too: the whole decode words
    the error). ``decoder`` decodes the members after the ids, as it would the whole."""
    parsed = compiled.parse_input_ids(raw)
    if parsed is None:
        return None
    tokens, end = parsed
    if raw[end] == 0x7D:  # "}": the ids were the only member, if nothing follows
        return (tokens, PLAIN_BODY) if not raw[end + 1 :].strip(_WHITESPACE) else None
    # After the comma must come the next member's key; the object without the ids
    # member is then valid JSON exactly when the whole body was.
    rest = raw[end + 1 :].lstrip(_WHITESPACE)
    if not rest.startswith(b'"'):
        return None
    try:
        body = decoder.decode(b"{" + rest)
    except (msgspec.DecodeError, RecursionError):
        return None
    if body.input_ids is not None or body.text is not None or body.messages is not None:
        return None  # a second "input_ids" or another prompt: the whole decode decides
    return tokens, body
