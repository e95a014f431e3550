"""The frontend's gate, pure: keys found in constant time, per-key token buckets and in-flight caps, config checks."""

from __future__ import annotations

import hmac
from pathlib import Path

import pytest

from dynamo_cli.config import AuthConfig, TlsConfig, read_api_keys
from dynamo_cli.errors import ConfigError
from dynamo_cli.frontend import auth
from dynamo_cli.frontend.auth import Gate, KeyTable, RateLimited, TokenBucket, Unauthorized, presented_key

KEYS = ("key-one", "key-two", "key-three")


def bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"host", b"x"), (b"authorization", b"Bearer " + key.encode())]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param([(b"authorization", b"Bearer abc")], b"abc", id="bearer"),
        pytest.param([(b"authorization", b"bearer  abc ")], b"abc", id="bearer-any-case-and-spaces"),
        pytest.param([(b"x-api-key", b"abc")], b"abc", id="x-api-key"),
        pytest.param([(b"x-api-key", b"xyz"), (b"authorization", b"Bearer abc")], b"abc", id="bearer-wins"),
        pytest.param([(b"authorization", b"Basic abc")], None, id="basic-is-not-a-key"),
        pytest.param([(b"authorization", b"Bearer ")], None, id="empty-bearer"),
        pytest.param([], None, id="none"),
    ],
)
def test_the_presented_key_comes_from_bearer_or_x_api_key(
    headers: list[tuple[bytes, bytes]], expected: bytes | None
) -> None:
    assert presented_key(headers) == expected


def test_a_key_is_found_among_several_and_every_key_is_always_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    table = KeyTable(KEYS)
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    assert table.match(b"key-one") == 0
    assert table.match(b"key-three") == 2
    assert table.match(b"key-on") is None
    assert table.match(b"") is None
    assert table.match(None) is None
    assert len(calls) == 5 * len(KEYS)  # no early exit, whether or not a key matched


def test_a_request_without_a_key_or_with_a_wrong_one_is_unauthorized() -> None:
    gate = Gate(AuthConfig(KEYS))
    with pytest.raises(Unauthorized, match="missing API key") as missing:
        gate.admit([(b"host", b"x")], 0.0)
    assert (missing.value.status, missing.value.code, missing.value.error_type) == (
        401,
        "invalid_api_key",
        "invalid_request_error",
    )
    with pytest.raises(Unauthorized, match="invalid API key"):
        gate.admit(bearer("key-four"), 0.0)
    gate.admit(bearer("key-two"), 0.0).release()
    gate.admit([(b"x-api-key", b"key-three")], 0.0).release()


@pytest.mark.parametrize(
    ("metrics_require_key", "open_paths"),
    [
        pytest.param(False, {"/health", "/live", "/metrics"}, id="metrics-open"),
        pytest.param(True, {"/health", "/live"}, id="metrics-keyed"),
    ],
)
def test_only_the_probes_and_maybe_metrics_are_open(metrics_require_key: bool, open_paths: set[str]) -> None:
    gate = Gate(AuthConfig(KEYS, metrics_require_key=metrics_require_key))
    paths = [
        "/health",
        "/live",
        "/metrics",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/",
        "/health/",
        "/nope",
    ]
    assert {p for p in paths if gate.is_open(p)} == open_paths


def test_a_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    bucket = TokenBucket(rate=2.0, burst=2.0, tokens=2.0, updated_at=0.0)
    assert [bucket.take(0.0), bucket.take(0.0)] == [0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.5)
    assert bucket.take(0.25) == pytest.approx(0.25)
    assert bucket.take(0.5) == 0.0
    assert bucket.take(100.0) == 0.0  # idle for long: back to the burst, no more
    assert bucket.take(100.0) == 0.0
    assert bucket.take(100.0) > 0.0


def test_each_key_has_its_own_request_rate() -> None:
    gate = Gate(AuthConfig(KEYS, rps=1.0))
    gate.admit(bearer("key-one"), 10.0).release()
    with pytest.raises(RateLimited, match=r"over 1 requests/s") as limited:
        gate.admit(bearer("key-one"), 10.2)
    assert (limited.value.status, limited.value.code, limited.value.retry_after) == (
        429,
        "rate_limit_exceeded",
        pytest.approx(0.8),
    )
    gate.admit(bearer("key-two"), 10.2).release()  # another key is not slowed
    gate.admit(bearer("key-one"), 11.0).release()


def test_each_key_has_its_own_in_flight_cap_and_release_is_idempotent() -> None:
    gate = Gate(AuthConfig(KEYS, max_inflight=2))
    first, second = gate.admit(bearer("key-one"), 0.0), gate.admit(bearer("key-one"), 0.0)
    with pytest.raises(RateLimited, match="2 requests in flight") as limited:
        gate.admit(bearer("key-one"), 0.0)
    assert limited.value.retry_after == 1.0
    gate.admit(bearer("key-two"), 0.0)
    first.release()
    first.release()
    assert gate.inflight == [1, 1, 0]
    gate.admit(bearer("key-one"), 0.0)
    second.release()
    assert gate.inflight == [1, 1, 0]


def test_api_keys_come_from_flags_else_the_environment_plus_a_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# deploy keys\nfile-key-1\n\n  file-key-2  \nflag-a\n")
    env = {"DYN_API_KEYS": "env-1, env-2,"}
    assert read_api_keys(["flag-a", "flag-b"], None, env).keys == ("flag-a", "flag-b")
    assert read_api_keys([], None, env).keys == ("env-1", "env-2")
    assert read_api_keys([], None, {}).keys == ()
    assert read_api_keys(["flag-a"], str(key_file), env).keys == ("flag-a", "file-key-1", "file-key-2")
    (tmp_path / "empty").write_text("# none yet\n")
    with pytest.raises(ConfigError, match="holds no key"):
        read_api_keys([], str(tmp_path / "empty"), {})
    with pytest.raises(ConfigError, match="cannot be read"):
        read_api_keys([], str(tmp_path / "missing"), {})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"rps": 5.0}, "need API keys", id="rps-without-keys"),
        pytest.param({"metrics_require_key": True}, "need API keys", id="metrics-without-keys"),
        pytest.param({"api_keys": ("k",), "max_inflight": -1}, "must be >= 0", id="negative"),
        pytest.param({"api_keys": ("a key",)}, "printable ASCII", id="space-in-key"),
    ],
)
def test_bad_auth_settings_are_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AuthConfig(**kwargs)  # type: ignore[arg-type]


def test_tls_needs_cert_and_key_together_and_existing_files(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match="--tls-cert-file was given without --tls-key-file"):
        TlsConfig(cert_file=str(cert))
    with pytest.raises(ConfigError, match="--tls-key-file was given without --tls-cert-file"):
        TlsConfig(key_file=str(cert))
    with pytest.raises(ConfigError, match=r"--tls-key-file '.*missing.pem' is not a readable file"):
        TlsConfig(cert_file=str(cert), key_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="--tls-ca-file .* needs"):
        TlsConfig(ca_file=str(cert))
    assert TlsConfig(cert_file=str(cert), key_file=str(cert)).is_enabled
    assert not TlsConfig().is_enabled
