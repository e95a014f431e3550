"""Every worker and `dyn router` answers probes and scrapes on its own port (`--system-port`): `/health` follows
the process from loading to ready to draining, and `/metrics` counts what it served under Dynamo's names."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import DynProcess, wait_until
from tests.planes import EtcdProcess, find_etcd, free_port, free_ports


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
    client.completions.create(model="smollm2", prompt="hello there " * 100, max_tokens=1)  # full blocks: KV events
    kv_events = "dynamo_component_router_worker_kv_events"
    assert wait_until(lambda: _series(_get(router, "/metrics").text, kv_events, model="smollm2") == 1, timeout=10)

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


def _start_phases(
    argv: list[str], port: int, timeout: float, until: str | None = None
) -> tuple[subprocess.Popen[str], list[object]]:
    """A worker started with `argv` and the `/health` phases its system port said, until it exits (or says
    `until`)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    phases: list[object] = []

    def said_phase() -> bool:
        try:
            reply, live = _get(port, "/health"), _get(port, "/live")
        except httpx.HTTPError:
            return proc.poll() is not None
        assert live.status_code == 200
        phases.append((reply.status_code, reply.json().get("phase")))
        return until is not None and phases[-1] == (503, until)

    wait_until(said_phase, timeout=timeout, interval=0.1)
    return proc, phases


def test_a_worker_answers_live_while_it_joins_the_planes_and_fails_in_one_line_when_it_cannot() -> None:
    """The system port is bound before the planes: a worker whose etcd is not up yet is live and says it is
    starting while it tries again (`--planes-wait`), then exits non-zero with one line naming etcd."""
    port, closed = free_port(), free_port()
    argv = [sys.executable, "-m", "dynamo_cli.cli.main", "worker", "--engine", "mocker", "--system-port", str(port)]
    argv += ["--discovery", f"etcd://127.0.0.1:{closed}", "--events", "nats://127.0.0.1:1", "--planes-wait", "3"]
    started = time.monotonic()
    proc, phases = _start_phases(argv, port, timeout=30)
    out = proc.communicate(timeout=15)[0]
    assert (503, "joining the planes") in phases, (phases, out)
    assert proc.returncode != 0 and "etcd" in out and "Traceback" not in out, out
    assert out.count("etcd unreachable") == 2 and "trying again for up to" in out, out  # one warning, one error
    assert time.monotonic() - started >= 3


def test_a_worker_started_before_its_etcd_waits_for_it_and_serves(tmp_path: Path) -> None:
    """A first apply on Kubernetes: the worker starts before etcd, tries again within `--planes-wait`, and is
    ready once etcd comes up, with no restart."""
    binary = find_etcd()
    if binary is None:
        pytest.skip("no etcd binary")
    etcd = EtcdProcess(binary, tmp_path / "etcd", tmp_path / "etcd.log", client_port=free_port(), peer_port=free_port())
    port = free_port()
    argv = [sys.executable, "-m", "dynamo_cli.cli.main", "worker", "--engine", "mocker", "--system-port", str(port)]
    argv += ["--discovery", etcd.url, "--planes-wait", "60"]
    proc, phases = _start_phases(argv, port, timeout=30, until="joining the planes")
    try:
        assert proc.poll() is None, phases
        etcd.start()
        assert wait_until(lambda: _health_status(port) == (200, "ready"), timeout=30, interval=0.2)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=15)[0]
        etcd.stop()
    assert "trying again for up to" in out and "Traceback" not in out, out


def test_a_vllm_worker_answers_live_while_it_imports_vllm(tmp_path: Path) -> None:
    """The engine is built in a thread after the system port is bound: `/live` answers during vLLM's import."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    port = free_port()
    argv = [sys.executable, "-m", "dynamo_cli.cli.main", "worker", "--engine", "vllm", "--system-port", str(port)]
    argv += ["--model", str(tmp_path / "absent"), "--discovery", f"file://{tmp_path}/d"]
    proc, phases = _start_phases(argv, port, timeout=60, until="loading the engine")
    proc.kill()
    out = proc.communicate(timeout=15)[0]
    assert (503, "loading the engine") in phases, (phases, out)


def _health_status(port: int) -> tuple[int, str] | None:
    try:
        reply = _get(port, "/health")
    except httpx.HTTPError:
        return None
    return reply.status_code, reply.json()["status"]
