"""API keys and TLS for the HTTP services (router, engine) and for the clients they use.

Server side:

* :class:`ApiKey`: the key a service requires as ``Authorization: Bearer KEY``.
  :meth:`ApiKey.matches` scans an ASGI header list once and compares in constant time
  (:func:`hmac.compare_digest`); its ``repr`` never shows the key.
* :class:`ApiKeyGate`: a bare ASGI app in front of another that answers 401 (JSON, with
  ``WWW-Authenticate: Bearer``) on every path but the open ones; the engine's HTTP
  server uses it. The router checks the key in its own hot path instead
  (:mod:`kvevents.router.serve.hot_path`) with :func:`unauthorized_answer`.
* :class:`ServerTLS`: a certificate and its key, checked readable at start-up, handed
  to uvicorn.

Client side, :class:`ClientCredentials`: the key a client sends (the router's
``--engine-api-key``) and the CA bundle it verifies ``https://`` servers against. A
process builds the context of each bundle once and every client shares it, because
loading a trust store is costly and a router creates several clients as it starts.

:func:`resolve_secret` reads a key from its option, its file or its environment
variable, in that order of precedence. Every error is a
:class:`~kvevents.errors.ConfigError` naming the option; no message ever holds a key.
"""

from __future__ import annotations

import functools
import hmac
import json
import os
import re
import ssl
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvevents.errors import ConfigError

__all__ = [
    "OPEN_PATHS",
    "ApiKey",
    "ApiKeyGate",
    "ClientCredentials",
    "ServerTLS",
    "masked_url",
    "resolve_secret",
    "send_unauthorized",
    "unauthorized_answer",
]

OPEN_PATHS = frozenset({"/health", "/ready", "/docs", "/openapi.json"})
"""What both services answer without their API key: health and readiness, for probes, and
the API's description (it holds no state, and a browser opening ``/docs`` cannot send the
header). Everything else, ``/server_info`` and ``/load`` included, needs the key."""

_USERINFO = re.compile(r"//[^/\s]*@")  # to the last @ before the path, as urlparse splits


def masked_url(text: str) -> str:
    """``text`` with the user and password of every URL in it masked
    (``http://***@host``), for messages, logs and status pages."""
    return _USERINFO.sub("//***@", text)


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_BEARER = b"bearer "


def resolve_secret(value: str | None, file: str | None, env: str, option: str) -> str | None:
    """The key from ``--OPTION`` (``value``), else ``--OPTION-file`` (``file``), else ``$env``.

    None when none is given (authentication off). A file holds the key on its first
    line (surrounding whitespace ignored). ConfigError for an unreadable or empty file,
    or a key a header cannot carry (not printable ASCII, or holding a space).
    """
    if value is not None:
        where = option
        key = value.strip()
    elif file is not None:
        where = f"{option}-file {file}"
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"{where} cannot be read ({reason})") from None
        key = text.strip().split("\n", 1)[0].strip()
    else:
        found = os.environ.get(env)
        if found is None:
            return None
        where = f"${env}"
        key = found.strip()
    if not key:
        raise ConfigError(
            f"{where}: the key is empty; give a non-empty key, or none to turn it off"
        )
    if not (key.isascii() and key.isprintable()) or " " in key:
        raise ConfigError(
            f"{where}: the key must be printable ASCII without spaces (it travels in an "
            "HTTP header); generate one with e.g. `python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`"
        )
    return key


class ApiKey:
    """A key required as ``Authorization: Bearer KEY``; never shown by ``repr`` or ``str``."""

    __slots__ = ("_expected",)

    def __init__(self, key: str) -> None:
        if not key:
            raise ConfigError("ApiKey: the key is empty")
        self._expected = key.encode("ascii")

    def __repr__(self) -> str:
        return "ApiKey(***)"

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, ...]:  # router --workers hands it to spawned processes
        return (ApiKey, (self._expected.decode("ascii"),))

    def matches(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """True when ``headers`` (ASGI: lower-case names) carry ``Authorization: Bearer KEY``.

        One pass over the headers until ``authorization``; the scheme is matched without
        regard to case (RFC 9110), the key in constant time.
        """
        for name, value in headers:
            if name == b"authorization":
                if not value.startswith(b"Bearer ") and value[:7].lower() != _BEARER:
                    return False
                return hmac.compare_digest(value[7:].strip(), self._expected)
        return False


def unauthorized_answer(path: str, has_header: bool) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and JSON body of a 401: OpenAI's error shape on ``/v1/`` paths."""
    reason = "wrong API key" if has_header else "missing API key"
    message = f"{reason}: send the header 'Authorization: Bearer KEY' with this service's API key"
    error: Any = message
    if path.startswith("/v1/"):
        error = {"message": message, "type": "authentication_error", "code": 401}
    body = json.dumps({"error": error}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"www-authenticate", b'Bearer realm="kvevents"'),
        (b"content-length", b"%d" % len(body)),
    ]
    return headers, body


async def send_unauthorized(scope: Scope, send: Send) -> None:
    """Answer the request of ``scope`` with :func:`unauthorized_answer`."""
    has_header = any(name == b"authorization" for name, _ in scope["headers"])
    headers, body = unauthorized_answer(scope["path"], has_header)
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeyGate:
    """ASGI app: requests to ``app`` need ``key``, except on ``open_paths`` (exact paths).

    Lifespan and other non-HTTP scopes pass through unchecked.
    """

    def __init__(self, app: ASGIApp, key: ApiKey, open_paths: Iterable[str]) -> None:
        self.app = app
        self.key = key
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] not in self.open_paths
            and not self.key.matches(scope["headers"])
        ):
            await send_unauthorized(scope, send)
            return
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate chain and private key (PEM files), both readable.

    ``certfile`` and ``keyfile`` are the ``--ssl-certfile`` and ``--ssl-keyfile`` options;
    :meth:`from_options` checks they come together.
    """

    certfile: str
    keyfile: str

    def __post_init__(self) -> None:
        for option, path in (("--ssl-certfile", self.certfile), ("--ssl-keyfile", self.keyfile)):
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise ConfigError(f"{option} {path} cannot be read ({exc.strerror})") from None
        try:  # a mismatched pair or a file that is not PEM fails here, not at the first client
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                self.certfile, self.keyfile
            )
        except ssl.SSLError as exc:
            raise ConfigError(
                f"--ssl-certfile {self.certfile} / --ssl-keyfile {self.keyfile}: not a "
                f"certificate and its private key in PEM ({exc.reason or exc})"
            ) from None

    @classmethod
    def from_options(cls, certfile: str | None, keyfile: str | None) -> ServerTLS | None:
        """None when neither is given; ConfigError when only one is."""
        if certfile is None and keyfile is None:
            return None
        if certfile is None or keyfile is None:
            given, missing = (
                ("--ssl-certfile", "--ssl-keyfile")
                if keyfile is None
                else ("--ssl-keyfile", "--ssl-certfile")
            )
            raise ConfigError(f"{given} needs {missing} too (the certificate and its key)")
        return cls(certfile=certfile, keyfile=keyfile)


@dataclass(frozen=True)
class ClientCredentials:
    """What a client of a kvevents or upstream HTTP server sends and trusts.

    ``api_key``: sent as ``Authorization: Bearer KEY`` on every request (None: no
    header). ``ca_certs``: a PEM bundle ``https://`` servers are verified against (None:
    the system's trust store). The ``repr`` never shows the key.
    """

    api_key: str | None = None
    ca_certs: str | None = None

    def __post_init__(self) -> None:
        if self.ca_certs is not None:
            self.ssl_context()  # an unreadable or malformed bundle fails at start-up

    def __repr__(self) -> str:
        key = None if self.api_key is None else "***"
        return f"ClientCredentials(api_key={key}, ca_certs={self.ca_certs!r})"

    def headers(self) -> dict[str, str]:
        """The headers every request carries."""
        return {} if self.api_key is None else {"authorization": f"Bearer {self.api_key}"}

    def verify(self) -> ssl.SSLContext:
        """What httpx's ``verify`` and aiohttp's ``ssl`` take: the process's shared context
        trusting ``ca_certs``, or, when none is given, the store httpx trusts by default
        (``SSL_CERT_FILE`` or ``SSL_CERT_DIR`` if set, else certifi's bundle)."""
        if self.ca_certs is None:
            return _default_trust()
        return self.ssl_context()

    def ssl_context(self) -> ssl.SSLContext:
        """The shared context that verifies servers against ``ca_certs`` (the system's
        store if None); ConfigError when the bundle is unreadable or malformed."""
        try:
            return _trusting(self.ca_certs)
        except (OSError, ssl.SSLError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(
                f"--ssl-ca-certs {self.ca_certs}: not a readable PEM CA bundle ({reason})"
            ) from None


@functools.cache
def _trusting(ca_certs: str | None) -> ssl.SSLContext:
    """One context per bundle for the whole process (a failed load is not cached)."""
    return ssl.create_default_context(cafile=ca_certs)


@functools.cache
def _default_trust() -> ssl.SSLContext:
    """The trust httpx gives ``verify=True``, built once for the process."""
    if os.environ.get("SSL_CERT_FILE"):
        return ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    if os.environ.get("SSL_CERT_DIR"):
        return ssl.create_default_context(capath=os.environ["SSL_CERT_DIR"])
    import certifi  # httpx's own dependency

    return ssl.create_default_context(cafile=certifi.where())
