"""Multi-node shape: frontend and a worker in two network namespaces that share only etcd and NATS addresses.

Namespace A (10.251.0.1) runs etcd, nats-server and the frontend; namespace B (10.251.0.2) runs a worker.
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

from tests.conftest import DynProcess, start_dyn, wait_until
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
        steps = [("ip", "netns", "add", b),
                 ("ip", "link", "add", f"va{tag}", "netns", a, "type", "veth", "peer", "name", f"vb{tag}", "netns", b),
                 ("ip", "-n", a, "addr", "add", f"{A_ADDR}/24", "dev", f"va{tag}"),
                 ("ip", "-n", b, "addr", "add", f"{B_ADDR}/24", "dev", f"vb{tag}"),
                 ("ip", "-n", a, "link", "set", f"va{tag}", "up"), ("ip", "-n", b, "link", "set", f"vb{tag}", "up"),
                 ("ip", "-n", a, "link", "set", "lo", "up"), ("ip", "-n", b, "link", "set", "lo", "up")]  # fmt: skip
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
        "import sys, urllib.request as u; d = sys.argv[2].encode() if len(sys.argv) > 2 else None; "
        "print(u.urlopen(u.Request(sys.argv[1], d, {'content-type': 'application/json'}), timeout=20).read().decode())"
    )
    return sh("ip", "netns", "exec", ns, sys.executable, "-c", code, url, *([body] if body else []))


def in_ns(ns: str, *argv: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})  # fmt: skip


def test_a_frontend_and_a_worker_in_separate_namespaces_find_each_other(namespaces, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a, b = namespaces
    etcd, nats = find_etcd(), find_nats_server()
    if etcd is None or nats is None:
        pytest.skip("etcd or nats-server missing: run .ci/install-planes.sh")
    servers = [
        in_ns(a, etcd, "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", f"http://{A_ADDR}:2379",
              "--advertise-client-urls", f"http://{A_ADDR}:2379", "--listen-peer-urls", f"http://{A_ADDR}:2380",
              "--initial-advertise-peer-urls", f"http://{A_ADDR}:2380",
              "--initial-cluster", f"default=http://{A_ADDR}:2380",
              "--heartbeat-interval", "10", "--election-timeout", "100", log=tmp_path / "etcd.log"),
        in_ns(a, nats, "-a", A_ADDR, "-p", "4222", "-js", "-sd", str(tmp_path / "nats"), log=tmp_path / "nats.log"),
    ]  # fmt: skip
    planes = ["--discovery", f"etcd://{A_ADDR}:2379", "--events", f"nats://{A_ADDR}:4222"]
    dyn = [sys.executable, "-m", "dynamo_cli.cli.main"]
    cluster = {"DYN_CLUSTER_SECRET": secrets.token_hex(32)}  # one secret for the nodes of this deployment
    worker = in_ns(b, *dyn, "worker", "--engine", "mocker", "--host", B_ADDR, "--speedup-ratio", "50", *planes,
                   log=tmp_path / "worker.log", env=cluster)  # fmt: skip
    frontend: DynProcess | None = None
    try:
        assert wait_until(lambda: "dyn worker ready" in (tmp_path / "worker.log").read_text(), timeout=60), \
            (tmp_path / "worker.log").read_text()  # fmt: skip
        frontend = start_dyn(["serve", "--workers", "0", "--host", A_ADDR, "--port", "0", *planes],
                             netns=a, env=cluster)  # fmt: skip
        url = frontend.url
        assert wait_until(lambda: "smollm2" in fetch(a, f"{url}/v1/models").stdout, timeout=15)
        body = json.dumps({"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        reply = fetch(a, f"{url}/v1/chat/completions", body)
        assert reply.returncode == 0, reply.stderr
        answer = json.loads(reply.stdout)
        assert answer["usage"]["completion_tokens"] == 4
        assert B_ADDR in (tmp_path / "worker.log").read_text()
    finally:
        if frontend is not None:
            frontend.stop()
        for proc in [worker, *servers]:
            proc.terminate()
            proc.wait(15)
