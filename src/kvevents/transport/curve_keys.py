"""CURVE keys: parsing, key files, key pairs, for both ends of an encrypted event stream.

ZeroMQ's CURVE mechanism (RFC 26, CurveZMQ) encrypts a connection and authenticates
both ends with Curve25519 key pairs. The publisher is the CURVE *server*: it holds a
secret key, and subscribers must know its public key. Each subscriber is a CURVE
*client* with a key pair of its own; the publisher accepts only the public keys it is
told to allow (:mod:`kvevents.publish.curve_server`).

Keys are 32 bytes written as 40 characters of Z85 text (ZeroMQ's base 85). Key files
are the certificate files ``zmq.auth`` writes and reads (``NAME.key`` holds the public
key, ``NAME.key_secret`` both keys), so keys made with ``kvevents keygen`` work with
any ZeroMQ tool and the reverse::

    curve
        public-key = "<40 characters of Z85>"
        secret-key = "<40 characters of Z85>"     (NAME.key_secret only)

A secret key is never part of an error message or a repr. Every error here is a
:class:`~kvevents.errors.ConfigError` naming the key or file (``what``) and how to
make a good one (``kvevents keygen``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

from kvevents.errors import ConfigError

__all__ = [
    "KEY_LENGTH",
    "CurveKeyPair",
    "check_curve_available",
    "load_public_key_file",
    "load_public_keys_dir",
    "parse_public_key",
    "write_key_pair",
]

KEY_LENGTH = 40
"""Characters of a Z85-encoded CURVE key (32 bytes)."""

_Z85 = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)
_HOW = "make a key pair with `kvevents keygen`"


def check_curve_available() -> None:
    """Raise ConfigError when this libzmq was built without CURVE (libsodium or tweetnacl)."""
    if not zmq.has("curve"):
        raise ConfigError(
            f"CURVE keys are configured but this libzmq ({zmq.zmq_version()}) has no CURVE "
            "support; install a pyzmq wheel (they bundle it) or a libzmq built with libsodium"
        )


def _z85_problem(text: object) -> str | None:
    """Why ``text`` is not a Z85 key, or None when it is one."""
    if not isinstance(text, str):
        return f"it is a {type(text).__name__}, not a string"
    if len(text) != KEY_LENGTH:
        return f"it has {len(text)} characters, a key has {KEY_LENGTH} (Z85 text of 32 bytes)"
    bad = sorted(set(text) - _Z85)
    if bad:
        return f"it has characters outside Z85: {''.join(bad)!r}"
    return None


def parse_public_key(text: object, what: str) -> str:
    """``text`` as a public key (stripped of surrounding space), or ConfigError naming ``what``."""
    key = text.strip() if isinstance(text, str) else text
    problem = _z85_problem(key)
    if problem is not None:
        raise ConfigError(f"{what} {text!r} is not a CURVE public key: {problem}; {_HOW}")
    assert isinstance(key, str)
    return key


@dataclass(frozen=True)
class CurveKeyPair:
    """A CURVE key pair, both halves Z85 text; the secret never shows in the repr."""

    public: str
    secret: str = field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeyPair:
        check_curve_available()
        public, secret = zmq.curve_keypair()
        return cls(public.decode(), secret.decode())

    @classmethod
    def from_secret(cls, secret: object, what: str) -> CurveKeyPair:
        """The pair of an inline secret key (its public half is derived from it)."""
        key = secret.strip() if isinstance(secret, str) else secret
        problem = _z85_problem(key)
        if problem is not None:  # the value is a secret: not echoed
            raise ConfigError(f"{what} is not a CURVE secret key: {problem}; {_HOW}")
        assert isinstance(key, str)
        check_curve_available()
        return cls(zmq.curve_public(key.encode()).decode(), key)

    @classmethod
    def load(cls, path: str | os.PathLike[str], what: str) -> CurveKeyPair:
        """The pair in a secret key file (``NAME.key_secret``, as ``kvevents keygen`` writes)."""
        public, secret = _load_certificate(path, what)
        if secret is None:
            raise ConfigError(
                f"{what} {os.fspath(path)!r} holds only a public key; give the secret key "
                f"file (NAME.key_secret, not NAME.key); {_HOW}"
            )
        pair = cls.from_secret(secret, f"{what} {os.fspath(path)!r}")
        if pair.public != public:
            raise ConfigError(
                f"{what} {os.fspath(path)!r}: its public key is not the one of its secret key "
                f"(the file was edited); {_HOW}"
            )
        return pair


def _load_certificate(path: str | os.PathLike[str], what: str) -> tuple[str, str | None]:
    shown = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {shown!r} is not a file; {_HOW}")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:  # ValueError: no public-key line
        raise ConfigError(
            f"{what} {shown!r} cannot be read as a key file ({exc}); {_HOW}"
        ) from None
    public_text = public.decode(errors="replace") if public else ""
    problem = _z85_problem(public_text)
    if problem is not None:
        raise ConfigError(f"{what} {shown!r}: its public-key is not a CURVE key: {problem}; {_HOW}")
    secret_text = None if not secret else secret.decode(errors="replace")
    return public_text, secret_text


def load_public_key_file(path: str | os.PathLike[str], what: str) -> str:
    """The public key in a key file (``NAME.key`` or ``NAME.key_secret``)."""
    return _load_certificate(path, what)[0]


def load_public_keys_dir(path: str | os.PathLike[str], what: str) -> list[str]:
    """The public keys of every ``*.key`` file in a directory (as ``zmq.auth`` reads one)."""
    shown = os.fspath(path)
    if not os.path.isdir(path):
        raise ConfigError(
            f"{what} {shown!r} is not a directory; give a directory of subscribers' public "
            f"key files (NAME.key); {_HOW}"
        )
    return [
        load_public_key_file(file, f"{what} file")
        for file in sorted(Path(path).glob("*.key"))
        if file.is_file()
    ]


def _key_file_text(kind: str, keys: Iterable[tuple[str, str]]) -> str:
    lines = [
        f"#   ZeroMQ CURVE {kind} Certificate, written by kvevents keygen",
    ]
    if kind == "**Secret**":
        lines.append("#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.")
    lines += ["", "metadata", "curve"]
    lines += [f'    {name} = "{value}"' for name, value in keys]
    return "\n".join(lines) + "\n"


def write_key_pair(
    directory: str | os.PathLike[str], name: str, *, force: bool = False
) -> tuple[Path, Path, CurveKeyPair]:
    """Write a new pair as ``NAME.key`` (public) and ``NAME.key_secret`` (mode 0600).

    Refuses (ConfigError) to replace either file unless ``force``; returns both paths and
    the pair. A replaced file is swapped in whole (written beside it, then renamed).
    """
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"key name {name!r} must be a plain file name, e.g. 'router'")
    folder = Path(directory)
    if not folder.is_dir():
        raise ConfigError(f"key directory {os.fspath(directory)!r} does not exist; create it first")
    public_path, secret_path = folder / f"{name}.key", folder / f"{name}.key_secret"
    existing = [str(p) for p in (public_path, secret_path) if p.exists()]
    if existing and not force:
        raise ConfigError(
            f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; "
            "pass --force to replace the key pair (subscribers or publishers using the old "
            "keys are then refused), or choose another --name"
        )
    pair = CurveKeyPair.generate()
    # Both files are written in full before either replaces its old one: a write that
    # fails (a full disk) leaves the old pair as it was, not a new public key whose
    # secret was never written.
    written: list[Path] = []
    try:
        written.append(_written_beside(secret_path, _secret_text(pair), 0o600))
        written.append(
            _written_beside(
                public_path, _key_file_text("Public", [("public-key", pair.public)]), 0o644
            )
        )
        os.replace(written[0], secret_path)
        os.replace(written[1], public_path)
    finally:
        for temporary in written:  # none are left once both are in place
            temporary.unlink(missing_ok=True)
    return public_path, secret_path, pair


def _secret_text(pair: CurveKeyPair) -> str:
    return _key_file_text("**Secret**", [("public-key", pair.public), ("secret-key", pair.secret)])


def _written_beside(path: Path, text: str, mode: int) -> Path:
    """``text`` written whole (and synced) to a new file beside ``path``, to be renamed to
    it; a name of its own (``mkstemp``), so a file a killed run left cannot be in the way."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    temporary = Path(name)
    try:
        try:
            os.fchmod(fd, mode)  # mkstemp made it 0600; the public file is 0644
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return temporary
