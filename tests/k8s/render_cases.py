"""`dyn k8s render` run in-process on the deployment shapes the tests check, with the local files they name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from typer.testing import CliRunner

from dynamo_cli.cli import k8s
from tests.planes import make_tls_files

API_KEY = "sk-render-test-5ecret-key"
CLUSTER_SECRET = "ab" * 32
PLANES_PASSWORD = "planes-pa55word"
BATCH_DB_PASSWORD = "batch-db-pa55word"
BATCH_DB_URL = "postgresql://dyn@pg.infra:5432/batches?sslmode=require"

KUBE_VERSIONS = ("1.34.0", "1.35.0", "1.36.0", "1.37.0")
"""The last four Kubernetes minors: every rendered object must be valid (strict) for each."""
CRD_KINDS = ("PodMonitor", "HTTPRoute", "ScaledObject")
"""The kinds render writes whose schemas are CRDs': kubernetes-validate has none of them, test_render_crds.py
validates them with the CRDs' own (npm's @kubernetes-models, `make setup-crd-schemas`)."""


@dataclass(frozen=True)
class Files:
    """Local files a render reads: API keys, cluster secret, TLS, a profile, a planes and a batch database
    password file."""

    root: Path
    api_keys: Path
    cluster_secret: Path
    cert: Path
    key: Path
    ca: Path
    profile: Path
    password: Path
    batch_db_password: Path

    def secret_texts(self) -> list[str]:
        """Every secret value these files hold: none may appear in a manifest."""
        pem_key = self.key.read_text().strip().splitlines()[1]  # a line of the private key's base64
        return [API_KEY, CLUSTER_SECRET, PLANES_PASSWORD, BATCH_DB_PASSWORD, pem_key]


def make_files(root: Path) -> Files:
    root.mkdir(parents=True, exist_ok=True)
    api_keys = root / "api-keys.txt"
    api_keys.write_text(f"# keys\n{API_KEY}\n")
    secret = root / "cluster.key"
    secret.write_text(CLUSTER_SECRET + "\n")
    secret.chmod(0o600)
    ca, cert, key = make_tls_files(root / "tls")
    profile = root / "profile.json"
    profile.write_text(json.dumps(_profile()))
    password = root / "etcd-password"
    password.write_text(PLANES_PASSWORD)
    batch_db_password = root / "pg-password"
    batch_db_password.write_text(BATCH_DB_PASSWORD)  # no newline: it is PGPASSWORD byte for byte
    return Files(root, api_keys, secret, cert, key, ca, profile, password, batch_db_password)


def _profile() -> dict[str, Any]:
    """A small valid profile (the schema `dyn plan profile` writes)."""
    prefill = [{"isl": isl, "ttft_ms": 10 + isl / 100} for isl in (128, 1024, 4096)]
    decode = [
        {"kv_usage": u, "context_length": c, "itl_ms": 5 + 10 * u, "concurrency": int(64 * u) + 1}
        for c in (512, 4096)
        for u in (0.1, 0.5, 0.9)
    ]
    return {"engine": "mocker", "model": "smollm2", "max_kv_tokens": 65536, "prefill": prefill, "decode": decode}


def cases(files: Files) -> dict[str, list[str]]:
    """Deployment shapes: at least twelve, covering every kind of object render writes."""
    tls = ["--tls-cert-file", str(files.cert), "--tls-key-file", str(files.key)]
    return {
        "agg": [],
        "agg-kv-3": [
            "--router",
            "kv",
            "--workers",
            "3",
            "--engine",
            "mocker",
            "--speedup-ratio",
            "10",
            "--frontends",
            "2",
        ],
        "disagg": ["--disagg", "--prefill-workers", "2", "--decode-workers", "3", "--router", "kv"],
        "remote-2": ["--router", "remote", "--routers", "2", "--workers", "2"],
        "disagg-remote": ["--disagg", "--router", "remote", "--routers", "2", "--disagg-policy", "always"],
        "planner-agg": [
            "--planner",
            "--planner-ttft",
            "200",
            "--planner-itl",
            "20",
            "--planner-profile",
            str(files.profile),
            "--engine",
            "mocker",
        ],
        "planner-disagg": [
            "--disagg",
            "--planner",
            "--planner-ttft",
            "300",
            "--planner-itl",
            "30",
            "--planner-profile",
            str(files.profile),
            "--planner-max-workers",
            "6",
        ],
        "tls-keys": [
            *tls,
            "--api-key-file",
            str(files.api_keys),
            "--api-key-rps",
            "5",
            "--cluster-secret-file",
            str(files.cluster_secret),
        ],
        "mtls": [*tls, "--tls-ca-file", str(files.ca)],
        "external-planes": [
            "--etcd",
            f"etcd://dyn@etcd.infra:2379?password-file={files.password}",
            "--nats",
            f"tls://nats.infra:4222?ca={files.ca}",
        ],
        "external-etcd-bundled-nats": ["--etcd", "etcd://10.0.0.5:2379,10.0.0.6:2379"],
        "planes-quorum": ["--planes-replicas", "3", "--frontend-replicas", "2", "--batch-db", "off"],
        "gpu-vllm": [
            "--engine",
            "vllm",
            "--model",
            "/models/qwen",
            "--model-pvc",
            "weights",
            "--gpus-per-worker",
            "2",
            "--worker-memory",
            "64Gi",
            "--context-length",
            "8192",
        ],
        "gpu-disagg-hub": [
            "--engine",
            "vllm",
            "--model",
            "Qwen/Qwen3-32B",
            "--model-cache-pvc",
            "models",
            "--hf-token-secret",
            "hf",
            "--disagg",
            "--gpus-per-worker",
            "4",
            "--prefill-gpus-per-worker",
            "1",
            "--prefill-worker-memory",
            "48Gi",
            "--worker-memory",
            "160Gi",
            "--env",
            "NCCL_DEBUG=WARN",
            "--env-from",
            "team-env",
            "--node-selector",
            "nvidia.com/gpu.product=H200",
            "--toleration",
            "nvidia.com/gpu:NoSchedule",
            "--worker-resource",
            "rdma/ib=1",
            "--ipc-lock",
            "--priority-class",
            "inference-high",
            "--image-pull-secret",
            "registry",
        ],
        "kv-tiers": ["--kv-host-cache-gb", "4", "--kv-disk-cache-gb", "20", "--engine", "mocker"],
        "named": [
            "--namespace",
            "inference",
            "--name",
            "chat",
            "--service-type",
            "LoadBalancer",
            "--allow-public",
            "--metrics-namespace",
            "monitoring",
            "--storage-class",
            "fast-ssd",
            "--port",
            "8080",
            "--batch-storage",
            "50Gi",
        ],
        "batch-postgres": ["--batch-db", BATCH_DB_URL, "--batch-db-password-file", str(files.batch_db_password)],
        "batch-off": ["--batch-db", "off"],
        "kserve": ["--kserve-grpc-port", "8787"],
    }


def render(args: list[str]) -> tuple[list[dict[str, Any]], str]:
    """(the objects, stderr) of `dyn k8s render ARGS`; raises the command's error."""
    result = CliRunner().invoke(k8s.app, ["render", *args], catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    objects = [o for o in yaml.safe_load_all(result.stdout) if o is not None]
    return objects, result.stderr


def pod_specs(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pod template's spec (Deployments and StatefulSets)."""
    return [o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for spec in pod_specs(objects) for c in spec["containers"]]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def deployment(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name)


def dump(objects: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objects)
