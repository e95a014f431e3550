"""`dyn k8s render --keda-prometheus`: a KEDA ScaledObject per worker pool, the alternative to the planner (issue 49).
Each scales its pool's Deployment on series a worker really exports (read from the worker's own collector), its
query is evaluated by Prometheus's promtool on those series, and it is refused beside another writer of the count."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynamo_cli.errors import ConfigError
from dynamo_cli.k8s.keda import WORKER_LOAD
from dynamo_cli.wire import LoadMetrics
from dynamo_cli.worker_metrics import WorkerMetrics
from tests.k8s.render_cases import KUBE_VERSIONS, Files, by_kind, deployment, make_files, render

kubernetes_validate = pytest.importorskip("kubernetes_validate")

KEDA = ["--keda-prometheus", "http://prometheus.monitoring:9090", "--keda-requests-per-worker", "4"]
PROMTOOL = shutil.which("promtool")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return make_files(tmp_path_factory.mktemp("keda-render-files"))


def _query(scaled: dict[str, Any]) -> str:
    (trigger,) = scaled["spec"]["triggers"]
    return str(trigger["metadata"]["query"])


@pytest.mark.parametrize(
    ("extra", "pools"),
    [
        pytest.param([], ["dyn-worker"], id="agg"),
        pytest.param(["--disagg", "--router", "kv"], ["dyn-decode", "dyn-prefill"], id="disagg"),
    ],
)
def test_every_worker_pool_gets_a_scaled_object_of_its_deployment(extra: list[str], pools: list[str]) -> None:
    flags = [*KEDA, "--keda-min-workers", "2", "--keda-max-workers", "12", "--keda-cooldown", "900", *extra]
    objects, _ = render(flags)
    scaled = by_kind(objects, "ScaledObject")
    assert [s["metadata"]["name"] for s in scaled] == pools
    for obj in scaled:
        name, spec = obj["metadata"]["name"], obj["spec"]
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert "replicas" not in deployment(objects, name)["spec"]  # KEDA's count: a re-apply must not reset it
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 12)
        scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert scale_down == {
            "stabilizationWindowSeconds": 900,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
        }
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["serverAddress"] == "http://prometheus.monitoring:9090"
        assert trigger["metadata"]["threshold"] == "4"
        assert f'pod=~"{name}-[a-z0-9]+-[a-z0-9]+"' in trigger["metadata"]["query"]
    assert deployment(objects, "dyn-frontend")["spec"]["replicas"] == 1  # only the worker pools are KEDA's
    assert not [o for o in objects if o["metadata"]["name"] == "dyn-planner"]
    for obj in objects:  # the rest of the deployment is as valid as without KEDA
        for version in KUBE_VERSIONS if obj["kind"] != "ScaledObject" else ():
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_scaled_object_is_written_with_its_pool(tmp_path: Path) -> None:
    render([*KEDA, "--out", str(tmp_path)])
    kinds = [o["kind"] for o in yaml.safe_load_all((tmp_path / "worker.yaml").read_text())]
    assert kinds == ["Deployment", "PodDisruptionBudget", "ScaledObject"]


def _exposition(load: LoadMetrics, component: str) -> str:
    """What a worker's system server serves at /metrics for its engine's load: its own collector's output."""
    registry = CollectorRegistry()
    registry.register(WorkerMetrics(lambda: load, "dyn", component, "smollm2"))
    return generate_latest(registry).decode()


def test_the_query_reads_series_a_worker_exports() -> None:
    query = _query(by_kind(render(KEDA)[0], "ScaledObject")[0])
    named = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", query))
    assert named == set(WORKER_LOAD)
    families = {f.name: f for f in text_string_to_metric_families(_exposition(LoadMetrics(), "backend"))}
    for series in named:
        assert series in families and families[series].type == "gauge", f"{series} is not what a worker exports"
        for sample in families[series].samples:  # the scrape's own labels select the pool: none is overwritten
            assert not {"namespace", "pod"} & set(sample.labels), sample


def _input_series(namespace: str, pod: str, load: LoadMetrics, component: str = "backend") -> list[dict[str, str]]:
    """The worker's exported samples of WORKER_LOAD as Prometheus stores them after a PodMonitor's scrape."""
    found = []
    for family in text_string_to_metric_families(_exposition(load, component)):
        for sample in family.samples:
            if sample.name in WORKER_LOAD:
                labels = {**sample.labels, "namespace": namespace, "pod": pod}
                selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                found.append({"series": f"{sample.name}{{{selector}}}", "values": f"{sample.value:g}x5"})
    return found


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: Debian's prometheus package (.ci/install-planes.sh)")
def test_promtool_evaluates_the_query_to_the_pools_running_and_waiting_requests(tmp_path: Path) -> None:
    (scaled,) = by_kind(render([*KEDA, "--namespace", "llm"])[0], "ScaledObject")
    series = [
        *_input_series("llm", "dyn-worker-7c9d5b8f4-x2kqp", LoadMetrics(num_running=3, num_waiting=2)),
        *_input_series("llm", "dyn-worker-7c9d5b8f4-m8rtz", LoadMetrics(num_running=4)),
        # neighbours: another deployment's pool in the namespace, the same pod name in another namespace
        *_input_series("llm", "dyn-worker-b-6f7d8c9b5-q4wzl", LoadMetrics(num_running=50, num_waiting=9)),
        *_input_series("staging", "dyn-worker-7c9d5b8f4-x2kqp", LoadMetrics(num_running=70)),
    ]
    expected = {"expr": _query(scaled), "eval_time": "2m", "exp_samples": [{"labels": "{}", "value": 9}]}
    test = {"interval": "1m", "input_series": series, "promql_expr_test": [expected]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({"rule_files": [], "tests": [test]}, sort_keys=False))
    result = subprocess.run(
        [str(PROMTOOL), "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            [*KEDA, "--planner", "--planner-ttft", "200", "--planner-itl", "20", "--engine", "mocker"],
            "--keda-prometheus and --planner would both set the worker pools' replicas",
            id="with-planner",
        ),
        pytest.param(["--keda-prometheus", "http://prom:9090"], "needs --keda-requests-per-worker", id="no-threshold"),
        pytest.param([*KEDA, "--keda-requests-per-worker", "0"], "--keda-requests-per-worker N > 0", id="zero"),
        pytest.param([*KEDA, "--keda-min-workers", "0"], "--keda-min-workers must be >= 1", id="to-zero"),
        pytest.param([*KEDA, "--keda-max-workers", "0"], "--keda-max-workers (0) is below", id="max-below-min"),
        pytest.param([*KEDA, "--keda-cooldown", "7200"], "--keda-cooldown must be between 0 and 3600", id="cooldown"),
        pytest.param([*KEDA, "--workers", "3"], "--workers 3 with --keda-prometheus", id="a-count-of-its-own"),
        pytest.param([*KEDA, "--disagg", "--prefill-workers", "2"], "--prefill-workers 2 with", id="prefill-count"),
        pytest.param(["--keda-min-workers", "2"], "--keda-min-workers needs --keda-prometheus", id="alone"),
        pytest.param([*KEDA[2:], "--keda-prometheus", "prom:9090"], "must be the http:// or https:// URL", id="url"),
        pytest.param(
            [*KEDA[2:], "--keda-prometheus", "http://admin:s3cret@prom:9090"], "holds a user or password", id="creds"
        ),
    ],
)
def test_keda_flags_that_a_cluster_would_not_run_are_refused(args: list[str], message: str, files: Files) -> None:
    if "--planner" in args:
        args += ["--planner-profile", str(files.profile)]
    with pytest.raises(ConfigError, match=re.escape(message)):
        render(args)
