"""Fixtures the router's NATS security tests share: a throwaway PKI, nats-server running
docs/security.md's configuration, and a plain one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from nats_support import NatsServer
from sync_security_support import PASSWORDS, Pki, fleet_config, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA with server and client certificates, made for the module."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def fleet(pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NatsServer]:
    """nats-server running docs/security.md's configuration, on 127.0.0.1 and a free port."""
    monkeypatch.setenv("ROUTER_A_PASSWORD", PASSWORDS["router-a"])
    monkeypatch.setenv("ROUTER_B_PASSWORD", PASSWORDS["router-b"])
    server = NatsServer(extra=("-c", str(fleet_config(pki, tmp_path))))
    yield server
    server.kill()


@pytest.fixture
def plain() -> Iterator[NatsServer]:
    """nats-server with no authentication and no TLS."""
    server = NatsServer()
    yield server
    server.kill()
