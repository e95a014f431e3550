"""The attack of issue 18 on a real `dyn serve`: a raw connection to a worker's request plane gets nothing.

Before: any process that reached a worker's port and sent an `Open` frame streamed tokens (`generate`)
or read the cache (`kv_dump`). Now `dyn serve` makes a cluster secret per deployment, passes it to its
workers in their environment, and every connection must prove the secret before any frame is served.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from dynamo_cli.config import WorkerConfig
from dynamo_cli.errors import AuthenticationFailed
from dynamo_cli.kv.events import KvDump
from dynamo_cli.runtime.framing import FrameCodec, Open
from dynamo_cli.runtime.handshake import HELLO_BYTES, MAGIC
from dynamo_cli.runtime.request_client import RequestClient
from dynamo_cli.wire import GenerateChunk, GenerateRequest, KvDumpQuery, SamplingParams
from tests.conftest import DynProcess, wait_until

FLAGS = ("--engine", "mocker", "--workers", "1", "--speedup-ratio", "100")
BODY = {
    "generate": msgspec.msgpack.encode(
        GenerateRequest(
            request_id="stranger",
            token_ids=list(range(1, 200)),
            max_tokens=20,
            sampling=SamplingParams(ignore_eos=True),
        )
    ),
    "kv_dump": msgspec.msgpack.encode(KvDumpQuery()),
}


def worker_address(d: DynProcess) -> str:
    return next(r.address for r in d.instance_records() if r.component == "backend")


async def raw_open(address: str, endpoint: str) -> bytes:
    """What a stranger's bare socket gets back for an Open frame: every byte until the worker closes."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    received = b""
    try:
        writer.write(FrameCodec().encode(Open(1, endpoint, msgspec.Raw(BODY[endpoint]))))
        async with asyncio.timeout(10):
            while chunk := await reader.read(65536):
                received += chunk
    except ConnectionResetError:
        pass
    finally:
        writer.close()
    return received


async def call(address: str, secret: bytes, endpoint: str) -> list[bytes]:
    client = RequestClient(address, secret=secret)
    try:
        async with asyncio.timeout(15):
            return [bytes(raw) async for raw in await client.open_stream(endpoint, BODY[endpoint])]
    finally:
        await client.close()


@pytest.fixture(scope="module")
def deployment(dyn_serve_module) -> DynProcess:  # type: ignore[no-untyped-def]
    return dyn_serve_module(*FLAGS)  # no secret given: dyn serve makes one for itself


@pytest.mark.parametrize("endpoint", ["generate", "kv_dump"])
def test_a_raw_open_frame_to_a_worker_is_closed_with_nothing_served(deployment: DynProcess, endpoint: str) -> None:
    received = asyncio.run(raw_open(worker_address(deployment), endpoint))
    assert len(received) == 4 + HELLO_BYTES and received[4:].startswith(MAGIC)  # the challenge, then the close


def test_a_guessed_secret_is_refused_and_the_deployment_keeps_serving(deployment: DynProcess) -> None:
    import httpx

    with pytest.raises(AuthenticationFailed):
        asyncio.run(call(worker_address(deployment), bytes(32), "generate"))
    body = {"model": "smollm2", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    reply = httpx.post(f"{deployment.url}/v1/completions", json=body, timeout=30, headers=deployment.auth)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


def test_the_secret_reaches_workers_by_environment_never_by_command_line(deployment: DynProcess) -> None:
    for pid in deployment.worker_pids():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        document = next(v.split(b"=", 1)[1] for v in environ if v.startswith(b"DYN_WORKER_CONFIG="))
        secret = msgspec.json.decode(document, type=WorkerConfig).planes.cluster_secret
        assert secret is not None and len(secret) == 32
        assert secret.hex().encode() not in cmdline and base64.b64encode(secret) not in cmdline


def test_a_client_with_the_deployments_secret_file_is_served(dyn_serve, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    secret = os.urandom(32)
    path = tmp_path / "cluster.key"
    path.write_text(secret.hex() + "\n")
    path.chmod(0o600)
    d = dyn_serve(*FLAGS, "--cluster-secret-file", str(path))
    address = worker_address(d)
    chunks = [msgspec.msgpack.decode(raw, type=GenerateChunk) for raw in asyncio.run(call(address, secret, "generate"))]
    assert sum(len(c.token_ids) for c in chunks) == 20
    assert wait_until(
        lambda: msgspec.msgpack.decode(asyncio.run(call(address, secret, "kv_dump"))[0], type=KvDump).block_hashes,
        timeout=10,
    )  # the prompt is cached
    with pytest.raises(AuthenticationFailed):
        asyncio.run(call(address, os.urandom(32), "kv_dump"))


def dyn(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DYN_CLUSTER_SECRET")}
    return subprocess.run(
        [sys.executable, "-m", "dynamo_cli.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**environ, **(env or {})},
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["worker", "router"])
def test_listening_on_the_network_without_a_secret_is_refused_in_one_line(command: str, tmp_path: Path) -> None:
    line = one_error_line(dyn(command, "--host", "0.0.0.0", "--discovery", f"file://{tmp_path}"))
    assert "0.0.0.0" in line and "--cluster-secret-file" in line and "DYN_CLUSTER_SECRET" in line


def test_a_secret_file_other_users_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o644)
    line = one_error_line(dyn("worker", "--host", "0.0.0.0", "--cluster-secret-file", str(path)))
    assert f"chmod 600 {path}" in line


@pytest.mark.parametrize(
    ("value", "expected"), [("not-hex", "not hex"), ("ab" * 8 + "c", "not hex"), ("ab" * 8, "fewer than 16")]
)
def test_a_malformed_secret_is_refused_saying_how_to_make_one(value: str, expected: str) -> None:
    line = one_error_line(dyn("worker", "--host", "0.0.0.0", env={"DYN_CLUSTER_SECRET": value}))
    assert expected in line and "openssl rand -hex 32" in line
