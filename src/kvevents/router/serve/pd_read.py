"""What the P/D relay reads of a request: its prompts as token ids, samples, stream.

:class:`PDRequest` is one request as read. :func:`read_request` reads a body at once,
synchronously: one prompt of token ids without decoding it (:func:`plain_request`,
:mod:`kvevents.router.serve.pd_body`), any other body decoded whole, left to the relay
to tokenize (:func:`generate_request` reads SGLang's ``/generate`` then: ``input_ids``
or ``text``, one prompt or a list). :func:`asks_stream` says from either whether the
answer is a stream, before anything is sent: an answer written whole is the inline
protocol's to write (:meth:`PDRelay.inline_path
<kvevents.router.serve.pd_relay.PDRelay.inline_path>`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from kvevents.router.prompts.completion_body import RelayFields
from kvevents.router.prompts.tokenize import TextTokenizer, TokenizeError
from kvevents.router.serve.pd_body import PlainFields, read_plain
from kvevents.router.serve.pd_request import Endpoint
from kvevents.router.serve.relay_answer import OpenAIError, _tokenize_error
from kvevents.router.serve.relay_body import _json_object

__all__ = [
    "PDRequest",
    "asks_stream",
    "generate_request",
    "plain_request",
    "read_request",
    "samples_of",
]

_WHAT: Mapping[Endpoint, str] = {
    "completions": "completions",
    "chat": "chat completions",
    "generate": "generate",
}


class PDRequest:
    """One request as read: its body, prompts (token ids) and what shapes its legs.

    ``raw`` is the body as it came; ``fields``, when :func:`plain_request` read it
    (:mod:`kvevents.router.serve.pd_body`), what was read of it, and :attr:`body` is then
    decoded only when a leg must be rebuilt from it."""

    __slots__ = (
        "_body",
        "batched",
        "endpoint",
        "extra_keys",
        "fields",
        "logprob",
        "lora",
        "model",
        "prompt_logprobs",
        "prompts",
        "raw",
        "salt",
        "samples",
        "stream",
    )

    def __init__(
        self,
        endpoint: Endpoint,
        raw: bytes,
        body: dict[str, Any] | None,
        prompts: list[Sequence[int]],
        *,
        batched: bool,
        samples: int,
        stream: bool,
        lora: str | None = None,
        fields: PlainFields | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.raw = raw
        self._body = body
        self.prompts = prompts
        self.batched = batched
        """The prompt was given as a list (even of one): its legs take lists of rooms."""
        self.samples = samples
        self.stream = stream
        self.lora = lora
        self.fields = fields
        """What :func:`plain_request` read of the body (None: it was decoded whole)."""
        if fields is not None:
            model, salt, logprob, extra = (
                fields.model,
                fields.cache_salt,
                fields.return_logprob,
                fields.extra_keys,
            )
            asked = (fields.prompt_logprobs, fields.echo, fields.logprobs)
        else:
            assert body is not None
            model, salt = body.get("model"), body.get("cache_salt")
            logprob, extra = body.get("return_logprob"), body.get("extra_keys")
            asked = (body.get("prompt_logprobs"), body.get("echo"), body.get("logprobs"))
        self.model = model if isinstance(model, str) else None
        self.salt = salt if isinstance(salt, str) else None
        self.logprob = endpoint == "generate" and _any_true(logprob)
        self.prompt_logprobs = endpoint != "generate" and _asks_prompt_logprobs(endpoint, *asked)
        """An OpenAI request asking for its prompt's logprobs: ``prompt_logprobs`` (vLLM's,
        either route), or a completion's ``echo`` with ``logprobs``."""
        self.extra_keys: list[Any] | None = (
            extra
            if endpoint == "generate" and isinstance(extra, list) and len(prompts) == 1
            else None
        )
        """``/generate``'s ``extra_keys`` of its one prompt, to key it with."""

    @property
    def body(self) -> dict[str, Any]:
        """The body decoded (now, when :func:`plain_request` read it)."""
        if self._body is None:
            self._body = msgspec.json.decode(self.raw)  # read as valid JSON already
        return self._body

    @property
    def spliced_legs(self) -> bool:
        """SGLang's legs can be spliced into :attr:`raw` (:mod:`kvevents.router.serve.pd_body`)."""
        return self.fields is not None and not self.fields.leg_keys

    @property
    def spliced_alone(self) -> bool:
        """The decode's body when it serves alone can be spliced into :attr:`raw`."""
        return self.fields is not None and not self.fields.names_rank


def plain_request(endpoint: Endpoint, raw: bytes) -> PDRequest | None:
    """``raw`` read without decoding its prompt (:func:`~kvevents.router.serve.pd_body.read_plain`)
    when it is a completions or ``/generate`` body of one prompt of token ids that
    :func:`generate_request` or the relay's whole read would take as it is; None
    otherwise (the body is then decoded whole, and any error worded from that)."""
    if endpoint == "chat":
        return None
    read = read_plain(raw, _PROMPT if endpoint == "completions" else _INPUT_IDS)
    if read is None:
        return None
    tokens, fields = read
    if endpoint == "completions":
        samples = samples_of(None if fields.n is _UNSET else fields.n, "n")
        stream = RelayFields(stream=None if fields.stream is _UNSET else fields.stream).wants_stream
        return PDRequest(
            endpoint, raw, None, [tokens], batched=False, samples=samples, stream=stream,
            fields=fields,
        )  # fmt: skip
    if fields.messages is not _UNSET or fields.text not in (_UNSET, None):
        return None  # refused by the whole read
    params = fields.sampling_params
    samples = samples_of(params.get("n", 1) if isinstance(params, dict) else 1, "sampling_params.n")
    lora = fields.lora_path if fields.lora_path is not _UNSET else fields.lora
    return PDRequest(
        endpoint, raw, None, [tokens], batched=False, samples=samples,
        stream=fields.stream is True, lora=lora if isinstance(lora, str) else None,
        fields=fields,
    )  # fmt: skip


_UNSET: Any = msgspec.UNSET
_PROMPT = b'"prompt"'
_INPUT_IDS = b'"input_ids"'


async def generate_request(raw: bytes, body: dict[str, Any], tokenizer: TextTokenizer) -> PDRequest:
    """A ``/generate`` body (``raw``, decoded: ``body``) read: ``input_ids`` or ``text``,
    one prompt or a list."""
    if "messages" in body:
        raise OpenAIError(400, '"messages" is for chats: send them to /v1/chat/completions')
    given = [k for k in ("input_ids", "text") if body.get(k) is not None]
    if len(given) != 1:
        raise OpenAIError(400, 'give exactly one of "input_ids" (token ids) or "text"')
    value = body[given[0]]
    batched = isinstance(value, list) and bool(value) and isinstance(value[0], (list, str))
    items = value if batched else [value]
    prompts: list[Sequence[int]] = []
    for i, item in enumerate(items):
        where = f"{given[0]}[{i}]" if batched else given[0]
        if isinstance(item, str) and given[0] == "text":
            try:
                prompts.append(await tokenizer.encode(item))
            except TokenizeError as exc:
                raise _tokenize_error(exc) from None
        elif isinstance(item, list) and item and all(type(t) is int and t >= 0 for t in item):
            prompts.append(item)
        else:
            kind = "a string" if given[0] == "text" else "a non-empty list of token ids"
            raise OpenAIError(400, f"{where} must be {kind}, or a list of them")
    params = body.get("sampling_params")
    samples = samples_of(params.get("n", 1) if isinstance(params, dict) else 1, "sampling_params.n")
    lora = body.get("lora_path", body.get("lora"))
    return PDRequest(
        "generate",
        raw,
        body,
        prompts,
        batched=batched,
        samples=samples,
        stream=body.get("stream") is True,
        lora=lora if isinstance(lora, str) else None,
    )


def samples_of(value: Any, where: str) -> int:
    """A request's samples (``n``): 1 when not given; OpenAIError 400 unless an int >= 1."""
    if value is None:
        return 1
    if type(value) is not int or value < 1:
        raise OpenAIError(400, f"{where} must be an integer >= 1, not {value!r}", param=where)
    return value


def read_request(endpoint: Endpoint, raw: bytes) -> PDRequest | dict[str, Any]:
    """``raw`` read as a plain request (:func:`plain_request`), else decoded whole
    (OpenAIError 400 when it is not a JSON object)."""
    return plain_request(endpoint, raw) or _json_object(raw, _WHAT[endpoint])


def asks_stream(endpoint: Endpoint, read: PDRequest | dict[str, Any]) -> bool:
    """Whether a request :func:`read_request` read asks for a stream (as its
    :class:`PDRequest` will say)."""
    if isinstance(read, PDRequest):
        return read.stream
    if endpoint == "generate":
        return read.get("stream") is True
    return RelayFields.of(read).wants_stream


def _asks_prompt_logprobs(
    endpoint: Endpoint, prompt_logprobs: Any, echo: Any, logprobs: Any
) -> bool:
    if _given(prompt_logprobs):
        return True
    return endpoint == "completions" and echo is True and _given(logprobs)


def _given(value: Any) -> bool:
    """A count of logprobs asked for (0 included: the prompt's own tokens' alone)."""
    return not (value is _UNSET or value is None or value is False)


def _any_true(value: Any) -> bool:
    return any(v is True for v in value) if isinstance(value, list) else value is True
