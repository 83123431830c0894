"""The P/D relay's plain bodies: read without a Python int per token, legs spliced into bytes.

A disaggregated request's body is read for a few members and sent on twice, each leg
with a few members added (:mod:`kvevents.router.serve.pd_legs`). Decoding it whole builds
a Python int per token, and encoding each leg builds the text again: for a prompt of
2,048 ids that is most of the relay's own work per request. For the plain case, one
prompt of token ids (``prompt`` of ``/v1/completions``, ``input_ids`` of ``/generate``),
:func:`read_plain` reads the ids straight into an ``array("I")`` with the native core's
parser (:mod:`kvevents.kernels`) and has msgspec decode only the other members
(:class:`PlainFields`), the array's text replaced by ``0``: the array is the member's own
exactly when that decode finds a valid object whose member is that ``0`` and the
shortened text has no other such key and no ``\\u`` escape (so no other key decodes to
it), as :mod:`kvevents.router.prompts.completion_body` reads completions.

:func:`spliced` appends members to the body's bytes. SGLang's legs are spliced only when
the body has none of the members they set or drop (:attr:`PlainFields.leg_keys`), so
each leg's bytes are what its dict would encode to, member for member. vLLM's legs
(:func:`vllm_prefill_bytes`, :func:`vllm_decode_bytes`) also override members a client
may give (``stream``, ``max_tokens``, ``kv_transfer_params``): appended, such a member
is there twice, and the later one is what the engine reads (Python's ``json`` and
msgspec keep the last of repeated keys, at the first one's place, which is exactly
where the dict leg sets it); a member a leg removes cannot be removed by appending, so
a body with one (:attr:`PlainFields.vllm_drops`) has that leg rebuilt from its decode.
Every other body (text, a chat, a batch, anything to refuse), and every body while the
native core is off, gives None here and is decoded whole, so what a client sees is the
same either way.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from kvevents import kernels
from kvevents.router.serve.bodies import spliced
from kvevents.router.serve.pd_legs import VLLM_PREFILL_PARAMS

__all__ = [
    "PlainFields",
    "read_plain",
    "sglang_leg_bytes",
    "transfer_params",
    "vllm_decode_bytes",
    "vllm_prefill_bytes",
]

_UNSET: Any = msgspec.UNSET
_WHITESPACE = b" \t\r\n"
_ZERO = b"0"


class PlainFields(msgspec.Struct):
    """The members of a completions or ``/generate`` body the P/D relay reads, and those
    its legs set or drop (unknown keys ignored; UNSET: not in the body)."""

    prompt: msgspec.Raw = msgspec.Raw()
    input_ids: msgspec.Raw = msgspec.Raw()
    model: Any = None
    cache_salt: Any = None
    stream: Any = _UNSET
    n: Any = _UNSET
    """Completions' samples."""
    sampling_params: Any = _UNSET
    """``/generate``'s (its ``n``: the samples)."""
    return_logprob: Any = _UNSET
    prompt_logprobs: Any = _UNSET
    echo: Any = _UNSET
    logprobs: Any = _UNSET
    """These three: whether an OpenAI request asks for its prompt's logprobs."""
    lora_path: Any = _UNSET
    lora: Any = _UNSET
    text: Any = _UNSET
    messages: Any = _UNSET
    extra_keys: Any = _UNSET
    stream_options: Any = _UNSET
    routed_dp_rank: Any = _UNSET
    data_parallel_rank: Any = _UNSET
    disagg_prefill_dp_rank: Any = _UNSET
    bootstrap_host: Any = _UNSET
    bootstrap_port: Any = _UNSET
    bootstrap_room: Any = _UNSET
    min_tokens: msgspec.Raw = msgspec.Raw()
    max_tokens: msgspec.Raw = msgspec.Raw()
    max_completion_tokens: msgspec.Raw = msgspec.Raw()
    """These three as they came (empty: not in the body): only their presence, and
    whether a value is the ``1`` vLLM's prefill leg sets, are read."""

    @property
    def names_rank(self) -> bool:
        """The body names a rank (the decode alone must then have it replaced)."""
        return (
            self.routed_dp_rank is not _UNSET
            or self.data_parallel_rank is not _UNSET
            or self.disagg_prefill_dp_rank is not _UNSET
        )

    @property
    def leg_keys(self) -> bool:
        """The body has a member SGLang's legs set or drop, other than a ``stream`` of
        ``false`` (which the prefill leg sets anyway): its legs are rebuilt, not spliced."""
        return (
            self.names_rank
            or self.bootstrap_host is not _UNSET
            or self.bootstrap_port is not _UNSET
            or self.bootstrap_room is not _UNSET
            or self.stream_options is not _UNSET
            or not (self.stream is _UNSET or self.stream is False)
        )

    @property
    def vllm_drops(self) -> bool:
        """The body has a member vLLM's prefill leg removes: that leg is rebuilt."""
        return self.stream_options is not _UNSET or len(self.min_tokens) > 0


class _PrefillAnswer(msgspec.Struct):
    """What the relay reads of a vLLM prefill leg's answer (its JSON kept as it came)."""

    kv_transfer_params: msgspec.Raw = msgspec.Raw()


_DECODER = msgspec.json.Decoder(PlainFields)
_ANSWER = msgspec.json.Decoder(_PrefillAnswer)
_ENCODER = msgspec.json.Encoder()
_VLLM_PREFILL = b',"kv_transfer_params":%s' % _ENCODER.encode(VLLM_PREFILL_PARAMS)
_NULL = b"null"
_ONE = b"1"


def read_plain(raw: bytes, key: bytes) -> tuple[array[int], PlainFields] | None:
    """The token ids of ``raw``'s member ``key`` (``b'"prompt"'`` or ``b'"input_ids"'``,
    quotes included) and the body's other members, when that member is one non-empty
    array of uint32 ids; None for every other body, or when the native core is off."""
    compiled = kernels.loaded()
    if compiled is None:
        return None
    at = raw.find(key)
    opened = raw.lstrip(_WHITESPACE)
    if at < 0 or not opened.startswith(b"{"):
        return None
    # the kernel takes every byte between the { and the : as the member's name
    lead = raw[len(raw) - len(opened) + 1 : at + len(key)].lstrip(_WHITESPACE)
    parsed = compiled.parse_input_ids(raw, lead)
    if parsed is None:
        return None
    tokens, end = parsed
    shortened = raw[: at + len(key)] + b":0" + raw[end:]
    if not tokens or shortened.count(key) != 1 or b"\\u" in shortened:
        return None
    try:
        fields = _DECODER.decode(shortened)
    except (msgspec.DecodeError, RecursionError):
        return None  # the whole decode words the error
    member = fields.prompt if key == b'"prompt"' else fields.input_ids
    if bytes(member) != _ZERO:
        return None
    return tokens, fields


def sglang_leg_bytes(
    raw: bytes,
    fields: PlainFields,
    *,
    host: str,
    port: int,
    rooms: int | list[int],
    prefill_rank: int,
    decode_rank: int,
) -> tuple[bytes, bytes]:
    """:func:`~kvevents.router.serve.pd_legs.sglang_legs`' two bodies, spliced into
    ``raw`` (whose ``fields`` have no :attr:`~PlainFields.leg_keys`), member for member
    in the same order."""
    shared = b',"bootstrap_host":%s,"bootstrap_port":%d,"bootstrap_room":%s' % (
        _ENCODER.encode(host),
        port,
        _ENCODER.encode(rooms),
    )
    # the prefill leg's stream is false: already so when the body says it, else added
    stream = b"" if fields.stream is False else b',"stream":false'
    prefill = b'%s,"routed_dp_rank":%d%s' % (shared, prefill_rank, stream)
    decode = b'%s,"routed_dp_rank":%d,"disagg_prefill_dp_rank":%d' % (
        shared,
        decode_rank,
        prefill_rank,
    )
    return spliced(raw, prefill), spliced(raw, decode)


def vllm_prefill_bytes(raw: bytes, fields: PlainFields) -> bytes:
    """:func:`~kvevents.router.serve.pd_legs.vllm_prefill_body` spliced into ``raw``, whose
    ``fields`` have no :attr:`~PlainFields.vllm_drops`: the hand-off's
    ``kv_transfer_params``, then ``stream``, ``max_tokens`` and ``max_completion_tokens``
    each appended unless the body has it already as the leg sets it (see the module
    docstring on members given twice)."""
    members = [_VLLM_PREFILL]
    if fields.stream is not False:
        members.append(b',"stream":false')
    if bytes(fields.max_tokens) != _ONE:
        members.append(b',"max_tokens":1')
    given = bytes(fields.max_completion_tokens)
    if given and given != _ONE:
        members.append(b',"max_completion_tokens":1')
    return spliced(raw, b"".join(members))


def transfer_params(answer: bytes) -> bytes:
    """A vLLM prefill answer's ``kv_transfer_params``, its JSON as it came; ``b""`` when
    the answer has none, null, or is not a JSON object. Raises ``msgspec.DecodeError``
    when the answer is not JSON."""
    try:
        params = bytes(_ANSWER.decode(answer).kv_transfer_params)
    except msgspec.ValidationError:  # not an object: no parameters, if it is JSON at all
        msgspec.json.decode(answer)
        return b""
    return b"" if params == _NULL else params


def vllm_decode_bytes(raw: bytes, params: bytes) -> bytes:
    """:func:`~kvevents.router.serve.pd_legs.vllm_decode_body` spliced into ``raw`` (a
    body :func:`read_plain` read): ``params`` (:func:`transfer_params`) appended as its
    ``kv_transfer_params``, or ``raw`` as it came when there are none."""
    return spliced(raw, b',"kv_transfer_params":%s' % params) if params else raw
