"""`dyn plan run --system-port`: the planner's `/health` follows it from waiting for a frontend (503 starting, and
why) to planning (200 ready) to losing every frontend (503 unhealthy, and why), while `/live` answers throughout
and `/metrics` counts its decisions."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from tests.conftest import DynProcess, wait_until
from tests.planes import free_port
from tests.planner.test_plan_cli import profile_file  # noqa: F401 (a fixture)


def _get(port: int, path: str) -> httpx.Response | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2)
    except httpx.HTTPError:
        return None


def _health(port: int) -> tuple[int, dict[str, str]]:
    reply = _get(port, "/health")
    return (0, {}) if reply is None else (reply.status_code, reply.json())


def _decisions(port: int) -> float:
    reply = _get(port, "/metrics")
    lines = [] if reply is None else reply.text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("dynamo_planner_decisions_total "))


def test_a_planners_health_follows_its_frontends(
    dyn_serve,  # type: ignore[no-untyped-def]
    profile_file: Path,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    port, discovery = free_port(), f"file://{tmp_path}/discovery"
    argv = [sys.executable, "-m", "dynamo_cli.cli.main", "plan", "run", "--profile", str(profile_file)]
    argv += ["--ttft", "1000", "--itl", "50", "--mode", "agg", "--interval", "1", "--load-interval", "0.3"]
    argv += ["--discovery", discovery, "--connector", "virtual", "--dry-run", "--system-port", str(port)]
    planner = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert planner.stdout is not None
    threading.Thread(target=lambda: lines.extend(planner.stdout), daemon=True).start()  # type: ignore[arg-type]
    try:
        assert wait_until(lambda: _health(port)[0] == 503, 15, 0.1), lines  # up, and no frontend yet
        status, body = _health(port)
        assert body["status"] == "starting" and "waiting for a frontend" in body["reason"], body
        assert "no frontend answered" in body["reason"], body
        live = _get(port, "/live")
        assert live is not None and live.status_code == 200 and live.json() == {"status": "live"}

        frontend: DynProcess = dyn_serve("--engine", "mocker", "--workers", "0", discovery=discovery)
        assert wait_until(lambda: _health(port) == (200, {"status": "ready"}), 15, 0.1), _health(port)
        assert wait_until(lambda: any("dyn planner ready:" in line for line in lines), 5), lines
        ready = next(line for line in lines if "dyn planner ready:" in line)
        assert f"system=127.0.0.1:{port}" in ready and "connector=none (dry run)" in ready, ready
        assert wait_until(lambda: _decisions(port) >= 1, 10, 0.1), lines  # one throughput step taken

        frontend.stop()
        assert wait_until(lambda: _health(port)[1].get("status") == "unhealthy", 10, 0.1), _health(port)
        status, body = _health(port)
        assert status == 503 and "reads of the frontends' metrics failed" in body["reason"], body
        assert "no frontend answered" in body["reason"], body
        live = _get(port, "/live")
        assert live is not None and live.status_code == 200
    finally:
        planner.send_signal(signal.SIGTERM)
        planner.wait(15)
    assert planner.returncode == 0, lines
