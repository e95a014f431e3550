"""A real Prometheus (Debian's `prometheus`) scrapes a mocker deployment through the generated scrape config:
the frontend's `/metrics` and each worker's system port; the series come back through its HTTP API.

Bounded: scrapes every second, a few dozen short streams, each wait under a timeout.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from dynamo_cli.monitoring.alerts import alert_rules, render_rules
from dynamo_cli.monitoring.dashboard import ROWS
from dynamo_cli.monitoring.scrape import ScrapeTarget, scrape_config
from tests.conftest import DynProcess, wait_until
from tests.planes import free_port

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus missing: Debian's prometheus package (bash .ci/install-planes.sh as root)"
)
MOCKER = ("--engine", "mocker", "--speedup-ratio", "10", "--max-restarts", "0")
LONG = " ".join(["word"] * 1500)  # over --max-local-prefill-length (512): prefilled remotely


@dataclass
class Prometheus:
    """A running Prometheus server; `query` reads its HTTP API."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def api(self, path: str, **params: str) -> list[dict[str, object]]:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=5)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (params, r.text)
        data = body["data"]
        return data["result"] if path == "query" else data  # type: ignore[no-any-return]

    def query(self, promql: str) -> list[dict[str, object]]:
        return self.api("query", query=promql)

    def value(self, promql: str) -> float:
        """The one sample of a scalar-like query (nan while there is none)."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if len(result) == 1 else float("nan")  # type: ignore[index]


def consecutive_free_ports(n: int) -> int:
    """A base port whose `n` ports from it are free now (dyn serve's children bind base, base+1, ...)."""
    for _ in range(50):
        base = free_port()
        try:
            for port in range(base, base + n):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise AssertionError(f"no {n} consecutive free ports")


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[object]:
    """Factory: `prometheus(targets)` starts one on the generated config and rules; stopped by its PID after."""
    started: list[Prometheus] = []

    def start(targets: list[ScrapeTarget]) -> Prometheus:
        assert PROMETHEUS is not None
        (tmp_path / "rules.yml").write_text(render_rules(alert_rules()))
        config = tmp_path / "prometheus.yml"
        config.write_text(scrape_config(targets, interval_s=1, rule_files=[str(tmp_path / "rules.yml")]))
        port, log = free_port(), tmp_path / "prometheus.log"
        args = [f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}"]
        args += [f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
        with log.open("wb") as out:
            proc = subprocess.Popen([PROMETHEUS, *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        server = Prometheus(proc, f"http://127.0.0.1:{port}", log)
        started.append(server)
        ready = wait_until(lambda: proc.poll() is None and _is_ready(server.url), 20, interval=0.2)
        assert ready, log.read_text()[-3000:]
        return server

    yield start
    for server in started:
        server.proc.terminate()
        try:
            server.proc.wait(10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def _is_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _targets(d: DynProcess, base: int, n: int) -> list[ScrapeTarget]:
    frontend = urlsplit(d.url)
    assert frontend.hostname is not None and frontend.port is not None
    return [ScrapeTarget(frontend.hostname, frontend.port), *(ScrapeTarget("127.0.0.1", base + i) for i in range(n))]


def _stream(d: DynProcess, prompts: list[str]) -> None:
    """Each prompt as one streamed chat completion of 4 tokens, 8 at a time."""
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=30)

    def one(prompt: str) -> None:
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert len(usage) == 1 and usage[0].completion_tokens == 4

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, prompts))


def _every_target_up(server: Prometheus, n: int) -> bool:
    up = server.query('up{job="dynamo"}')
    return len(up) == n and all(sample["value"][1] == "1" for sample in up)  # type: ignore[index]


def _dashboard_queries() -> list[str]:
    """The dashboard's queries as Grafana sends them: every model, a 1 m rate window."""
    exprs = [query.expr for _, panels in ROWS for panel in panels for query in panel.queries]
    return [expr.replace("$model", ".*").replace("$__rate_interval", "1m") for expr in exprs]


def test_prometheus_scrapes_the_frontend_and_both_workers_system_ports(dyn_serve, prometheus) -> None:  # type: ignore[no-untyped-def]
    base = consecutive_free_ports(2)
    d = dyn_serve(*MOCKER, "--workers", "2", "--system-port", str(base))
    server = prometheus(_targets(d, base, 2))
    num_requests = 32
    _stream(d, [f"question {i}: " + "word " * (i % 7) for i in range(num_requests)])

    ttft_count = "sum(dynamo_frontend_time_to_first_token_seconds_count)"
    assert wait_until(lambda: server.value(ttft_count) == num_requests, 15, interval=0.5), server.query(ttft_count)
    assert wait_until(lambda: _every_target_up(server, 3), 10, interval=0.5), server.query("up")
    usage = server.query('dynamo_component_kvstats_gpu_cache_usage_percent{model="smollm2"}')
    assert sorted(s["metric"]["instance"] for s in usage) == [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]  # type: ignore[index]
    served = server.value('sum(dynamo_component_requests_total{dynamo_endpoint="generate"})')
    assert served == num_requests
    for expr in _dashboard_queries():  # each query runs (a syntax error would be a 400)
        server.query(expr)
    groups = server.api("rules")["groups"]  # type: ignore[call-overload]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == len(alert_rules()) and {r["health"] for r in rules} <= {"ok", "unknown"}


def test_prometheus_reads_the_disaggregation_outcomes(dyn_serve, prometheus) -> None:  # type: ignore[no-untyped-def]
    base = consecutive_free_ports(2)
    d = dyn_serve(*MOCKER, "--disagg", "--prefill-workers", "1", "--decode-workers", "1", "--system-port", str(base))
    server = prometheus(_targets(d, base, 2))
    _stream(d, [f"{i} {LONG}" for i in range(6)] + [f"short {i}" for i in range(4)])

    def outcome(name: str) -> float:
        return server.value(f'sum(dynamo_frontend_disagg_decisions_total{{outcome="{name}"}})')

    assert wait_until(lambda: (outcome("remote"), outcome("local_short")) == (6, 4), 15, interval=0.5), server.query(
        "dynamo_frontend_disagg_decisions_total"
    )
    assert wait_until(lambda: _every_target_up(server, 3), 10, interval=0.5), server.query("up")
    components = {s["metric"]["dynamo_component"] for s in server.query("dynamo_component_kvstats_total_blocks")}  # type: ignore[index]
    assert len(components) == 2, components  # the prefill worker's and the decode worker's
    pulled = server.value('sum(dynamo_frontend_kv_transfer_seconds_count{backend!="local"})')
    assert pulled == 6
