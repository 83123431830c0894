"""Text to token ids the way the engine does it, so the router's keys match the engine's blocks.

A text prompt must be tokenized exactly as the engine will (special tokens included:
vLLM adds the tokenizer's BOS to completions unless ``add_special_tokens`` is false),
or every block key differs and nothing matches. Three ways:

* :class:`ByteTextTokenizer`: our simulated engine's byte tokenizer (the default);
* :class:`FileTokenizer` (``--tokenizer PATH``): the model folder's ``tokenizer.json``
  loaded with the ``tokenizers`` library (the optional ``kvevents[tokenizers]`` extra),
  the same file and library vLLM's fast tokenizers use;
* :class:`EndpointTokenizer` (``--tokenize-endpoint URL``): ask the engine, e.g.
  vLLM's ``POST /tokenize`` ``{"prompt", "add_special_tokens", "model"}`` ->
  ``{"tokens": [...]}`` (our simulated engine serves the same). One HTTP round trip
  per text prompt, on the router's kept-alive engine connections.

Each has ``async encode(text, add_special_tokens=True, model=None) -> list[int]`` and
raises :class:`TokenizeError` with a message for the client.

Chat requests (``/v1/chat/completions``) need the model's chat template applied first;
``async encode_chat(body)`` takes the chat body. The engine is the authority on its own
template, so the endpoint tokenizer sends the messages (and every field that shapes the
rendering: ``add_generation_prompt``, ``continue_final_message``, ``chat_template``,
``chat_template_kwargs``, ``tools``, ``add_special_tokens``) to the engine's
``/tokenize``, as vLLM takes them. The byte tokenizer renders the simulated engine's
template itself. A ``tokenizer.json`` holds no template engine, so the file tokenizer
refuses chats with :class:`ChatUnsupported`, naming the flag that makes them work.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

import msgspec

from kvevents.errors import ConfigError, KVEventsError
from kvevents.http.upstream import Upstream
from kvevents.http.upstream_answers import FullResponse
from kvevents.http.upstream_errors import UpstreamError
from kvevents.text.chat import ChatError, render_chat
from kvevents.text.tokenizer import ByteTokenizer

__all__ = [
    "TOKENIZE_TIMEOUT_S",
    "ByteTextTokenizer",
    "ChatError",
    "ChatUnsupported",
    "EndpointTokenizer",
    "FileTokenizer",
    "TextTokenizer",
    "TokenizeError",
]


class TokenizeError(KVEventsError):
    """The text could not be tokenized (the engine's /tokenize failed or answered oddly).

    ``status`` is what the router answers its client: the engine's own 400, 413 or 422
    when it refused the input (the client's to fix), else 502 (the engine failed, or the
    router was pointed at the wrong URL: a 404 is the router's problem, not the client's).
    """

    status = 502


class ChatUnsupported(TokenizeError):
    """This tokenizer cannot apply a chat template; the message says what can."""

    status = 501


# Statuses of the engine's /tokenize that blame the input, and so are the client's to fix.
_CLIENT_FAULTS = frozenset({400, 413, 422})

# The chat body's fields that change how vLLM renders the messages into a prompt.
CHAT_TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


class TextTokenizer(Protocol):
    name: str

    async def encode(
        self, text: str, *, add_special_tokens: bool = True, model: str | None = None
    ) -> list[int]: ...

    async def encode_chat(self, body: Mapping[str, Any]) -> list[int]: ...


def _chat_flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise ChatError(f"{key}={value!r} must be true or false")
    return value


class ByteTextTokenizer:
    """One token per UTF-8 byte: what the simulated engine does (it has no special tokens)."""

    name = "bytes"

    def __init__(self) -> None:
        self._bytes = ByteTokenizer()

    async def encode(
        self, text: str, *, add_special_tokens: bool = True, model: str | None = None
    ) -> list[int]:
        return self._bytes.encode(text)

    async def encode_chat(self, body: Mapping[str, Any]) -> list[int]:
        """The simulated engine's template, rendered here (ChatError for bad messages)."""
        text = render_chat(
            body.get("messages"),
            add_generation_prompt=_chat_flag(body, "add_generation_prompt", True),
            continue_final_message=_chat_flag(body, "continue_final_message", False),
        )
        return self._bytes.encode(text)


class FileTokenizer:
    """A Hugging Face ``tokenizer.json`` (a file, or the model folder holding one)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(
                f"--tokenizer {path}: no tokenizer.json there; give the model folder (the "
                "one the engine loads) or its tokenizer.json"
            )
        try:
            tokenizers: Any = importlib.import_module("tokenizers")
        except ModuleNotFoundError:
            raise ConfigError(
                f"--tokenizer {path} needs the 'tokenizers' library: pip install "
                "'kvevents[tokenizers]' (or use --tokenize-endpoint to ask the engine)"
            ) from None
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own untyped errors for bad files
            raise ConfigError(f"--tokenizer {file} cannot be loaded: {exc}") from None
        self.name = str(file)

    async def encode(
        self, text: str, *, add_special_tokens: bool = True, model: str | None = None
    ) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    async def encode_chat(self, body: Mapping[str, Any]) -> list[int]:
        raise ChatUnsupported(
            f"the router tokenizes with --tokenizer {self.name}, which holds no chat template: "
            "start it with --tokenize-endpoint http://ENGINE/tokenize so the engine renders "
            "chats, or send /v1/completions with the rendered prompt"
        )


TOKENIZE_TIMEOUT_S = 30.0
"""Seconds one ``/tokenize`` request may take (connecting, the answer's head and body)."""


class _TokenizeAnswer(msgspec.Struct):
    """What ``/tokenize`` answers (vLLM's and our engine's): the ids; other fields ignored."""

    tokens: list[int]


class EndpointTokenizer:
    """The engine's own ``/tokenize`` over HTTP.

    Posted through the router's engine client (:class:`~kvevents.http.upstream.Upstream`,
    which the service hands over at start): kept-alive connections, the engines' key and
    CA bundle: a general-purpose client costs the router's CPU many times what this one
    does per request (``benchmarks/tokenize_endpoint.py``). Without one (the class used on
    its own), each request opens and closes a client of its own. Each request has
    ``timeout`` seconds (:data:`TOKENIZE_TIMEOUT_S`); one that failed on a kept-alive
    connection before any answer began (the engine closed it as the request left) is
    sent once more (:meth:`Upstream.post_safe`), since tokenizing changes nothing on the
    engine.
    """

    def __init__(
        self, url: str, upstream: Upstream | None = None, *, timeout: float = TOKENIZE_TIMEOUT_S
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"--tokenize-endpoint {url!r}: give the full URL, e.g. http://127.0.0.1:8000/tokenize"
            )
        if "@" in parts.netloc:
            raise ConfigError(
                f"--tokenize-endpoint {parts.scheme}://...@{parts.hostname}: credentials in "
                "the URL are not sent; give the URL without them, and the key with "
                "--engine-api-key (the router sends it to every engine and to this endpoint)"
            )
        self.url = url
        self.name = url
        self.upstream = upstream
        self.timeout = timeout
        # the engine's own base: the posts share its pool of connections with the relay's
        self._base = f"{parts.scheme}://{parts.netloc}"
        # as an HTTP client sends it: characters a request line cannot hold, %-escaped
        path, query = quote(parts.path or "/", safe=_URL_SAFE), quote(parts.query, safe=_URL_SAFE)
        self._path = path + (f"?{query}" if query else "")

    async def encode(
        self, text: str, *, add_special_tokens: bool = True, model: str | None = None
    ) -> list[int]:
        body: dict[str, Any] = {"prompt": text, "add_special_tokens": add_special_tokens}
        if model is not None:
            body["model"] = model
        return await self._tokenize(body)

    async def encode_chat(self, body: Mapping[str, Any]) -> list[int]:
        """The engine renders the messages with its template and tokenizes them."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ChatError("messages must be a non-empty list of {role, content} objects")
        request: dict[str, Any] = {"messages": messages}
        for key in ("model", *CHAT_TEMPLATE_FIELDS):
            if body.get(key) is not None:
                request[key] = body[key]
        return await self._tokenize(request)

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        payload = _ENCODER.encode(body)
        upstream = self.upstream
        try:
            if upstream is not None:
                response = await self._post(upstream, payload)
            else:
                own = Upstream(timeout=self.timeout)
                try:
                    response = await self._post(own, payload)
                finally:
                    await own.close()
        except (UpstreamError, TimeoutError) as exc:
            raise TokenizeError(
                f"tokenizing at {self.url} failed: {type(exc).__name__}: {exc}"
            ) from None
        if response.status != 200:
            text = response.body[:200].decode("utf-8", "replace")
            error = TokenizeError(f"{self.url} answered HTTP {response.status}: {text}")
            if response.status in _CLIENT_FAULTS:
                error.status = response.status  # the engine refused the client's input
            raise error
        try:
            return _DECODER.decode(response.body).tokens
        except msgspec.DecodeError:
            raise TokenizeError(
                f'{self.url} did not answer {{"tokens": [ids...]}}; is it the engine\'s /tokenize?'
            ) from None

    async def _post(self, upstream: Upstream, payload: bytes) -> FullResponse:
        return await upstream.post_safe(
            self._base, self._path, payload, _JSON, timeout=self.timeout
        )


_URL_SAFE = "/%:@!$&'()*+,;=-._~"
"""What a URL's path and query keep as they are (RFC 3986's reserved and unreserved)."""
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(_TokenizeAnswer)
_JSON = {"Content-Type": "application/json"}
