"""`dyn k8s render`'s CRD objects (PodMonitor, HTTPRoute, ScaledObject) validate against their published schemas
(issue 49): the @kubernetes-models npm packages pinned in tests/k8s/crd/package-lock.json, run by
tests/k8s/crd/validate.js. kubernetes-validate has no schema of a CRD; `make setup-crd-schemas` installs these.
(No such package has LWS's: test_render_groups.py validates the LeaderWorkerSets against its vendored CRD.)"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.render_cases import CRD_KINDS, Files, by_kind, make_files, render

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "k8s" / "crd" / "validate.js"
CACHE = ROOT / ".cache" / "crd-schemas"
MODULES = CACHE / "node_modules"
NODE = shutil.which("node")


def _is_installed() -> bool:
    """The pinned packages are what `make setup-crd-schemas` installed (it copies the lock file in after)."""
    stamp, lock = CACHE / "installed.json", SCRIPT.parent / "package-lock.json"
    return MODULES.is_dir() and stamp.is_file() and stamp.read_bytes() == lock.read_bytes()


pytestmark = [
    pytest.mark.skipif(NODE is None, reason="node missing: apt-get install nodejs npm, then make setup-crd-schemas"),
    pytest.mark.skipif(not _is_installed(), reason=f"CRD schemas missing or stale in {CACHE}: make setup-crd-schemas"),
]

KEDA = ["--keda-prometheus", "http://prometheus.monitoring:9090", "--keda-requests-per-worker", "4"]
GATEWAY = ["--gateway", "infra/public", "--hostname", "llm.example.com"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return make_files(tmp_path_factory.mktemp("crd-render-files"))


def _shapes(files: Files) -> dict[str, list[str]]:
    """Renders that between them write every CRD kind in each of its forms."""
    tls = ["--tls-cert-file", str(files.cert), "--tls-key-file", str(files.key)]
    return {
        "agg": ["--pod-monitor", *GATEWAY, *KEDA],
        "disagg-remote-named": [
            *["--disagg", "--router", "remote", "--namespace", "inference", "--name", "chat", "--port", "8080"],
            *["--pod-monitor", *GATEWAY, "--hostname", "chat.example.com"],
            *[*KEDA, "--keda-min-workers", "2", "--keda-max-workers", "12", "--keda-cooldown", "900"],
        ],
        "tls-gateway-same-namespace": [*tls, "--pod-monitor", "--gateway", "public"],  # https + tlsConfig, no hostname
        "metrics-behind-a-key": ["--pod-monitor", "--api-key-file", str(files.api_keys), "--metrics-require-key"],
        "keda-fractional-threshold": ["--keda-prometheus", "http://prom:9090", "--keda-requests-per-worker", "2.5"],
        # multi-node workers: a PodMonitor leaving the followers out, ScaledObjects of LeaderWorkerSets
        "groups": ["--nodes-per-worker", "2", "--engine", "mocker", "--pod-monitor", "--disagg", *KEDA],
    }


def _validate(objects: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    assert NODE is not None
    command = [NODE, str(SCRIPT), str(MODULES)]
    return subprocess.run(command, input=json.dumps(objects), capture_output=True, text=True, timeout=30, check=False)


def _crd_objects(files: Files) -> list[dict[str, Any]]:
    return [o for args in _shapes(files).values() for o in render(args)[0] if o["kind"] in CRD_KINDS]


def test_every_rendered_pod_monitor_http_route_and_scaled_object_validates_against_its_crd(files: Files) -> None:
    objects = _crd_objects(files)
    assert [len(by_kind(objects, kind)) for kind in CRD_KINDS] == [5, 3, 6]
    result = _validate(objects)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def _broken(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return copy.deepcopy(by_kind(objects, kind)[0])


def test_an_object_its_crd_rejects_fails_the_check_naming_it_and_the_field(files: Files) -> None:
    objects, _ = render(["--pod-monitor", *GATEWAY, *KEDA])
    scaled, route, monitor = (_broken(objects, kind) for kind in ("ScaledObject", "HTTPRoute", "PodMonitor"))
    scaled["spec"]["minReplicaCount"] = "one"
    route["spec"]["rules"][0]["timeouts"]["request"] = "forever"
    monitor["spec"]["podMetricsEndpoints"][0]["scheme"] = "ftp"
    result = _validate([scaled, *by_kind(objects, "HTTPRoute"), route, monitor])
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "ScaledObject/dyn-worker: data/spec/minReplicaCount must be integer",
        'HTTPRoute/dyn-frontend: data/spec/rules/0/timeouts/request must match pattern "^([0-9]{1,5}(h|m|s|ms)){1,4}$"',
        "PodMonitor/dyn: data/spec/podMetricsEndpoints/0/scheme must be equal to one of the allowed values",
    ]


def test_a_kind_the_script_has_no_schema_of_is_an_error_not_a_pass() -> None:
    (service, *_) = by_kind(render([])[0], "Service")
    result = _validate([service])
    assert result.returncode == 2
    assert result.stdout == f"Service/{service['metadata']['name']}: no schema for apiVersion v1 kind Service here\n"
