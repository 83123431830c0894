"""Engines described by hand: URL, event endpoints, dp size — for engines without ``/server_info``.

An engine that advertises its streams is found by discovery
(:mod:`kvevents.subscribe.discovery`); others, vLLM first, need the user to say where the
streams are. An :class:`EngineSpec` is that description::

    EngineSpec(url="http://10.0.0.5:8000", kv_endpoint="tcp://*:5557",
               replay_endpoint="tcp://*:5600", dp_size=2, topic="kv", kind="vllm")

Rank ``r`` publishes on the endpoint offset for ``r`` (:meth:`Endpoint.for_rank`), the
replay endpoint likewise; a wildcard host means the engine URL's host. Without
``kv_endpoint`` the spec names an engine to discover, and its ``block_size`` and ``kind``
still apply. ``snapshot: true`` says the engine's kvevents publisher serves snapshots
(never for SGLang or vLLM); ``model`` names the models it serves
(:mod:`kvevents.router.decide.models`). ``kind`` says how a request reaches one rank:
``vllm`` by the ``X-data-parallel-rank`` header, ``sglang`` and ``kvevents`` by
``routed_dp_rank`` in the body (``kvevents`` engines also report ``/load``); by default
``vllm`` when described, ``kvevents`` when discovered.

Specs come from the command line (:mod:`kvevents.cli.engine_args`) or a file
(:func:`load_engines_file`, JSON, or TOML on Python 3.11+)::

    {"engines": [{"url": "http://127.0.0.1:8000", "kv_endpoint": "tcp://*:5557",
                  "dp_size": 2, "topic": "kv", "block_size": 32, "kind": "vllm"}]}

    [[engines]]
    url = "http://127.0.0.1:8000"
    kv_endpoint = "tcp://*:5557"
    dp_size = 2
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import httpx
import msgspec

from kvevents.errors import ConfigError, EndpointError
from kvevents.http.auth import masked_url
from kvevents.subscribe.discovery import StreamSpec, normalize_engine_url
from kvevents.subscribe.stream_spec import MISSED_WITHOUT_REPLAY
from kvevents.transport.curve_keys import parse_public_key
from kvevents.transport.endpoints import Endpoint, PortPlan

if TYPE_CHECKING:
    from kvevents.subscribe.subscriber import Subscriber

__all__ = [
    "ENGINE_KINDS",
    "EngineKind",
    "EngineSpec",
    "load_engines_file",
    "parse_engines_document",
]

log = logging.getLogger(__name__)

EngineKind = Literal["vllm", "sglang", "kvevents"]
"""How a request reaches one rank: vLLM's header, or SGLang's (and ours) body field."""
ENGINE_KINDS: tuple[EngineKind, ...] = get_args(EngineKind)
"""Every :data:`EngineKind`, in the order options and messages list them."""

FIELDS = (
    "url",
    "kv_endpoint",
    "replay_endpoint",
    "dp_size",
    "topic",
    "block_size",
    "kind",
    "name",
    "curve_server_key",
    "model",
    "snapshot",
)


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One engine: its HTTP URL and, when it cannot be discovered, where its streams are.

    Build with :meth:`create` (validates and normalizes; raises
    :class:`~kvevents.errors.ConfigError` naming the engine and the field).
    """

    url: str
    kv_endpoint: str | None = None
    replay_endpoint: str | None = None
    dp_size: int | None = None
    topic: str | None = None
    block_size: int | None = None
    kind: EngineKind | None = None
    name: str | None = None
    curve_server_key: str | None = None
    """The engine's CURVE public key, when its publishers use CURVE and do not advertise it."""
    model: str | list[str] | None = None
    snapshot: bool | None = None
    """The described engine's publishers serve snapshots (kvevents' publisher, opted in)."""

    @classmethod
    def create(cls, url: str, **fields: Any) -> EngineSpec:
        """A validated spec; ``fields`` are the other attributes (None: not given)."""
        if isinstance(url, str):  # first: no later error may print a URL's password
            _refuse_credentials(normalize_engine_url(url))
        unknown = sorted(set(fields) - set(FIELDS))
        if unknown:
            raise ConfigError(
                f"engine {url}: unknown field(s) {', '.join(unknown)}; known fields: "
                f"{', '.join(FIELDS)}"
            )
        if not isinstance(url, str) or not url.strip():
            raise ConfigError(f"engine url {url!r} must be an HTTP URL like http://127.0.0.1:8000")
        normalized = normalize_engine_url(url)
        kind = fields.get("kind")
        if kind is not None and kind not in ENGINE_KINDS:  # before msgspec's terser message
            raise ConfigError(
                f"engine {normalized}: kind {kind!r} is not one of {', '.join(ENGINE_KINDS)}"
            )
        try:
            spec = msgspec.convert({"url": normalized, **fields}, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"engine {url}: {exc}") from None
        spec._validate()
        return spec

    def _validate(self) -> None:
        where = f"engine {self.url}"
        parsed = httpx.URL(self.url)
        if not parsed.host:
            raise ConfigError(f"{where}: cannot read a host from the URL; write http://HOST:PORT")
        if parsed.query or parsed.fragment:
            raise ConfigError(
                f"{where}: a query string or #fragment in an engine's URL is not used; write "
                "its base URL, http://HOST:PORT (with a path prefix if it has one)"
            )
        if self.model is not None and not self.models:
            raise ConfigError(
                f"{where}: model={self.model!r} names no model; give e.g. model=llama"
            )
        for field in ("dp_size", "block_size"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ConfigError(f"{where}: {field}={value} must be a positive integer")
        if self.curve_server_key is not None:
            parse_public_key(self.curve_server_key, f"{where}: curve_server_key")
        if self.kv_endpoint is None:
            given = [
                f for f in ("replay_endpoint", "dp_size", "topic", "snapshot") if getattr(self, f)
            ]
            if given:
                raise ConfigError(
                    f"{where}: {', '.join(given)} given without kv_endpoint; describe the "
                    "engine's streams with kv_endpoint (e.g. tcp://*:5557), or drop them to "
                    "discover the engine through its /server_info"
                )
            return
        if self.snapshot and self.replay_endpoint is None:
            raise ConfigError(
                f"{where}: snapshot=true needs replay_endpoint: snapshots are asked on the "
                "publishers' replay sockets"
            )
        self.streams()  # every rank's endpoints resolve, within port range, no overlap

    @property
    def worker(self) -> str:
        """The engine's name in holders, metrics and /workers: ``name``, else the URL."""
        return self.name or self.url

    @property
    def models(self) -> tuple[str, ...]:
        """The names ``model`` gives (a comma list split), in order; empty when not given."""
        given = [self.model] if isinstance(self.model, str) else (self.model or [])
        names = [n.strip() for value in given for n in value.split(",")]
        return tuple(dict.fromkeys(n for n in names if n))

    @property
    def described(self) -> bool:
        """True when the streams are given here; False when they are discovered."""
        return self.kv_endpoint is not None

    @property
    def engine_kind(self) -> EngineKind:
        """``kind``, or its default: ``vllm`` when described, ``kvevents`` when discovered."""
        if self.kind is not None:
            return self.kind
        return "vllm" if self.described else "kvevents"

    @property
    def ranks(self) -> int:
        return self.dp_size or 1

    def follow(self, subscriber: Subscriber) -> None:
        """Have ``subscriber`` follow this engine: its described streams, else its URL."""
        if self.described:
            streams = self.streams()
            if self.replay_endpoint is None:
                log.warning(
                    "engine %s: its streams are given without a replay endpoint: %s. Give "
                    "the replay socket's address (--replay-endpoint after its --engine, or "
                    "replay_endpoint in the engines file; the engine's kv-events config "
                    "must set replay_endpoint too) to recover them",
                    self.worker,
                    MISSED_WITHOUT_REPLAY,
                )
            for stream in streams:
                subscriber.add_stream(stream)
        else:
            subscriber.add_engine(
                self.url, worker=self.worker, curve_server_key=self.curve_server_key
            )

    def streams(self) -> list[StreamSpec]:
        """Every rank's stream, in rank order (empty for an engine to discover)."""
        if self.kv_endpoint is None:
            return []
        where = f"engine {self.url}"
        try:
            live = self._connectable(Endpoint.parse(self.kv_endpoint), "kv_endpoint")
            replay = (
                None
                if self.replay_endpoint is None
                else self._connectable(Endpoint.parse(self.replay_endpoint), "replay_endpoint")
            )
            plan = PortPlan.build(self.ranks, live, replay)
        except EndpointError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return [
            StreamSpec(
                worker=self.worker,
                dp_rank=r.rank,
                endpoint=str(r.endpoint),
                replay_endpoint=None if r.replay_endpoint is None else str(r.replay_endpoint),
                topic=self.topic or "",
                block_size=self.block_size,
                curve_server_key=self.curve_server_key,
                snapshot=bool(self.snapshot),
            )
            for r in plan.ranks
        ]

    def _connectable(self, endpoint: Endpoint, field: str) -> Endpoint:
        """A consumer's view of a publisher endpoint: wildcard host -> the URL's host."""
        if endpoint.is_tcp and endpoint.port == 0:
            raise EndpointError(
                f"{field} {endpoint} has port 0: give the base port rank 0 publishes on"
            )
        if endpoint.is_wildcard:
            host = httpx.URL(self.url).host
            return Endpoint(scheme="tcp", host=host, port=endpoint.port)
        return endpoint

    def to_dict(self) -> dict[str, Any]:
        """The given fields (None left out), as the engines file would hold them."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


def parse_engines_document(document: Any, where: str) -> list[EngineSpec]:
    """Specs from a parsed engines file: ``{"engines": [...]}`` or a bare list of objects."""
    entries = document.get("engines") if isinstance(document, Mapping) else document
    if isinstance(document, Mapping):
        extra = sorted(set(document) - {"engines"})
        if extra:
            raise ConfigError(
                f"{where}: unknown top-level key(s) {', '.join(extra)}; expected 'engines'"
            )
    if not isinstance(entries, list) or not entries:
        raise ConfigError(
            f"{where}: expected a non-empty list of engines under 'engines', e.g. "
            '{"engines": [{"url": "http://127.0.0.1:8000", "kv_endpoint": "tcp://*:5557"}]}'
        )
    specs = []
    for i, entry in enumerate(entries):
        at = f"{where}: engines[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{at} is {entry!r}; expected an object with at least 'url'")
        fields = dict(entry)
        url = fields.pop("url", None)
        if not isinstance(url, str):
            raise ConfigError(f"{at} has no 'url' string (the engine's HTTP URL)")
        try:
            specs.append(EngineSpec.create(url, **fields))
        except ConfigError as exc:
            raise ConfigError(f"{at}: {exc}") from None
    return specs


def load_engines_file(path: str | Path) -> list[EngineSpec]:
    """Read an engines file: TOML when it ends in ``.toml`` (Python 3.11+), JSON otherwise."""
    path = Path(path)
    where = f"engines file {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {exc.strerror}") from None
    if path.suffix.lower() == ".toml":
        try:
            tomllib: Any = importlib.import_module("tomllib")
        except ModuleNotFoundError:
            raise ConfigError(
                f"{where}: reading TOML needs Python 3.11 or later (tomllib); write the file "
                "as JSON instead"
            ) from None
        try:
            document = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{where} is not valid TOML: {exc}") from None
    else:
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{where} is not valid JSON ({exc}); name it *.toml to write TOML"
            ) from None
    return parse_engines_document(document, where)


def _refuse_credentials(url: str) -> None:
    """ConfigError for a URL with ``user:password@`` in it (the router's requests would
    go without them, unauthenticated), naming the URL without them."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return  # refused with its own message later
    if parsed.userinfo:
        raise ConfigError(
            f"engine {masked_url(url)}: credentials in the URL are not sent; give the engine's key "
            "with --engine-api-key (or KVEVENTS_ENGINE_API_KEY) and write http://HOST:PORT"
        )
