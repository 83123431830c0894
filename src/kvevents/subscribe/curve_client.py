"""CURVE on a subscriber's sockets: the client keys, and what a failed handshake means.

A publisher configured with CURVE keys (:mod:`kvevents.publish.curve_server`) serves
only clients that know its public key (the *server key*, per stream:
:attr:`~kvevents.subscribe.stream_spec.StreamSpec.curve_server_key`, or the subscriber's
default) and present a key pair it allows. :func:`secure_client` sets both on a SUB or
DEALER socket before it connects. A stream with no server key connects in the clear, as
SGLang and vLLM publish.

ZeroMQ reports a refused handshake only to the socket monitor;
:func:`handshake_failure_reason` turns the monitor event into the sentence the
subscriber's stats and ``Unreachable`` signal show.
"""

from __future__ import annotations

import errno

import zmq

from kvevents.transport.curve_keys import CurveKeyPair

__all__ = ["HANDSHAKE_EVENTS", "HANDSHAKE_TIMEOUT_MS", "handshake_failure_reason", "secure_client"]

HANDSHAKE_TIMEOUT_MS = 10_000
"""How long a connection may take to complete its ZMTP handshake (``ZMQ_HANDSHAKE_IVL``;
libzmq's default is 30 s). A handshake takes milliseconds on any network a fleet runs
on (a CURVE one waits for the publisher's authenticator, a Python thread, so an engine
that holds the GIL for seconds delays it: hence 10 s, not less); what takes longer is
an address where something other than a ZMQ publisher listens (an HTTP port, say),
which would otherwise look connected for 30 s before it was reported."""

HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_HOW = (
    "give the publisher's public key (--curve-server-key, or the engine advertises it) and "
    "a key pair it allows (--curve-secret-key-file; make one with `kvevents keygen`)"
)


def secure_client(
    sock: zmq.Socket[bytes], key_pair: CurveKeyPair | None, server_key: str | None
) -> None:
    """Make ``sock`` (not connected yet) a CURVE client when ``server_key`` is given.

    A server key without a key pair leaves the socket plain: the publisher refuses it,
    and that refusal is reported (the reason says what is missing).
    """
    if server_key is None or key_pair is None:
        return
    sock.curve_serverkey = server_key.encode()
    sock.curve_publickey = key_pair.public.encode()
    sock.curve_secretkey = key_pair.secret.encode()


def handshake_failure_reason(
    event: int, value: int, server_key: str | None, key_pair: CurveKeyPair | None
) -> str:
    """Why a handshake failed, from the client's side, with what to do about it.

    ``event`` is the monitor's event, ``value`` its errno or protocol error (0: the
    connection dropped before the handshake ended, and libzmq reported nothing more).
    """
    if server_key is not None and key_pair is None:
        return "the publisher requires CURVE but this subscriber has no key pair: no data; " + _HOW
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"the publisher refused this subscriber's key {key_pair.public if key_pair else ''} "
            f"(status {value}: not among its allowed keys): no data; add the public key to "
            "the engine's curve_allowed_keys or curve_allowed_keys_dir"
        )
    if (
        event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    ):
        if server_key is None:
            return (
                f"the publisher requires CURVE and this stream has no server key: no data; {_HOW}"
            )
        return (
            "this subscriber uses CURVE but the publisher does not (its config has no "
            "curve_secret_key_file): no data; drop the server key for this engine"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"the CURVE handshake failed (protocol error {value:#x}): no data; {_HOW}"
    if server_key is not None:
        return (
            f"the CURVE handshake did not complete (is {server_key} the publisher's public "
            f"key, and this its endpoint?): no data; {_HOW}"
        )
    if value in (errno.EAGAIN, errno.ETIMEDOUT):
        return (
            f"no ZMQ handshake within {HANDSHAKE_TIMEOUT_MS / 1000:g} s: something accepts "
            "TCP connections at this address but does not speak ZMQ (an HTTP port?): no "
            "data; check the endpoint (the engine's /server_info lists its event endpoints)"
        )
    # what closes the connection mid-handshake: a ZMQ socket of another kind, or (when
    # libzmq reports no mechanism mismatch, as it at times does not) a CURVE publisher
    # (no errno in the text: libzmq reports the same refusal with one or with none,
    # and a new text is reported as a new refusal)
    return (
        "the peer closed the connection during the ZMQ handshake: no data until a "
        "handshake succeeds (retried); if this lasts, either the "
        "address is not a PUB socket (a replay endpoint given as the live one?: the "
        "engine's /server_info lists its event endpoints), or the publisher requires "
        f"CURVE and this stream has no server key: {_HOW}"
    )
