"""Multi-node planes misbehaving: etcd or NATS restarted under load, or unreachable at start."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import DynProcess, wait_until
from tests.planes import EtcdProcess, NatsProcess

FLAGS = ("--engine", "mocker", "--workers", "2", "--speedup-ratio", "50", "--lease-ttl", "2")
BODY = {"model": "smollm2", "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]}


def ok(http: httpx.Client) -> bool:
    return http.post("/v1/chat/completions", json=BODY).status_code == 200


def metric(http: httpx.Client, name: str) -> float:
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_serving_continues_while_etcd_restarts_and_workers_re_register(
    dyn_serve,
    etcd_process: EtcdProcess,
    nats_server: str,  # type: ignore[no-untyped-def]
) -> None:
    d: DynProcess = dyn_serve(*FLAGS, discovery=etcd_process.url, events=nats_server)
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=30) as http:
        assert ok(http)
        etcd_process.stop()
        assert all(ok(http) for _ in range(5))  # known instances keep serving without etcd
        etcd_process.restart(wipe=True)  # a new, empty etcd: everyone must register again
        assert wait_until(lambda: len(d.worker_pids()) == 2, timeout=20)
        assert all(ok(http) for _ in range(5))


def holder_overlap(http: httpx.Client, prefix: str) -> int:
    """Send `prefix` + a question twice; the overlap the router saw for the second on the first's worker."""
    body = {
        "model": "smollm2",
        "max_tokens": 2,
        "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": "q"}],
    }
    first = http.post("/v1/chat/completions", json=body).headers["x-worker-instance-id"]
    time.sleep(0.5)
    route = http.post("/v1/chat/completions", json=body, headers={"x-dyn-explain-route": "1"}).headers["x-dyn-route"]
    import json

    return int(next(c["overlap_blocks"] for c in json.loads(route)["candidates"] if c["worker_id"] == first))


def test_serving_continues_while_nats_restarts_and_kv_events_resume(
    dyn_serve,
    etcd_server: str,
    nats_process: NatsProcess,  # type: ignore[no-untyped-def]
) -> None:
    d: DynProcess = dyn_serve(*FLAGS, "--router", "kv", discovery=etcd_server, events=nats_process.url)
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=30) as http:
        assert holder_overlap(http, "Before the outage. " * 80) >= 5
        nats_process.stop()
        assert all(ok(http) for _ in range(5))  # requests flow on the request plane, not NATS
        nats_process.restart()
        # events published during the outage are either buffered by the client and delivered, or
        # missing: then the router sees an event-id gap and repairs it from the worker
        assert wait_until(lambda: holder_overlap(http, "After the outage. " * 80) >= 5, timeout=20, interval=0.5)
        gaps = metric(http, 'dynamo_router_counter{model="smollm2",name="num_kv_gaps"}')
        repairs = metric(http, "dynamo_router_kv_gap_repairs_total")
        assert repairs >= min(gaps, 1)


@pytest.mark.parametrize(
    ("flag", "url", "plane"),
    [
        pytest.param("--discovery", "etcd://127.0.0.1:1", "etcd", id="etcd"),
        pytest.param("--events", "nats://127.0.0.1:1", "nats", id="nats"),
    ],
)
def test_an_unreachable_plane_at_start_is_one_line_naming_the_address(
    flag: str, url: str, plane: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    args = ["worker", "--engine", "mocker", "--discovery", f"file://{tmp_path}", flag, url]
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_cli.cli.main", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "127.0.0.1:1" in lines[0] and "unreachable" in lines[0]
    assert time.monotonic() - start < 15
