"""The HTTP serving helpers shared by `kvevents engine` and `kvevents router`."""

from __future__ import annotations

import socket

import pytest

from kvevents import EndpointError
from kvevents.http.serving import bind_http, http_url


def test_taken_port_is_an_endpoint_error_naming_the_address() -> None:
    """Binding a port another socket listens on raises EndpointError with the address and the fix."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(EndpointError, match=rf"router HTTP address 127.0.0.1:{port} .*--port"):
            bind_http("127.0.0.1", port, "router")


def test_port_zero_is_resolved_and_wildcards_shown_as_loopback() -> None:
    """Port 0 binds an OS-chosen port, and the URL of a wildcard bind is a loopback URL."""
    sock = bind_http("0.0.0.0", 0, "engine")
    try:
        url = http_url("0.0.0.0", sock)
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    finally:
        sock.close()
