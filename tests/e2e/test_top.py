"""`dyn top` on a real mocker deployment (2 workers, /metrics behind the API key): after 20 requests from
the official openai client, `dyn top URL --once` lists both workers with their role and the requests each
served, and the model's TTFT; without the key, or with no frontend there, it says so in one line.
Last, a worker killed disappears from /metrics and from the view."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from tests.conftest import DynProcess, wait_until

NUM_REQUESTS = 20
RUN_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def deployment(dyn_serve_module) -> DynProcess:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve_module(
        "--engine", "mocker", "--workers", "2", "--speedup-ratio", "5", "--lease-ttl", "2", "--metrics-require-key"
    )
    assert wait_until(lambda: len(workers(d)) == 2, timeout=30, interval=0.2)
    return d


def workers(d: DynProcess) -> dict[str, int]:
    """Hex id → pid of the deployment's workers."""
    return {f"{r.instance_id:x}": r.pid for r in d.instance_records() if r.component != "router"}


def top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynamo_cli.cli.main", "top", *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env={**os.environ, "COLUMNS": "120"},
    )


def test_top_lists_both_workers_with_the_requests_they_served_and_the_ttft(deployment: DynProcess) -> None:
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key=deployment.api_key, timeout=RUN_TIMEOUT_S)
    for i in range(NUM_REQUESTS):
        stream = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=8, stream=True
        )
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    result = top(deployment.url, "--once", "--interval", "0.5", "--api-key", deployment.api_key)
    assert result.returncode == 0, result.stderr
    served = {}
    for worker_id in workers(deployment):
        line = rf"^{worker_id}\s+both\s+\d+\s+\d+\s+\d+%\s+\d+\s+(\d+)\s+[\d.]+\s+(events|approximate|-)$"
        row = re.search(line, result.stdout, re.M)  # the last column: how the KV router sees its cache
        assert row, f"worker {worker_id} not listed:\n{result.stdout}"
        served[worker_id] = int(row.group(1))
    assert all(n > 0 for n in served.values()) and sum(served.values()) == NUM_REQUESTS, served
    assert re.search(r"TTFT p50 [\d.]+ ms  p99 [\d.]+ ms", result.stdout), result.stdout


def test_without_the_key_top_says_so_in_one_line(deployment: DynProcess) -> None:
    result = top(deployment.url, "--once", "--interval", "0.1")
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1 and "HTTP 401" in result.stderr and "--api-key" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_no_frontend_there_is_one_line_and_a_non_zero_exit() -> None:
    result = top("http://127.0.0.1:1", "--once")
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.startswith("error: cannot read http://127.0.0.1:1/metrics") and result.stderr.count("\n") == 1


def test_a_worker_that_died_leaves_the_metrics_and_the_view(deployment: DynProcess) -> None:
    # Last in this module: it changes the deployment (dyn serve restarts the worker under a new id).
    gone, pid = next(iter(workers(deployment).items()))
    os.kill(pid, signal.SIGKILL)

    def listed() -> bool:
        text = httpx.get(f"{deployment.url}/metrics", headers=deployment.auth, timeout=5).text
        return f'worker_id="{gone}"' in text

    assert wait_until(lambda: not listed(), timeout=20, interval=0.2)
    result = top(deployment.url, "--once", "--interval", "0.1", "--api-key", deployment.api_key)
    assert result.returncode == 0 and gone not in result.stdout, result.stdout
