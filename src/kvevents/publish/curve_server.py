"""CURVE on a publisher's sockets: the server keys, the ZAP check, the refusals counted.

When the ``--kv-events-config`` holds CURVE keys (:mod:`kvevents.publish.config`), the
live PUB and the replay ROUTER of a
:class:`~kvevents.publish.zmq_publisher.ZmqEventPublisher` become CURVE servers: every
connection is encrypted, and a subscriber is served only when its public key is allowed.

* :meth:`CurveServer.secure` sets the server keys and a ZAP domain of this publisher's
  own on a socket, before it binds, and attaches a monitor to it.
* The ZAP authenticator (``zmq.auth.thread.ThreadAuthenticator``) answers libzmq's
  "may this client key in?". libzmq allows one ZAP handler per context, so one
  authenticator serves every CURVE publisher of a context (counted, stopped by the last
  to close), each checking its own allowed keys under its own domain.
* A monitor thread counts the handshake failures of both sockets, because ZeroMQ refuses
  silently: an unknown client key fails in ZAP (``HANDSHAKE_FAILED_AUTH``), a wrong server
  key or no CURVE fails before it (``HANDSHAKE_FAILED_PROTOCOL``). Each is counted
  (:attr:`CurveServer.refused`) and logged at most once per ``LOG_INTERVAL`` per reason.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from typing import ClassVar

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from kvevents.errors import ConfigError
from kvevents.publish.config import KVEventsConfig
from kvevents.transport.curve_keys import CurveKeyPair

__all__ = ["CurveServer"]

log = logging.getLogger("kvevents.publish.curve")

_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_PROTOCOL_REASONS: dict[int, str] = {
    int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH): "the client does not use CURVE (no key given)",
    int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC): "the client encrypts to another server key "
    "(its server key is not this publisher's public key)",
}
_ids = itertools.count()


def _reason(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the client's key is not among the allowed subscribers (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return _PROTOCOL_REASONS.get(value, f"CURVE protocol error {value:#x}")
    return f"the handshake failed (errno {value}: e.g. a client without CURVE, or it left)"


class _AllowedKeys:
    """The ZAP callback of one publisher: its allowed keys; denials logged with the key."""

    def __init__(self, allowed: frozenset[str], rank: int) -> None:
        self.allowed = frozenset(key.encode() for key in allowed)
        self.rank = rank
        self.named: set[bytes] = set()

    MAX_NAMED: ClassVar[int] = 1000  # refused keys logged by name, once each

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        if key in self.named or len(self.named) >= self.MAX_NAMED:
            return False  # the monitor's rate-limited count covers the repeats
        self.named.add(key)
        log.warning(
            "publisher rank %d refused a subscriber with public key %s: not among the allowed "
            "keys (add it to curve_allowed_keys or curve_allowed_keys_dir)",
            self.rank,
            key.decode(errors="replace"),
        )
        return False


class _SharedAuthenticator:
    """One started ThreadAuthenticator per context, with the number of publishers using it."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _by_context: ClassVar[
        weakref.WeakKeyDictionary[zmq.Context[zmq.Socket[bytes]], _SharedAuthenticator]
    ] = weakref.WeakKeyDictionary()

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.auth = ThreadAuthenticator(context, log=logging.getLogger("kvevents.publish.zap"))
        self.users = 0

    @classmethod
    def acquire(cls, context: zmq.Context[zmq.Socket[bytes]]) -> _SharedAuthenticator:
        with cls._lock:
            shared = cls._by_context.get(context)
            if shared is None:
                shared = cls(context)
                try:
                    shared.auth.start()  # binds inproc://zeromq.zap.01 in this context
                except zmq.ZMQError as exc:
                    raise ConfigError(
                        f"cannot start the CURVE authenticator ({exc}): another ZAP handler "
                        "is bound in this ZMQ context; give the publisher a context of its "
                        "own (context=zmq.Context())"
                    ) from None
                cls._by_context[context] = shared
            shared.users += 1
            return shared

    def release(self, context: zmq.Context[zmq.Socket[bytes]], domain: str) -> None:
        with self._lock:
            self.auth.credentials_providers.pop(domain, None)
            self.users -= 1
            if self.users == 0:
                self._by_context.pop(context, None)
                self.auth.stop()


class CurveServer:
    """CURVE for one publisher's sockets (see the module docstring); not a socket owner.

    Lifecycle: construct (the context's authenticator is started), :meth:`secure` each
    socket before binding it, :meth:`start` the monitor thread, :meth:`close` after the
    sockets are closed (idempotent).
    """

    LOG_INTERVAL: ClassVar[float] = 10.0

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        key_pair: CurveKeyPair,
        allowed: frozenset[str],
        rank: int,
    ) -> None:
        self.key_pair = key_pair
        self.rank = rank
        self.domain = f"kvevents-publisher-{rank}-{next(_ids)}"
        self.handshakes = 0
        self.refused = 0
        self._context = context
        self._monitors: dict[zmq.Socket[bytes], str] = {}
        self._last_log: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        self._shared = _SharedAuthenticator.acquire(context)
        self._shared.auth.configure_curve_callback(self.domain, _AllowedKeys(allowed, rank))
        self._stop_tx = context.socket(zmq.PAIR)
        self._stop_rx = context.socket(zmq.PAIR)
        stop_address = f"inproc://{self.domain}-stop"
        self._stop_rx.bind(stop_address)
        self._stop_tx.connect(stop_address)
        self._thread = threading.Thread(
            target=self._run, name=f"kvevents-curve-{rank}", daemon=True
        )
        self._closed = False

    @classmethod
    def configured(
        cls,
        context: zmq.Context[zmq.Socket[bytes]],
        rank: int,
        *,
        curve_secret_key_file: str | None,
        curve_secret_key: str | None,
        curve_allowed_keys: list[str] | None,
        curve_allowed_keys_dir: str | None,
    ) -> CurveServer | None:
        """The server the ``--kv-events-config`` CURVE keys describe (None: no CURVE).

        Raises ConfigError naming a bad key or file (the checks of KVEventsConfig).
        """
        config = KVEventsConfig(
            curve_secret_key_file=curve_secret_key_file,
            curve_secret_key=curve_secret_key,
            curve_allowed_keys=curve_allowed_keys,
            curve_allowed_keys_dir=curve_allowed_keys_dir,
        )
        pair = config.curve_key_pair()
        if pair is None:
            return None
        return cls(context, pair, config.curve_allowed_public_keys(), rank)

    @property
    def public_key(self) -> str:
        return self.key_pair.public

    def secure(self, sock: zmq.Socket[bytes], role: str) -> None:
        """Make ``sock`` (not bound yet) a CURVE server of this publisher, and monitor it."""
        sock.curve_server = True
        sock.curve_secretkey = self.key_pair.secret.encode()
        sock.curve_publickey = self.key_pair.public.encode()
        sock.zap_domain = self.domain.encode()
        self._monitors[sock.get_monitor_socket(_HANDSHAKE_EVENTS)] = role

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the monitor thread, close its sockets, release the authenticator."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._stop_tx.send(b"")
            self._thread.join(timeout=2.0)
        for monitor in self._monitors:
            monitor.close(linger=0)
        self._stop_tx.close(linger=0)
        self._stop_rx.close(linger=0)
        self._shared.release(self._context, self.domain)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._stop_rx, zmq.POLLIN)
        for monitor in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll():
                if sock is self._stop_rx:
                    return
                self._read(sock)

    def _read(self, monitor: zmq.Socket[bytes]) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:  # the monitored socket is gone
                return
            kind = int(event["event"])
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshakes += 1
            elif kind & _HANDSHAKE_EVENTS:
                self.refused += 1
                self._log(self._monitors[monitor], _reason(kind, int(event["value"])))

    def _log(self, role: str, reason: str) -> None:
        key = f"{role}: {reason}"
        self._unlogged[key] = self._unlogged.get(key, 0) + 1
        now = time.monotonic()
        if now - self._last_log.get(key, -self.LOG_INTERVAL) < self.LOG_INTERVAL:
            return
        count = self._unlogged.pop(key)
        self._last_log[key] = now
        log.warning(
            "publisher rank %d refused %d CURVE handshake(s) on its %s socket: %s "
            "(%d refused in all; the subscriber gets no data)",
            self.rank,
            count,
            role,
            reason,
            self.refused,
        )
