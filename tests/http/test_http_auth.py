"""API keys, TLS files and client credentials (kvevents.http.auth), and the engine's publisher host."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import trustme

from kvevents.errors import ConfigError
from kvevents.http.auth import (
    ApiKey,
    ClientCredentials,
    ServerTLS,
    resolve_secret,
    unauthorized_answer,
)
from kvevents.publish.config import KVEventsConfig
from process_support import run_kvevents

ENV = "KVEVENTS_TEST_API_KEY"


def test_the_option_wins_over_the_file_and_the_file_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Precedence: --api-key, then --api-key-file, then the environment variable; none: None."""
    monkeypatch.delenv(ENV, raising=False)
    assert resolve_secret(None, None, ENV, "--api-key") is None
    monkeypatch.setenv(ENV, "from-env")
    assert resolve_secret(None, None, ENV, "--api-key") == "from-env"
    path = tmp_path / "key"
    path.write_text("from-file\n# ignored second line\n")
    assert resolve_secret(None, str(path), ENV, "--api-key") == "from-file"
    assert resolve_secret("from-option", str(path), ENV, "--api-key") == "from-option"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "--api-key: the key is empty"),
        ("two words", "printable ASCII without spaces"),
        ("clé", "printable ASCII without spaces"),
    ],
)
def test_keys_a_header_cannot_carry_are_refused(value: str, message: str) -> None:
    """An empty key, or one that is not printable ASCII without spaces, is a ConfigError naming the option."""
    with pytest.raises(ConfigError, match=message):
        resolve_secret(value, None, ENV, "--api-key")


def test_an_unreadable_or_empty_key_file_is_refused_naming_it(tmp_path: Path) -> None:
    """A missing file and an empty one each name the option and the path; no key text appears."""
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=f"--api-key-file {missing} cannot be read"):
        resolve_secret(None, str(missing), ENV, "--api-key")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="the key is empty"):
        resolve_secret(None, str(empty), ENV, "--api-key")


def test_the_key_matches_only_the_exact_bearer_value() -> None:
    """Bearer with the exact key matches (scheme in any case); a wrong key, another scheme or no header does not."""
    key = ApiKey("s3cret")
    assert key.matches([(b"host", b"x"), (b"authorization", b"Bearer s3cret")])
    assert key.matches([(b"authorization", b"bearer s3cret")])
    assert not key.matches([(b"authorization", b"Bearer s3cre")])
    assert not key.matches([(b"authorization", b"Bearer s3cretX")])
    assert not key.matches([(b"authorization", b"Basic s3cret")])
    assert not key.matches([(b"authorization", b"s3cret")])
    assert not key.matches([(b"host", b"x")])


def test_the_key_is_never_shown_and_survives_pickling() -> None:
    """repr and str hide the key; a pickled key (router --workers) still matches."""
    key = ApiKey("s3cret")
    assert "s3cret" not in repr(key) and "s3cret" not in str(key)
    assert "s3cret" not in repr(ClientCredentials(api_key="s3cret"))
    copy = pickle.loads(pickle.dumps(key))
    assert copy.matches([(b"authorization", b"Bearer s3cret")])


def test_a_401_uses_openai_error_shape_on_v1_paths() -> None:
    """/v1/ paths get {"error": {message, type, code}}; others {"error": message}; both say Bearer."""
    headers, body = unauthorized_answer("/v1/completions", has_header=False)
    assert (b"www-authenticate", b'Bearer realm="kvevents"') in headers
    assert b'"type": "authentication_error"' in body and b'"code": 401' in body
    assert b"missing API key" in body
    _, body = unauthorized_answer("/route", has_header=True)
    assert body.startswith(b'{"error": "wrong API key')


def test_tls_files_are_checked_at_start(tmp_path: Path) -> None:
    """A certificate without its key, an unreadable file or a mismatched pair is a ConfigError naming the option."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    assert ServerTLS.from_options(None, None) is None
    assert ServerTLS.from_options(str(cert_path), str(key_path)) is not None
    with pytest.raises(ConfigError, match="--ssl-certfile needs --ssl-keyfile"):
        ServerTLS.from_options(str(cert_path), None)
    with pytest.raises(ConfigError, match=r"--ssl-keyfile .* cannot be read"):
        ServerTLS.from_options(str(cert_path), str(tmp_path / "nope"))
    other = tmp_path / "other.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other))
    with pytest.raises(ConfigError, match="not a certificate and its private key"):
        ServerTLS.from_options(str(cert_path), str(other))
    bad_ca = tmp_path / "ca.pem"
    bad_ca.write_text("not a certificate")
    with pytest.raises(ConfigError, match="--ssl-ca-certs"):
        ClientCredentials(ca_certs=str(bad_ca))


def test_engine_publishers_bind_the_given_host_in_place_of_a_wildcard() -> None:
    """tcp://*:P becomes HOST:P, bound explicitly; a named host, connect mode or a wildcard HOST is left alone."""
    config = KVEventsConfig(
        publisher="zmq", endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600"
    )
    local = config.bound_to("127.0.0.1")
    assert local.endpoint == "tcp://127.0.0.1:5557" and local.bind is True
    assert local.replay_endpoint == "tcp://127.0.0.1:5600"
    assert config.bound_to("*") is config
    assert config.bound_to("::1").endpoint == "tcp://[::1]:5557"
    named = KVEventsConfig(publisher="zmq", endpoint="tcp://10.0.0.5:5557")
    assert named.bound_to("127.0.0.1") == named
    connecting = KVEventsConfig(publisher="zmq", endpoint="tcp://*:5557", bind=False)
    assert connecting.bound_to("127.0.0.1").endpoint == "tcp://*:5557"
    with pytest.raises(ConfigError, match="--kv-events-host"):
        config.bound_to("bad host")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["router", "--engine", "http://127.0.0.1:1", "--workers", "1", "--metrics-auth"],
            "--metrics-auth needs --api-key",
        ),
        (
            ["router", "--engine", "http://127.0.0.1:1", "--engine-api-key-file", "/nonexistent/k"],
            "--engine-api-key-file /nonexistent/k cannot be read",
        ),
        (
            ["router", "--engine", "http://127.0.0.1:1", "--ssl-certfile", "/nonexistent/c"],
            "--ssl-certfile needs --ssl-keyfile",
        ),
        (["engine", "--port", "0", "--api-key", "a b"], "printable ASCII without spaces"),
        (["engine", "--port", "0", "--kv-events-host", "no such host!"], "--kv-events-host"),
    ],
)
def test_bad_key_and_tls_options_exit_2_naming_the_option(argv: list[str], message: str) -> None:
    """Each command refuses a bad key, key file, TLS pair or publisher host before it starts, exit 2."""
    result = run_kvevents(*argv)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "ready" not in result.stdout


def test_every_client_of_a_process_shares_one_tls_context_per_bundle(tmp_path: Path) -> None:
    """Credentials built apart hand out the same context for the same trust (a trust
    store is loaded once per process), a different one for another bundle, and a bad
    bundle still fails every time rather than being remembered as good."""
    assert ClientCredentials().verify() is ClientCredentials(api_key="k").verify()
    ca_path = tmp_path / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(ca_path))
    own = ClientCredentials(ca_certs=str(ca_path)).verify()
    assert own is ClientCredentials(ca_certs=str(ca_path)).verify()
    assert own is not ClientCredentials().verify()
    assert own.verify_mode.name == "CERT_REQUIRED" and own.check_hostname
    missing = tmp_path / "later.pem"
    for _ in range(2):
        with pytest.raises(ConfigError, match="--ssl-ca-certs"):
            ClientCredentials(ca_certs=str(missing))
    trustme.CA().cert_pem.write_to_path(str(missing))
    assert ClientCredentials(ca_certs=str(missing)).verify() is not own
