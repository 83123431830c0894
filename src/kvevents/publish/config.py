"""KVEventsConfig: the ``--kv-events-config`` JSON, parsed and validated on construction.

Keys are SGLang's (``publisher``, ``endpoint``, ``bind``, ``replay_endpoint``,
``buffer_steps``, ``hwm``, ``max_queue_size``, ``topic``); vLLM's
``enable_kv_cache_events`` is accepted too. ``{}`` is valid and means publishing is
off (the null publisher), as is ``{"publisher": "null"}``.

Publishing is on when ``publisher`` names a real publisher (``"zmq"``) and
``enable_kv_cache_events`` is not ``false``. (vLLM turns events on with
``enable_kv_cache_events: true``; SGLang with ``publisher: "zmq"`` alone; both work.)

Our own optional keys turn the live and replay sockets into CURVE servers
(:mod:`kvevents.transport.curve_keys`; the stream is encrypted and only allowed subscribers are
served): the publisher's key pair as ``curve_secret_key_file`` (a ``NAME.key_secret``
file, as ``kvevents keygen`` writes it) or ``curve_secret_key`` (the secret inline; it
then shows in ``ps``), and the subscribers' public keys as ``curve_allowed_keys`` (a
list) and/or ``curve_allowed_keys_dir`` (a directory of ``NAME.key`` files). All four
absent means a plain stream, as SGLang and vLLM publish.

Our own ``snapshot`` (bool) and ``snapshot_max_blocks`` (int) keys make the publisher
keep each rank's current block set and answer a snapshot request on its replay socket
(:mod:`kvevents.publish.block_state`), so a consumer whose gap replay cannot fill gets
the rank's whole state instead of a loss. Either key turns it on (``"snapshot": false``
keeps it off); it needs ``replay_endpoint``. The set holds at most
``snapshot_max_blocks`` blocks (default :data:`DEFAULT_SNAPSHOT_MAX_BLOCKS`): past it the
publisher answers that no snapshot is available until the engine clears its cache.

Every error names the key, what was wrong, and the accepted keys or values.
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Any

import msgspec

from kvevents.errors import ConfigError, EndpointError
from kvevents.transport.curve_keys import (
    CurveKeyPair,
    load_public_keys_dir,
    parse_public_key,
)
from kvevents.transport.endpoints import WILDCARD_HOSTS, Endpoint

__all__ = ["DEFAULT_SNAPSHOT_MAX_BLOCKS", "KVEventsConfig"]

DEFAULT_SNAPSHOT_MAX_BLOCKS = 500_000
"""Blocks a publisher's snapshot state holds at most unless ``snapshot_max_blocks`` says."""

_HOST = re.compile(r"\*|[A-Za-z0-9._%-]+|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.%A-Za-z]*")
"""What ``--kv-events-host`` may be: a wildcard, a name or IPv4 address, an IPv6 address."""


class KVEventsConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Validated KV-event publishing settings. Construct with keywords or :meth:`from_json`."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    enable_kv_cache_events: bool | None = None
    curve_secret_key_file: str | None = None
    curve_secret_key: str | None = None
    curve_allowed_keys: list[str] | None = None
    curve_allowed_keys_dir: str | None = None
    snapshot: bool | None = None
    snapshot_max_blocks: int | None = None

    def __post_init__(self) -> None:
        if not self.publisher:
            raise ConfigError('kv-events config: \'publisher\' is empty; use "zmq" or "null"')
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self, key)
            if value is None:
                continue
            try:
                Endpoint.parse(value)
            except EndpointError as exc:
                raise ConfigError(f"kv-events config key {key!r}: {exc}") from None
        for key, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, key)
            if value < low:
                raise ConfigError(f"kv-events config key {key!r} is {value}; it must be >= {low}")
        if self.snapshot_max_blocks is not None and self.snapshot_max_blocks < 1:
            raise ConfigError(
                f"kv-events config key 'snapshot_max_blocks' is {self.snapshot_max_blocks}; "
                "it must be >= 1 (the most blocks a rank's snapshot state holds)"
            )
        if self.snapshot_enabled and self.replay_endpoint is None:
            raise ConfigError(
                "kv-events config turns snapshots on but has no 'replay_endpoint': snapshots "
                'are served on the replay socket; add "replay_endpoint": "tcp://*:5600" '
                '(or set "snapshot": false)'
            )
        self._check_curve()

    @property
    def snapshot_enabled(self) -> bool:
        """True when the publisher keeps its ranks' block sets and serves snapshots."""
        if self.snapshot is None:
            return self.snapshot_max_blocks is not None
        return self.snapshot

    def _check_curve(self) -> None:
        """The CURVE keys are all absent, or a key pair plus the allowed subscribers, valid."""
        allowed = self.curve_allowed_keys is not None or self.curve_allowed_keys_dir is not None
        if self.curve_secret_key is not None and self.curve_secret_key_file is not None:
            raise ConfigError(
                "kv-events config has both 'curve_secret_key' and 'curve_secret_key_file'; "
                "give one (the file keeps the secret out of `ps`)"
            )
        has_pair = self.curve_secret_key is not None or self.curve_secret_key_file is not None
        if has_pair and not allowed:
            raise ConfigError(
                "kv-events config has a CURVE secret key but no allowed subscribers: add "
                "'curve_allowed_keys' (a list of public keys) or 'curve_allowed_keys_dir' "
                "(a directory of NAME.key files); make a subscriber's pair with `kvevents keygen`"
            )
        if allowed and not has_pair:
            raise ConfigError(
                "kv-events config lists allowed CURVE subscribers but no publisher key: add "
                "'curve_secret_key_file' (a NAME.key_secret file from `kvevents keygen`)"
            )
        if has_pair:
            self.curve_key_pair()  # raises ConfigError naming the key
            self.curve_allowed_public_keys()

    @property
    def curve(self) -> bool:
        """True when the publisher's sockets are CURVE servers."""
        return self.curve_secret_key is not None or self.curve_secret_key_file is not None

    def curve_key_pair(self) -> CurveKeyPair | None:
        """The publisher's CURVE key pair (read from its file now), or None: no CURVE."""
        if self.curve_secret_key_file is not None:
            return CurveKeyPair.load(
                self.curve_secret_key_file, "kv-events config key 'curve_secret_key_file'"
            )
        if self.curve_secret_key is not None:
            return CurveKeyPair.from_secret(
                self.curve_secret_key, "kv-events config key 'curve_secret_key'"
            )
        return None

    def curve_allowed_public_keys(self) -> frozenset[str]:
        """Every allowed subscriber's public key: the list, plus the directory read now."""
        keys = {
            parse_public_key(key, f"kv-events config key 'curve_allowed_keys'[{i}]")
            for i, key in enumerate(self.curve_allowed_keys or ())
        }
        if self.curve_allowed_keys_dir is not None:
            keys.update(
                load_public_keys_dir(
                    self.curve_allowed_keys_dir, "kv-events config key 'curve_allowed_keys_dir'"
                )
            )
        return frozenset(keys)

    @property
    def enabled(self) -> bool:
        """True when events are published (a publisher other than "null", not disabled)."""
        return self.publisher != "null" and self.enable_kv_cache_events is not False

    @classmethod
    def accepted_keys(cls) -> tuple[str, ...]:
        return cls.__struct_fields__

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEventsConfig:
        """Validate a parsed JSON object; unknown keys and wrong types are refused."""
        if not isinstance(data, dict):
            raise ConfigError(
                f"kv-events config must be a JSON object, got {type(data).__name__}: {data!r}"
            )
        accepted = cls.accepted_keys()
        for key in data:
            if key not in accepted:
                hint = difflib.get_close_matches(str(key), accepted, n=1)
                maybe = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise ConfigError(
                    f"kv-events config has an unknown key {key!r}{maybe}; accepted keys: "
                    + ", ".join(accepted)
                )
        try:
            return msgspec.convert(data, cls, strict=True)
        except msgspec.ValidationError as exc:
            # __post_init__'s own ConfigError arrives wrapped, already worded.
            message = _explain(exc)
            if not message.startswith("kv-events config"):
                message = f"kv-events config: {message}"
            raise ConfigError(message) from None

    @classmethod
    def from_json(cls, text: str | None) -> KVEventsConfig:
        """Parse the ``--kv-events-config`` string; None or blank means ``{}``."""
        if text is None or not text.strip():
            return cls()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"kv-events config {text!r} is not valid JSON ({exc.msg} at column {exc.colno}); "
                'example: \'{"publisher": "zmq", "endpoint": "tcp://*:5557"}\''
            ) from None
        return cls.from_dict(data)

    def bound_to(self, host: str) -> KVEventsConfig:
        """This config with ``host`` in place of a wildcard host on the endpoints it binds.

        ``kvevents engine --kv-events-host`` (default 127.0.0.1) uses it, so an upstream
        config such as ``tcp://*:5557`` publishes on loopback only unless told otherwise.
        The replay endpoint is always bound; the live one when ``bind`` is true, or not
        given and the host is a wildcard (which then becomes an explicit ``bind: true``,
        since a named host alone would mean "connect"). A wildcard ``host`` changes nothing.
        """
        if not _HOST.fullmatch(host):
            raise ConfigError(
                f"--kv-events-host {host!r} is not a host name or address: give e.g. "
                "127.0.0.1 (loopback), 10.0.0.5 (one interface) or '*' (every interface)"
            )
        if host in WILDCARD_HOSTS:
            return self
        changes: dict[str, Any] = {}
        live = Endpoint.parse(self.endpoint)
        if live.is_wildcard and self.bind is not False:
            changes["endpoint"] = str(Endpoint(scheme="tcp", host=host, port=live.port))
            changes["bind"] = True
        if self.replay_endpoint is not None:
            replay = Endpoint.parse(self.replay_endpoint)
            if replay.is_wildcard:
                changes["replay_endpoint"] = str(
                    Endpoint(scheme="tcp", host=host, port=replay.port)
                )
        return msgspec.structs.replace(self, **changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.structs.asdict(self)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def to_public_json(self) -> str:
        """:meth:`to_json` fit to serve (``/server_info``): an inline ``curve_secret_key`` is
        replaced by ``"(hidden)"``; key file paths and public keys stay."""
        out = self.to_dict()
        if out.get("curve_secret_key") is not None:
            out["curve_secret_key"] = "(hidden)"
        return json.dumps(out)


def _explain(exc: msgspec.ValidationError) -> str:
    # msgspec says e.g. "Expected `int`, got `str` - at `$.hwm`"; lead with the key name.
    message = str(exc)
    head, sep, where = message.rpartition(" - at `$.")
    if sep:
        key = where.rstrip("`").split("[")[0].split(".")[0]
        return f"key {key!r}: {head}"
    return message
