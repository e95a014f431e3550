"""What each rendered pod runs: its `dyn` command line parses back (through the real commands) into exactly the
config `dyn serve` builds from the same flags; and the rendered command lines, run here on real etcd and NATS
as the pods would run them, serve a chat completion."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import typer

from dynamo_cli.cli import options as o
from dynamo_cli.cli import router as router_cmd
from dynamo_cli.cli import serve
from dynamo_cli.cli import worker as worker_cmd
from dynamo_cli.cli.k8s_batches import BATCH_DB
from dynamo_cli.config import AuthConfig, PlanesConfig, ServeConfig, TenantConfig, read_api_keys
from dynamo_cli.engine import Role
from tests.k8s.render_cases import CLUSTER_SECRET, Files, deployment, make_files, render
from tests.planes import free_port

POD_IP = "10.1.2.3"
KNOBS_GALORE = [
    "--router",
    "kv",
    "--router-temperature",
    "0.5",
    "--no-kv-events",
    "--router-queue-policy",
    "sjf",
    "--body-limit-mb",
    "10",
    "--router-tier-weights",
    "host=0.5,disk=0.25",
    "--log-format",
    "json",
    "--otlp-endpoint",
    "http://otel.monitoring:4318",
    "--trace-sample-ratio",
    "0.1",
    "--health-check",
    "--stall-timeout",
    "5",
    "--migration-limit",
    "1",
    "--max-inflight-per-worker",
    "8",
    "--context-length",
    "4096",
    "--served-model-name",
    "chat",
    "--engine",
    "mocker",
    "--speedup-ratio",
    "20",
    "--engine-arg",
    "num_gpu_blocks=512",
    "--kv-host-cache-gb",
    "2",
    "--graceful-shutdown",
    "12",
    "--lease-ttl",
    "7",
]
SHAPES = {
    "agg": ["--workers", "2", "--engine", "mocker"],
    "knobs": KNOBS_GALORE,
    "disagg": [
        "--disagg",
        "--prefill-workers",
        "2",
        "--router",
        "kv",
        "--disagg-policy",
        "isl",
        "--kv-transfer",
        "tcp",
    ],
    "remote": ["--router", "remote", "--routers", "2", "--router-queue-size", "64", "--decode-busy-threshold", "0.8"],
    "disk-tier": ["--kv-disk-cache-gb", "5", "--kv-host-cache-gb", "1"],
    "batch-path": ["--batch-db", "/srv/dyn/batches.db", "--batch-max-inflight", "8"],
    "batch-postgres": ["--batch-db", "postgresql://dyn@pg.infra:5432/batches?sslmode=require"],
    "batch-off": ["--batch-db", "off"],
}


def _parse(command: Callable[..., None], args: list[str]) -> dict[str, Any]:
    """The values the real command's options parse from `args` (flags, then DYN_* variables, then defaults)."""
    app = typer.Typer()
    app.command()(command)
    click_command = typer.main.get_command(app)
    return dict(click_command.make_context("dyn", list(args)).params)


def _pods(objects: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Component -> its container's args, for the Deployments that run dyn."""
    return {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["spec"]["containers"][0]["args"]
        for o in objects
        if o["kind"] == "Deployment"
    }


def _mounted(args: list[str], files: Files) -> list[str]:
    """The pod's args with mounted Secret paths mapped to the local files the Secret was made from."""
    mounts = {
        "/etc/dyn/api-keys/keys": str(files.api_keys),
        "/etc/dyn/tls/tls.crt": str(files.cert),
        "/etc/dyn/tls/tls.key": str(files.key),
        "/etc/dyn/tls/ca.crt": str(files.ca),
    }
    return [mounts.get(a, a) for a in args]


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Files:
    for variable in ("DYN_WORKER_HOST", "DYN_ROUTER_HOST", "DYN_API_KEYS", "DYN_CLUSTER_SECRET"):
        monkeypatch.delenv(variable, raising=False)
    return make_files(tmp_path / "files")


def _serve_config(args: list[str], files: Files) -> ServeConfig:
    """What `dyn serve ARGS` builds (the secret from DYN_CLUSTER_SECRET, as in a pod)."""
    values = _parse(serve.command, args)
    secret = o.cluster_secret(values.pop("cluster_secret_file"), make=True)
    keys = read_api_keys(values.pop("api_key") or [], values.pop("api_key_file"), {})
    given = {
        (PlanesConfig, "cluster_secret"): secret,
        (AuthConfig, "api_keys"): keys.keys,
        (TenantConfig, "key_tenants"): keys.tenants,
    }
    return serve.deployment(values, given)[0]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_pods_command_line_builds_the_config_dyn_serve_builds_from_the_same_flags(
    shape: str, files: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = SHAPES[shape]
    pods = _pods(render(flags)[0])
    monkeypatch.setenv("DYN_CLUSTER_SECRET", CLUSTER_SECRET)
    planes = ["--namespace", "dyn", "--discovery", "etcd://dyn-etcd:2379", "--events", "nats://dyn-nats:4222"]
    drain = [] if "--graceful-shutdown" in flags else ["--graceful-shutdown", "60"]  # render's default for a pod
    drain += ["--planes-wait", "7200"]  # the start-up allowance (--startup-timeout's default)
    want = _serve_config([*flags, *planes, *drain], files)

    monkeypatch.setenv("DYN_HTTP_ADVERTISE_HOST", POD_IP)  # the downward API, as for the workers below
    frontend = _serve_config(_mounted(pods["frontend"][1:], files), files)
    monkeypatch.delenv("DYN_HTTP_ADVERTISE_HOST")
    assert pods["frontend"][0] == "serve" and frontend.num_workers == 0
    batch = want.frontend.batch
    if batch.db != "off" and not batch.db.startswith("postgresql://"):  # a SQLite file: on the pod's claim
        batch = replace(batch, db=BATCH_DB)
    assert frontend.frontend == replace(want.frontend, host="0.0.0.0", advertise_host=POD_IP, batch=batch)

    monkeypatch.setenv("DYN_WORKER_HOST", POD_IP)
    disk = want.worker.kv_tiers
    if disk.disk_bytes and disk.disk_dir is None:
        disk = replace(disk, disk_dir="/var/cache/dyn-kv")  # an emptyDir of the tier's size
    pools = {"worker": Role.BOTH} if not want.num_prefill_workers else {"decode": Role.DECODE, "prefill": Role.PREFILL}
    for part, role in pools.items():
        assert pods[part][0] == "worker"
        values = _parse(worker_cmd.command, pods[part][1:])
        got = worker_cmd._from_flags(values)
        expected = replace(
            want.worker,
            host=POD_IP,
            port=9000,
            role=role,
            component="prefill" if role is Role.PREFILL else "backend",
            kv_transfer_port=9100 if role is Role.PREFILL else 0,
            telemetry=replace(want.worker.telemetry, system_port=9090),
            kv_tiers=disk,
        )
        assert got == expected, part

    if want.frontend.router == "remote":
        monkeypatch.setenv("DYN_ROUTER_HOST", POD_IP)
        values = _parse(router_cmd.command, pods["router"][1:])
        expected_router = want.router_config()
        expected_router = replace(
            expected_router, host=POD_IP, port=9000, telemetry=replace(expected_router.telemetry, system_port=9090)
        )
        assert router_cmd._from_flags(values) == expected_router
    else:
        assert "router" not in pods


##### The rendered command lines, run here #####


def _as_here(args: list[str], etcd: str, nats: str, ports: dict[str, int], batch_db: str = "off") -> list[str]:
    """A pod's args as one machine runs them: the planes' URLs, free ports for the fixed container ports, and
    `batch_db` for the claim's batch database."""
    out = []
    for i, arg in enumerate(args):
        before = args[i - 1] if i else ""
        if before == "--discovery":
            arg = etcd
        elif before == "--events":
            arg = nats
        elif before == "--batch-db":
            arg = batch_db
        elif before == "--host":
            arg = "127.0.0.1"
        elif before in ports:
            arg = str(ports[before])
        out.append(arg)
    if "--port" in ports and "--port" not in args:  # the default port, unwritten
        out += ["--port", str(ports["--port"])]
    return out


def _start(args: list[str], env: dict[str, str], lines: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo_cli.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())

    threading.Thread(target=pump, daemon=True).start()
    return proc


def _wait_listening(port: int, proc: subprocess.Popen[str], lines: list[str], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    pytest.fail(f"the frontend did not listen on {port}: {lines[-5:]}")


def test_the_rendered_disaggregated_deployment_with_remote_routers_serves_here(
    etcd_server: str, nats_server: str, files: Files, tmp_path: Path
) -> None:
    etcd, nats = etcd_server, nats_server
    flags = [
        "--disagg",
        "--router",
        "remote",
        "--routers",
        "1",
        "--engine",
        "mocker",
        "--speedup-ratio",
        "50",
        "--disagg-policy",
        "always",
        "--kv-transfer",
        "tcp",
    ]
    pods = _pods(render(flags)[0])
    env = {
        **os.environ,
        "DYN_CLUSTER_SECRET": CLUSTER_SECRET,
        "DYN_WORKER_HOST": "127.0.0.1",
        "DYN_ROUTER_HOST": "127.0.0.1",
    }
    http_port = free_port()
    procs: list[subprocess.Popen[str]] = []
    lines: dict[str, list[str]] = {}
    parts = ("frontend", "prefill", "decode", "router")
    system = {part: free_port() for part in parts}  # all chosen before any process binds ports of its own
    url = f"http://127.0.0.1:{http_port}"
    try:
        for part in parts:
            ports = {
                "--port": http_port if part == "frontend" else 0,
                "--system-port": system[part],
                "--kv-transfer-port": 0,
            }
            lines[part] = []
            batch_db = str(tmp_path / "claim" / "batches.db")
            procs.append(_start(_as_here(pods[part], etcd, nats, ports, batch_db), env, lines[part]))
            if part == "frontend":  # it holds its port before the others bind any (port 0 could be the same one)
                _wait_listening(http_port, procs[-1], lines[part])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("the frontend never became healthy:\n" + "\n".join(f"{p}: {lines[p][-5:]}" for p in lines))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=30)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello " * 40}], max_tokens=8
        )
        assert reply.choices[0].message.content
        for part in ("prefill", "decode", "router"):  # the probes the manifests point at
            base = f"http://127.0.0.1:{system[part]}"
            assert httpx.get(f"{base}/live", timeout=5).status_code == 200
            assert httpx.get(f"{base}/health", timeout=5).status_code == 200, part
            assert "dynamo_component" in httpx.get(f"{base}/metrics", timeout=5).text
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_the_planner_pods_command_line_is_a_kubernetes_planner_of_the_rendered_pools(files: Files) -> None:
    from dynamo_cli.cli import plan

    flags = [
        "--disagg",
        "--planner",
        "--planner-ttft",
        "250",
        "--planner-itl",
        "25",
        "--planner-profile",
        str(files.profile),
        "--planner-min-workers",
        "2",
        "--planner-max-workers",
        "6",
        "--engine",
        "mocker",
    ]
    objects = render(flags)[0]
    args = _pods(objects)["planner"]
    assert args[:2] == ["plan", "run"]
    values = _parse(plan.run_command, args[2:])
    assert values["connector"] == "kubernetes" and values["k8s_namespace"] == "dyn" and values["mode"] == "disagg"
    assert (values["ttft"], values["itl"], values["min_workers"], values["max_workers"]) == (250, 25, 2, 6)
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    assert {values["k8s_decode_deployment"], values["k8s_prefill_deployment"]} == {"dyn-decode", "dyn-prefill"} <= names
    assert not values["frontend"] and values["system_port"] == 9090  # the frontends it finds in discovery
    run = plan.plan_run(values)
    assert (run.discovery, run.namespace) == ("etcd://dyn-etcd:2379", "dyn")
    mounted = deployment(objects, "dyn-planner")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "profile", "configMap": {"name": "dyn-planner-profile"}} in mounted
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert config_map["data"]["profile.json"] == files.profile.read_text()
    assert values["profile"] == Path("/etc/dyn/profile/profile.json")
