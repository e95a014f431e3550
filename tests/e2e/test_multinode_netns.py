"""Multi-node shape: frontend and workers in two network namespaces that share only etcd and NATS addresses.

Namespace A (10.251.0.1) runs etcd, nats-server and the frontend; namespace B (10.251.0.2) runs a worker
(or, disaggregated, the prefill worker, whose KV the decode worker in A pulls across the veth pair).
They are joined by a veth pair. Skipped, with the reason, where namespaces cannot be created.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import API_KEY, DynProcess, start_dyn, wait_until
from tests.planes import find_etcd, find_nats_server

A_ADDR, B_ADDR = "10.251.0.1", "10.251.0.2"


def sh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30)


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2 (ip)")
    tag = secrets.token_hex(3)
    a, b = f"dyn-a-{tag}", f"dyn-b-{tag}"
    if sh("ip", "netns", "add", a).returncode != 0:
        pytest.skip("this machine does not permit creating network namespaces")
    try:
        steps = [
            ("ip", "netns", "add", b),
            ("ip", "link", "add", f"va{tag}", "netns", a, "type", "veth", "peer", "name", f"vb{tag}", "netns", b),
            ("ip", "-n", a, "addr", "add", f"{A_ADDR}/24", "dev", f"va{tag}"),
            ("ip", "-n", b, "addr", "add", f"{B_ADDR}/24", "dev", f"vb{tag}"),
            ("ip", "-n", a, "link", "set", f"va{tag}", "up"),
            ("ip", "-n", b, "link", "set", f"vb{tag}", "up"),
            ("ip", "-n", a, "link", "set", "lo", "up"),
            ("ip", "-n", b, "link", "set", "lo", "up"),
        ]
        for step in steps:
            result = sh(*step)
            if result.returncode != 0:
                pytest.skip(f"cannot set up namespaces ({' '.join(step)}): {result.stderr.strip()}")
        yield a, b
    finally:
        sh("ip", "netns", "del", a)
        sh("ip", "netns", "del", b)


def fetch(ns: str, url: str, body: str | None = None) -> subprocess.CompletedProcess[str]:
    """An HTTP request made from inside namespace `ns`."""
    code = (
        "import sys, urllib.request as u; d = sys.argv[3].encode() if len(sys.argv) > 3 else None; "
        "h = {'content-type': 'application/json', 'authorization': 'Bearer ' + sys.argv[2]}; "
        "print(u.urlopen(u.Request(sys.argv[1], d, h), timeout=20).read().decode())"
    )
    return sh("ip", "netns", "exec", ns, sys.executable, "-c", code, url, API_KEY, *([body] if body else []))


def in_ns(ns: str, *argv: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *argv],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )


def start_planes(ns: str, tmp_path: Path) -> list[subprocess.Popen[bytes]]:
    """etcd and nats-server listening on namespace `ns`'s address A_ADDR."""
    etcd, nats = find_etcd(), find_nats_server()
    if etcd is None or nats is None:
        pytest.skip("etcd or nats-server missing: run .ci/install-planes.sh")
    return [
        in_ns(
            ns,
            etcd,
            "--data-dir",
            str(tmp_path / "etcd"),
            "--listen-client-urls",
            f"http://{A_ADDR}:2379",
            "--advertise-client-urls",
            f"http://{A_ADDR}:2379",
            "--listen-peer-urls",
            f"http://{A_ADDR}:2380",
            "--initial-advertise-peer-urls",
            f"http://{A_ADDR}:2380",
            "--initial-cluster",
            f"default=http://{A_ADDR}:2380",
            "--heartbeat-interval",
            "10",
            "--election-timeout",
            "100",
            log=tmp_path / "etcd.log",
        ),
        in_ns(ns, nats, "-a", A_ADDR, "-p", "4222", "-js", "-sd", str(tmp_path / "nats"), log=tmp_path / "nats.log"),
    ]


PLANES = ["--discovery", f"etcd://{A_ADDR}:2379", "--events", f"nats://{A_ADDR}:4222"]
DYN = [sys.executable, "-m", "dynamo_cli.cli.main"]


def wait_ready(log: Path) -> None:
    assert wait_until(lambda: "dyn worker ready" in log.read_text(), timeout=60), log.read_text()


def ask(ns: str, url: str, content: str = "hi") -> dict:  # type: ignore[type-arg]
    assert wait_until(lambda: "smollm2" in fetch(ns, f"{url}/v1/models").stdout, timeout=15)
    body = json.dumps({"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": content}]})
    reply = fetch(ns, f"{url}/v1/chat/completions", body)
    assert reply.returncode == 0, reply.stderr
    return json.loads(reply.stdout)  # type: ignore[no-any-return]


def test_a_frontend_and_a_worker_in_separate_namespaces_find_each_other(namespaces, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a, b = namespaces
    servers = start_planes(a, tmp_path)
    cluster = {"DYN_CLUSTER_SECRET": secrets.token_hex(32)}  # one secret for the nodes of this deployment
    worker = in_ns(
        b,
        *DYN,
        "worker",
        "--engine",
        "mocker",
        "--host",
        B_ADDR,
        "--speedup-ratio",
        "50",
        *PLANES,
        log=tmp_path / "worker.log",
        env=cluster,
    )
    frontend: DynProcess | None = None
    try:
        wait_ready(tmp_path / "worker.log")
        frontend = start_dyn(
            ["serve", "--workers", "0", "--host", A_ADDR, "--port", "0", *PLANES], netns=a, env=cluster
        )
        assert ask(a, frontend.url)["usage"]["completion_tokens"] == 4
        assert B_ADDR in (tmp_path / "worker.log").read_text()
    finally:
        if frontend is not None:
            frontend.stop()
        for proc in [worker, *servers]:
            proc.terminate()
            proc.wait(15)


def test_a_prefill_worker_in_one_namespace_hands_kv_to_a_decode_worker_in_the_other(namespaces, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a, b = namespaces
    servers = start_planes(a, tmp_path)
    cluster = {"DYN_CLUSTER_SECRET": secrets.token_hex(32)}
    mocker = ["--engine", "mocker", "--speedup-ratio", "50", *PLANES]
    prefill = in_ns(
        b,
        *DYN,
        "worker",
        "--role",
        "prefill",
        "--host",
        B_ADDR,
        "--kv-transfer",
        "tcp",
        *mocker,
        log=tmp_path / "prefill.log",
        env=cluster,
    )
    decode = in_ns(
        a, *DYN, "worker", "--role", "decode", "--host", A_ADDR, *mocker, log=tmp_path / "decode.log", env=cluster
    )
    frontend: DynProcess | None = None
    try:
        wait_ready(tmp_path / "prefill.log")
        wait_ready(tmp_path / "decode.log")
        frontend = start_dyn(
            ["serve", "--workers", "0", "--host", A_ADDR, "--port", "0", "--enforce-disagg", *PLANES],
            netns=a,
            env=cluster,
        )
        assert ask(a, frontend.url, "word " * 600)["usage"]["completion_tokens"] == 4
        metrics = fetch(a, f"{frontend.url}/metrics").stdout
        count = "dynamo_frontend_kv_transfer_seconds_count"
        pulled = [line for line in metrics.splitlines() if line.startswith(count) and 'backend="tcp"' in line]
        assert pulled and float(pulled[0].rsplit(" ", 1)[1]) >= 1, metrics
    finally:
        if frontend is not None:
            frontend.stop()
        for proc in [prefill, decode, *servers]:
            proc.terminate()
            proc.wait(15)
