"""Every worker and `dyn router` answers probes and scrapes on its own port (`--system-port`): `/health` follows
the process from loading to ready to draining, and `/metrics` counts what it served under Dynamo's names."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from tests.conftest import DynProcess, wait_until
from tests.planes import free_port, free_ports


def _get(port: int, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)


def _series(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_workers_health_goes_from_starting_to_ready_and_its_process_answers_live(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "dynamo_cli.cli.main", "worker", "--engine", "mocker", "--system-port", str(port)]
    argv += ["--engine-arg", "startup_time=3", "--discovery", f"file://{tmp_path}/d"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen: list[tuple[int, str]] = []

        def answers() -> bool:
            try:
                reply = _get(port, "/health")
            except httpx.HTTPError:
                return False
            seen.append((reply.status_code, reply.json()["status"]))
            return reply.status_code == 200

        assert wait_until(answers, timeout=30, interval=0.2), seen
        assert (503, "starting") in seen, seen  # the engine loaded for 3 s: probes saw it not ready
        assert seen[-1] == (200, "ready")
        assert _get(port, "/live").json() == {"status": "live"}
        assert _get(port, "/nope").status_code == 404
        assert httpx.post(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 405
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)


def test_serve_children_count_requests_and_a_draining_worker_answers_503(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    base = free_ports(2)
    d: DynProcess = dyn_serve(
        "--engine", "mocker", "--workers", "1", "--router", "remote", "--routers", "1",
        "--system-port", str(base), "--graceful-shutdown", "20",
    )  # fmt: skip
    worker, router = base, base + 1  # decode workers first, then the routers
    assert _get(worker, "/health").json()["status"] == "ready"
    assert {k: v for k, v in _get(router, "/health").json().items() if k != "instance_id"} == {
        "status": "ready",
        "backends": 1,
    }
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key)
    for _ in range(5):
        client.completions.create(model="smollm2", prompt="hello there", max_tokens=4)
    text = _get(worker, "/metrics").text
    assert _series(text, "dynamo_component_requests_total", dynamo_endpoint="generate") == 5
    assert _series(text, "dynamo_component_request_duration_seconds_count", dynamo_endpoint="generate") == 5
    assert _series(text, "dynamo_component_kvstats_total_blocks", model="smollm2") > 0
    assert _series(text, "dynamo_component_inflight_requests", dynamo_endpoint="generate") == 0
    assert _series(text, "dynamo_component_engine_forward_passes_total") >= 5  # the mocker's own counters
    routed = _get(router, "/metrics").text
    assert _series(routed, "dynamo_component_router_requests_total", status="success") == 5
    assert _series(routed, "dynamo_component_requests_total", dynamo_endpoint="generate") == 5

    # A long stream holds the worker while it drains: SIGTERM deregisters it, and /health says so.
    # 600 tokens: about 3.5 s at the mocker's speed, far longer than the probe needs to see it draining.
    stream = client.completions.create(
        model="smollm2", prompt="go on", max_tokens=600, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    (pid,) = d.serving_pids()
    os.kill(pid, signal.SIGTERM)
    assert wait_until(lambda: _health_status(worker) == (503, "draining"), timeout=10, interval=0.1)
    tokens = sum(1 for _ in stream)
    assert tokens > 100  # the stream went on (drained or migrated) while the worker left


def _health_status(port: int) -> tuple[int, str] | None:
    try:
        reply = _get(port, "/health")
    except httpx.HTTPError:
        return None
    return reply.status_code, reply.json()["status"]
