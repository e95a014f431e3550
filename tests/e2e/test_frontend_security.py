"""Strangers kept out of `dyn serve --engine mocker`: API keys, per-key limits, TLS and mutual TLS, end to end.

Each attack from issue 18 runs against a real deployment and now fails to get in: no key → 401, a
wrong key → 401, a client without a certificate → refused by mutual TLS. The official openai client
with the right key is served, over HTTP and HTTPS.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.conftest import DynProcess, start_dyn

MOCKER = ("--engine", "mocker", "--speedup-ratio", "10", "--workers", "1")
KEYS = ("sk-test-first-0123456789", "sk-test-second-0123456789")


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    """Factory: `serve(*flags, env=...)` → a ready mocker deployment; stopped after the test."""
    started: list[DynProcess] = []

    def factory(*flags: str, env: dict[str, str] | None = None) -> DynProcess:
        args = ["serve", *MOCKER, "--port", "0", "--discovery", f"file://{tmp_path}/discovery", *flags]
        started.append(start_dyn(args, env=env))
        return started[-1]

    yield factory
    for handle in started:
        handle.stop()


def chat(client: openai.OpenAI) -> str:
    reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    return reply.choices[0].finish_reason


def assert_unauthorized(response: httpx.Response) -> None:
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    assert "Authorization: Bearer" in error["message"]


##### API keys #####


def test_api_keys_keep_out_callers_without_the_right_key(serve) -> None:  # type: ignore[no-untyped-def]
    d = serve("--api-key", KEYS[0], "--api-key", KEYS[1])
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(base_url=d.url, timeout=30) as http:
        assert_unauthorized(http.post("/v1/chat/completions", json=body))
        assert_unauthorized(http.post("/v1/completions", json={"model": "smollm2", "prompt": "x"}))
        assert_unauthorized(http.get("/v1/models"))
        assert_unauthorized(http.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer nope"}))
        assert_unauthorized(http.get("/v1/models", headers={"x-api-key": KEYS[0] + "x"}))
        assert http.get("/v1/models", headers={"x-api-key": KEYS[1]}).status_code == 200
        assert http.get("/health").status_code == 200
        assert http.get("/live").status_code == 200
        metrics = http.get("/metrics")  # open without --metrics-require-key
        assert metrics.status_code == 200
        assert 'dynamo_frontend_auth_refused_total{code="invalid_api_key"} 5.0' in metrics.text
    for key in KEYS:
        assert chat(openai.OpenAI(base_url=f"{d.url}/v1", api_key=key, max_retries=0, timeout=30)) == "length"
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        chat(openai.OpenAI(base_url=f"{d.url}/v1", api_key="sk-wrong", max_retries=0, timeout=30))


def test_keys_from_env_and_file_with_keyed_metrics_and_per_key_limits(serve, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    key_file = tmp_path / "keys"
    key_file.write_text("# metrics scraper\nsk-file-key\n")
    # --speedup-ratio 0.05 (the last one given wins): the open stream below must still be generating on
    # the server when the next request comes (20x slower than the modelled GPU, its 2,000 tokens take
    # minutes), not finished into the socket buffers already while this client waited for the CPU.
    d = serve(
        "--api-key-file",
        str(key_file),
        "--metrics-require-key",
        "--api-key-rps",
        "1",
        "--api-key-max-inflight",
        "1",
        "--speedup-ratio",
        "0.05",
        env={"DYN_API_KEYS": "sk-env-a,sk-env-b"},
    )
    with httpx.Client(base_url=d.url, timeout=30) as http:
        assert_unauthorized(http.get("/metrics"))
        assert http.get("/metrics", headers={"authorization": "Bearer sk-file-key"}).status_code == 200
        assert http.get("/health").status_code == 200
        # rate: one request a second per key, so the second in a row is refused with Retry-After
        assert http.get("/v1/models", headers={"x-api-key": "sk-env-a"}).status_code == 200
        limited = http.get("/v1/models", headers={"x-api-key": "sk-env-a"})
        assert limited.status_code == 429
        assert limited.headers["retry-after"] == "1"
        assert limited.json()["error"]["code"] == "rate_limit_exceeded"
        assert "requests/s" in limited.json()["error"]["message"]
        # concurrency: while one stream of sk-env-b is open, its next request is refused
        stream_body = {"model": "smollm2", "prompt": "x", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        auth_b = {"authorization": "Bearer sk-env-b"}
        with http.stream("POST", "/v1/completions", json=stream_body, headers=auth_b) as open_stream:
            assert open_stream.status_code == 200
            # Keep the line iterator alive: a discarded one is closed by the garbage collector, which closes
            # the response, and the server then (rightly) ends the stream and frees its in-flight slot.
            lines = open_stream.iter_lines()
            first = next(line for line in lines if line)
            assert first.startswith("data: {") and '"error"' not in first, first
            busy = http.get("/v1/models", headers=auth_b)
            assert busy.status_code == 429
            assert busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "rate_limit_exceeded"
            assert "requests in flight" in busy.json()["error"]["message"], busy.text  # in flight wins over rate
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key="sk-env-a", max_retries=0, timeout=30)
    with pytest.raises(openai.RateLimitError):
        for _ in range(3):
            chat(client)


##### TLS #####


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    is_client: bool = False,
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now, minute = datetime.datetime.now(datetime.UTC), datetime.timedelta(minutes=1)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - 5 * minute)
        .not_valid_after(now + 60 * minute)
    )
    if issuer is None:  # the CA itself
        builder = builder.issuer_name(name).add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        return builder.sign(key, hashes.SHA256())
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if is_client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = builder.issuer_name(issuer[0].subject).add_extension(x509.ExtendedKeyUsage([usage]), False)
    if not is_client:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
    return builder.sign(issuer[1], hashes.SHA256())


def _write(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    ca_key, server_key, client_key = _key(), _key(), _key()
    ca = _cert("dyn test CA", ca_key, None)
    return {
        "ca": _write(tmp_path, "ca", ca, ca_key),
        "server": _write(tmp_path, "server", _cert("127.0.0.1", server_key, (ca, ca_key)), server_key),
        "client": _write(tmp_path, "client", _cert("client", client_key, (ca, ca_key), is_client=True), client_key),
    }


def trusting(pki: dict[str, tuple[str, str]], *, with_cert: bool = False) -> ssl.SSLContext:
    """A client context trusting the test CA, presenting the client certificate if asked."""
    context = ssl.create_default_context(cafile=pki["ca"][0])
    if with_cert:
        context.load_cert_chain(*pki["client"])
    return context


@pytest.mark.parametrize("http_server", ["uvicorn", "hypercorn"])
def test_tls_serves_https_to_the_openai_client_with_a_key(serve, pki, http_server: str) -> None:  # type: ignore[no-untyped-def]
    cert, key = pki["server"]
    d = serve("--http-server", http_server, "--tls-cert-file", cert, "--tls-key-file", key, "--api-key", KEYS[0])
    assert d.url.startswith("https://127.0.0.1:")
    with httpx.Client(verify=trusting(pki)) as tls:
        client = openai.OpenAI(base_url=f"{d.url}/v1", api_key=KEYS[0], max_retries=0, timeout=30, http_client=tls)
        assert chat(client) == "length"
    with httpx.Client(verify=trusting(pki), timeout=30) as http:
        assert_unauthorized(http.get(f"{d.url}/v1/models"))
    with pytest.raises(httpx.TransportError):  # plain HTTP to the TLS port
        httpx.get(d.url.replace("https://", "http://") + "/health", timeout=10)


def test_an_idle_tls_client_does_not_hold_the_exit_on_sigterm(serve, pki) -> None:  # type: ignore[no-untyped-def]
    # A TLS close waits for the client's close_notify, which an idle keep-alive client never sends: uvicorn's
    # graceful shutdown held `dyn serve` for 30 s (this fixture killed it at 15). Idle connections are
    # now aborted at shutdown. (hypercorn still waits: its connection tasks close their own streams.)
    cert, key = pki["server"]
    d = serve("--tls-cert-file", cert, "--tls-key-file", key, "--api-key", KEYS[0])
    with httpx.Client(verify=trusting(pki)) as tls:
        client = openai.OpenAI(base_url=f"{d.url}/v1", api_key=KEYS[0], max_retries=0, timeout=30, http_client=tls)
        assert chat(client) == "length"  # its connection stays open, idle
        started = time.monotonic()

        assert d.stop() == 0
        assert time.monotonic() - started < 5


@pytest.mark.parametrize("http_server", ["uvicorn", "hypercorn"])
def test_mutual_tls_refuses_a_client_without_a_certificate(serve, pki, http_server: str) -> None:  # type: ignore[no-untyped-def]
    cert, key = pki["server"]
    d = serve(
        "--http-server", http_server, "--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-file", pki["ca"][0]
    )
    with pytest.raises(httpx.TransportError), httpx.Client(verify=trusting(pki), timeout=10) as http:
        http.get(f"{d.url}/health")
    with httpx.Client(verify=trusting(pki, with_cert=True)) as tls:
        client = openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=30, http_client=tls)
        assert chat(client) == "length"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(
            ("--tls-cert-file", "/nonexistent/cert.pem", "--tls-key-file", "/nonexistent/key.pem"),
            "--tls-cert-file '/nonexistent/cert.pem' is not a readable file",
            id="missing-file",
        ),
        pytest.param(
            ("--tls-cert-file", __file__), "--tls-cert-file was given without --tls-key-file", id="cert-without-key"
        ),
        pytest.param(("--tls-cert-file", __file__, "--tls-key-file", __file__), "cannot be loaded", id="not-pem"),
        pytest.param(("--api-key-rps", "5"), "need API keys", id="limits-without-keys"),
    ],
)
def test_bad_tls_or_key_settings_fail_at_start_with_one_line(
    flags: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynamo_cli.cli.main",
            "serve",
            *MOCKER,
            "--port",
            "0",
            "--discovery",
            f"file://{tmp_path}/discovery",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stdout + done.stderr


def test_an_encrypted_tls_key_fails_at_start_instead_of_prompting(pki, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    key = serialization.load_pem_private_key(Path(pki["server"][1]).read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynamo_cli.cli.main",
            "serve",
            *MOCKER,
            "--port",
            "0",
            "--discovery",
            f"file://{tmp_path}/discovery",
            "--tls-cert-file",
            pki["server"][0],
            "--tls-key-file",
            str(encrypted),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--tls-key-file is encrypted" in done.stderr


def test_dyn_bench_runs_against_a_keyed_frontend_with_its_key(serve) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from dynamo_cli.cli.bench import app

    d = serve("--api-key", KEYS[0])
    fast = ["--url", d.url, "-n", "3", "--isl", "8", "--osl", "4", "--no-progress", "--tokenizer", "none"]
    result = CliRunner().invoke(app, [*fast, "--api-key", KEYS[0]])
    assert result.exit_code == 0, result.output
    assert result.exception is None
    refused = CliRunner().invoke(app, [*fast, "--model", "smollm2"])
    assert refused.exit_code != 0 and "401" in str(refused.exception)
