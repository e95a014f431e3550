"""`dyn k8s status`: the reason logic on literal API objects (pending on GPUs, crash-looping with its last log
line, image pull, a missing Secret, a failing readiness probe, all ready); then the real `kubernetes` client
against a loopback fake API server (tests/k8s_fake.py) whose service proxy forwards to a real `dyn serve`
frontend; then the command in a subprocess, with the CLI's own error mapping."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from dynamo_cli.cli.k8s_status import status_command
from dynamo_cli.errors import ConfigError
from dynamo_cli.k8s.cluster import StatusConfig, StatusUnreadable, read_status
from dynamo_cli.k8s.names import Names, Part
from dynamo_cli.k8s.status import (
    ComponentStatus,
    PodTrouble,
    StatusReport,
    Trouble,
    count_registered,
    explain,
    first_trouble,
    no_pods_reason,
    role_counts,
)
from tests.conftest import DynProcess
from tests.k8s_fake import TOKEN, FakeCluster, serving, status_object, write_kubeconfig

NS = "inference"
NAMES = Names("dyn")
GPU_MESSAGE = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available."
BACKOFF = "back-off 5m0s restarting failed container=worker pod=dyn-decode-7d9f_inference(4f1c)"
LAST_LINE = "error: etcd unreachable at etcd://dyn-etcd:2379: connection refused"
PROBE_EVENT = "Readiness probe failed: HTTP probe failed with statuscode: 503"


def pod(name: str, part: Part, status: dict[str, Any], **metadata: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": NAMES.labels(part), **metadata}, "status": status}


def running(ready: bool) -> dict[str, Any]:
    return {
        "phase": "Running",
        "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": str(ready)}],
        "containerStatuses": [{"name": "worker", "ready": ready, "restartCount": 0, "state": {"running": {}}}],
    }


def waiting(why: str, message: str, **last: Any) -> dict[str, Any]:
    container = {"name": "worker", "ready": False, "restartCount": 4, "state": {"waiting": {"reason": why}}}
    container["state"]["waiting"] |= {"message": message} if message else {}
    container |= {"lastState": {"terminated": last}} if last else {}
    return {"phase": "Running" if last else "Pending", "conditions": [{"type": "Ready", "status": "False"}]} | {
        "containerStatuses": [container]
    }


PENDING_GPU = {
    "phase": "Pending",
    "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": GPU_MESSAGE}],
}
CRASHING = waiting("CrashLoopBackOff", BACKOFF, exitCode=1, reason="Error")
IMAGE_PULL = waiting("ImagePullBackOff", 'Back-off pulling image "registry.local/dyn:0.1.0"')
NO_SECRET = waiting("CreateContainerConfigError", 'secret "dyn-cluster-secret" not found')


def workload(kind: str, part: Part, desired: int, ready: int, **status: Any) -> dict[str, Any]:
    metadata = {"name": NAMES.of(part), "namespace": NS, "labels": NAMES.labels(part)}
    return {"metadata": metadata, "spec": {"replicas": desired}, "status": {"readyReplicas": ready, **status}}


##### The reasons, pure #####


@pytest.mark.parametrize(
    ("status", "trouble", "reason"),
    [
        pytest.param(PENDING_GPU, Trouble.PENDING, "pending: insufficient nvidia.com/gpu", id="pending on GPUs"),
        pytest.param(CRASHING, Trouble.CRASH_LOOPING, f"crash-looping: {BACKOFF}", id="crash-looping, no log"),
        pytest.param(
            IMAGE_PULL,
            Trouble.IMAGE_PULL,
            'image pull: Back-off pulling image "registry.local/dyn:0.1.0"',
            id="image pull",
        ),
        pytest.param(NO_SECRET, Trouble.CONFIG, 'config: secret "dyn-cluster-secret" not found', id="missing Secret"),
        pytest.param(running(False), Trouble.NOT_READY, "not ready: readiness probe failing", id="probe failing"),
    ],
)
def test_the_first_unready_pod_gives_the_reason(status: dict[str, Any], trouble: Trouble, reason: str) -> None:
    pods = [pod("dyn-decode-b", Part.DECODE, running(True)), pod("dyn-decode-a", Part.DECODE, status)]
    found = first_trouble(pods)
    assert found is not None and (found.pod, found.trouble) == ("dyn-decode-a", trouble)
    assert explain(found) == reason


def test_a_crash_loop_is_explained_by_the_previous_containers_last_log_line() -> None:
    found = first_trouble([pod("dyn-decode-a", Part.DECODE, CRASHING)])
    assert found == PodTrouble("dyn-decode-a", Trouble.CRASH_LOOPING, BACKOFF, container="worker")
    assert explain(found, log_line=LAST_LINE + "\n") == f"crash-looping: {LAST_LINE}"


def test_a_container_killed_for_memory_says_so_without_a_log() -> None:
    found = first_trouble(
        [pod("p", Part.WORKER, waiting("CrashLoopBackOff", BACKOFF, exitCode=137, reason="OOMKilled"))]
    )
    assert found is not None and found.container is None
    assert explain(found, log_line="ignored") == "crash-looping: out of memory (OOMKilled)"


def test_a_failing_probe_names_the_latest_warning_event() -> None:
    found = first_trouble([pod("p", Part.ROUTER, running(False))])
    assert found is not None and found.container == "worker"
    assert explain(found, warning=PROBE_EVENT) == f"not ready: readiness probe failing ({PROBE_EVENT})"


def test_several_short_resources_are_each_named_once() -> None:
    message = "0/4 nodes are available: 1 Insufficient cpu, 3 Insufficient nvidia.com/gpu, 2 Insufficient cpu."
    trouble = PodTrouble("p", Trouble.PENDING, message)
    assert explain(trouble) == "pending: insufficient cpu, nvidia.com/gpu"
    taint = "0/1 nodes are available: 1 node(s) had untolerated taint {gpu: true}."
    assert explain(PodTrouble("p", Trouble.PENDING, taint)) == f"pending: {taint}"


def test_ready_pods_and_pods_being_deleted_give_no_reason() -> None:
    leaving = pod("dyn-worker-a", Part.WORKER, CRASHING, deletionTimestamp="2026-11-02T10:00:00Z")
    assert first_trouble([leaving, pod("dyn-worker-b", Part.WORKER, running(True))]) is None


def test_a_deployment_without_pods_says_why_from_its_conditions() -> None:
    quota = 'pods "dyn-worker-5c8d-x" is forbidden: exceeded quota: gpus, requested: nvidia.com/gpu=1, limited: 0'
    conditions = [
        {"type": "Available", "status": "False", "message": "Deployment does not have minimum availability."},
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": quota},
    ]
    assert no_pods_reason(workload("Deployment", Part.WORKER, 2, 0, conditions=conditions)) == f"no pods: {quota}"
    warning = "create Pod dyn-etcd-0 in StatefulSet dyn-etcd failed"
    assert no_pods_reason(workload("StatefulSet", Part.ETCD, 1, 0), warning) == f"no pods: {warning}"
    assert no_pods_reason(workload("StatefulSet", Part.ETCD, 1, 0)) == "no pods"


def test_registered_instances_are_counted_per_role_and_behind_routers_only_the_routers() -> None:
    health = {"status": "healthy", "instances": [{"role": "decode"}, {"role": "prefill"}, {"role": "decode"}]}
    counts = role_counts(health)
    assert counts == {"decode": 2, "prefill": 1}
    assert [count_registered(p, counts, False) for p in (Part.DECODE, Part.PREFILL, Part.WORKER)] == [2, 1, 0]
    assert [count_registered(p, counts, True) for p in (Part.ROUTER, Part.DECODE, Part.FRONTEND)] == [3, None, None]
    assert count_registered(Part.DECODE, None, False) is None


def test_the_table_marks_unknown_counts_and_the_exit_follows_readiness() -> None:
    rows = (
        ComponentStatus("frontend", "Deployment", "dyn-frontend", 1, 1, None, None),
        ComponentStatus("worker", "Deployment", "dyn-worker", 3, 1, None, "pending: insufficient nvidia.com/gpu"),
        ComponentStatus("etcd", "StatefulSet", "dyn-etcd", 1, 1, None, None),
    )
    report = StatusReport(NS, "dyn", rows, "GET /health: HTTP 503 no endpoints")
    assert report.to_table().splitlines() == [
        "NAME          KIND         DESIRED  READY  REGISTERED  REASON",
        "dyn-frontend  Deployment   1        1      -           -",
        "dyn-worker    Deployment   3        1      ?           pending: insufficient nvidia.com/gpu",
        "dyn-etcd      StatefulSet  1        1      -           -",
        "registered instances unknown: GET /health: HTTP 503 no endpoints",
    ]
    assert not report.is_ready
    assert StatusReport(NS, "dyn", (rows[0], rows[2])).is_ready


##### The real client against a fake API server #####


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[FakeCluster, Path]]:
    pytest.importorskip("kubernetes")
    fake = FakeCluster(NS)
    with serving(fake) as port:
        yield fake, write_kubeconfig(tmp_path / "kubeconfig", port, NS)


def disagg(fake: FakeCluster) -> None:
    """A rendered --disagg deployment: decode crash-looping in one pod, prefill pending on GPUs."""
    fake.deployments = [
        workload("Deployment", Part.FRONTEND, 1, 1),
        workload("Deployment", Part.DECODE, 2, 1),
        workload("Deployment", Part.PREFILL, 1, 0),
        workload("Deployment", Part.DECODE, 5, 5)
        | {"metadata": {"name": "other-decode", "labels": Names("other").labels(Part.DECODE)}},
    ]
    fake.statefulsets = [workload("StatefulSet", Part.ETCD, 1, 1)]
    fake.pods = [
        pod("dyn-frontend-1", Part.FRONTEND, running(True)),
        pod("dyn-decode-1", Part.DECODE, running(True)),
        pod("dyn-decode-2", Part.DECODE, CRASHING),
        pod("dyn-prefill-1", Part.PREFILL, PENDING_GPU),
        pod("dyn-etcd-0", Part.ETCD, running(True)),
    ]
    fake.logs[("dyn-decode-2", "worker", True)] = f"starting\n{LAST_LINE}\n"
    fake.proxy = (200, {"status": "healthy", "instances": [{"role": "decode"}, {"role": "prefill"}]})


def test_a_disagg_deployment_reads_as_rows_with_reasons(cluster: tuple[FakeCluster, Path]) -> None:
    fake, kubeconfig = cluster
    disagg(fake)
    report = read_status(StatusConfig(NS, "dyn", str(kubeconfig)))
    assert report.components == (
        ComponentStatus("frontend", "Deployment", "dyn-frontend", 1, 1, None, None),
        ComponentStatus("decode", "Deployment", "dyn-decode", 2, 1, 1, f"crash-looping: {LAST_LINE}"),
        ComponentStatus("prefill", "Deployment", "dyn-prefill", 1, 0, 1, "pending: insufficient nvidia.com/gpu"),
        ComponentStatus("etcd", "StatefulSet", "dyn-etcd", 1, 1, None, None),
    )
    assert report.registered_error is None and not report.is_ready
    selector = "app.kubernetes.io/name=dyn,app.kubernetes.io/instance=dyn"
    base, apps = f"/api/v1/namespaces/{NS}", f"/apis/apps/v1/namespaces/{NS}"
    assert [(s.path, s.query) for s in fake.seen] == [
        (f"{apps}/deployments", {"labelSelector": selector}),
        (f"{apps}/statefulsets", {"labelSelector": selector}),
        (f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets", {"labelSelector": selector}),
        (f"{base}/pods", {"labelSelector": selector}),
        (f"{base}/services/dyn-frontend:http/proxy/health", {}),
        (f"{base}/pods/dyn-decode-2/log", {"container": "worker", "previous": "True", "tailLines": "1"}),
    ]
    assert {s.authorization for s in fake.seen} == {f"Bearer {TOKEN}"}


def test_a_pool_of_multi_node_workers_is_a_row_of_groups(cluster: tuple[FakeCluster, Path]) -> None:
    fake, kubeconfig = cluster
    fake.deployments = [workload("Deployment", Part.FRONTEND, 1, 1)]
    fake.leaderworkersets = [workload("LeaderWorkerSet", Part.WORKER, 3, 2)]  # 3 groups wanted, 2 ready
    fake.pods = [pod("dyn-frontend-1", Part.FRONTEND, running(True))]
    fake.pods += [pod(f"dyn-worker-{g}{node}", Part.WORKER, running(g < 2)) for g in range(3) for node in ("", "-1")]
    fake.proxy = (200, {"status": "healthy", "instances": [{"role": "both"}, {"role": "both"}]})
    report = read_status(StatusConfig(NS, "dyn", str(kubeconfig)))
    row = ComponentStatus("worker", "LeaderWorkerSet", "dyn-worker", 3, 2, 2, "not ready: readiness probe failing")
    assert report.components[1] == row
    assert not report.is_ready


def test_detail_reads_that_are_refused_fall_back_to_the_api_servers_words(cluster: tuple[FakeCluster, Path]) -> None:
    fake, kubeconfig = cluster
    disagg(fake)
    fake.forbidden = {"log", "proxy"}
    report = read_status(StatusConfig(NS, "dyn", str(kubeconfig)))
    decode = report.components[1]
    assert (decode.registered, decode.reason) == (None, f"crash-looping: {BACKOFF}")
    assert report.registered_error is not None
    assert report.registered_error.startswith("GET /health through the API server's proxy to service dyn-frontend:http")
    assert "HTTP 403 services is forbidden" in report.registered_error
    assert "?           crash-looping" in report.to_table()


def test_a_probe_failure_reads_the_pods_latest_warning_event(cluster: tuple[FakeCluster, Path]) -> None:
    fake, kubeconfig = cluster
    fake.deployments = [workload("Deployment", Part.FRONTEND, 1, 1), workload("Deployment", Part.WORKER, 1, 0)]
    fake.pods = [pod("dyn-frontend-1", Part.FRONTEND, running(True)), pod("dyn-worker-1", Part.WORKER, running(False))]
    event = {"involvedObject": {"name": "dyn-worker-1"}, "type": "Warning", "message": PROBE_EVENT}
    older = event | {"message": "Liveness probe failed", "lastTimestamp": "2026-11-02T09:00:00Z"}
    fake.events = [older, event | {"lastTimestamp": "2026-11-02T10:00:00Z"}, {**event, "type": "Normal"}]
    fake.proxy = (503, {"status": "unhealthy", "instances": [], "message": "No endpoints available"})
    report = read_status(StatusConfig(NS, "dyn", str(kubeconfig)))
    assert report.components[1] == ComponentStatus(
        "worker", "Deployment", "dyn-worker", 1, 0, 0, f"not ready: readiness probe failing ({PROBE_EVENT})"
    )
    assert report.registered_error is None  # the frontend's own 503: zero instances, read
    assert fake.seen[-1].query == {"fieldSelector": "involvedObject.name=dyn-worker-1,type=Warning"}


def test_no_endpoints_behind_the_frontend_service_is_a_question_mark_with_the_reason(
    cluster: tuple[FakeCluster, Path],
) -> None:
    fake, kubeconfig = cluster
    fake.deployments = [workload("Deployment", Part.FRONTEND, 1, 0), workload("Deployment", Part.ROUTER, 2, 0)]
    fake.proxy = (503, status_object(503, 'no endpoints available for service "dyn-frontend:http"'))
    quota = "exceeded quota: compute"
    fake.deployments[0]["status"]["conditions"] = [{"type": "ReplicaFailure", "status": "True", "message": quota}]
    report = read_status(StatusConfig(NS, "dyn", str(kubeconfig)))
    assert [(c.name, c.registered, c.reason) for c in report.components] == [
        ("dyn-frontend", None, f"no pods: {quota}"),
        ("dyn-router", None, "no pods"),
    ]
    assert report.registered_error is not None
    assert report.registered_error.endswith('HTTP 503 no endpoints available for service "dyn-frontend:http"')


def test_an_unreachable_frontend_url_is_a_question_mark_with_the_reason(cluster: tuple[FakeCluster, Path]) -> None:
    fake, kubeconfig = cluster
    disagg(fake)
    with serving(FakeCluster(NS)) as port:
        pass  # closed: nothing listens on the port any more
    report = read_status(StatusConfig(NS, "dyn", str(kubeconfig), frontend_url=f"http://127.0.0.1:{port}/"))
    assert [c.registered for c in report.components] == [None, None, None, None]
    assert report.registered_error == f"GET http://127.0.0.1:{port}/health: ConnectError [Errno 111] Connection refused"
    assert not any("proxy" in s.path for s in fake.seen)


@pytest.mark.parametrize(
    ("forbidden", "message"),
    [
        pytest.param(
            {"pods"}, "forbidden (403): may not list pods in namespace inference; `dyn k8s status` needs", id="403 pods"
        ),
        pytest.param(
            {"statefulsets"}, "forbidden (403): may not list statefulsets in namespace inference", id="403 sts"
        ),
    ],
)
def test_a_refused_required_read_names_the_namespace_and_the_permission(
    cluster: tuple[FakeCluster, Path], forbidden: set[str], message: str
) -> None:
    fake, kubeconfig = cluster
    disagg(fake)
    fake.forbidden = forbidden
    with pytest.raises(StatusUnreadable) as caught:
        read_status(StatusConfig(NS, "dyn", str(kubeconfig)))
    assert str(caught.value).startswith(message) and caught.value.exit_code == 3


def test_a_namespace_without_the_deployment_says_where_it_looked(cluster: tuple[FakeCluster, Path]) -> None:
    fake, kubeconfig = cluster
    disagg(fake)
    with pytest.raises(StatusUnreadable, match=r"labelled app.kubernetes.io/instance=prod in namespace inference"):
        read_status(StatusConfig(NS, "prod", str(kubeconfig)))


def test_without_the_client_status_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes → ImportError
    with pytest.raises(
        ConfigError, match=r"dyn k8s status needs the kubernetes client: pip install 'dynamo-cli\[k8s\]'"
    ):
        read_status(StatusConfig(NS, kubeconfig="/nonexistent"))


##### A real frontend behind the fake API server's proxy #####


def forward_to(frontend: DynProcess) -> Any:
    def proxy(path: str) -> tuple[int, Any]:
        answer = httpx.get(f"{frontend.url}/{path}", timeout=5)
        return answer.status_code, answer.json()

    return proxy


def test_a_ready_deployment_counts_a_real_frontends_instances_and_exits_zero(
    cluster: tuple[FakeCluster, Path],
    dyn_serve,  # type: ignore[no-untyped-def]
) -> None:
    fake, kubeconfig = cluster
    frontend: DynProcess = dyn_serve("--engine", "mocker", "--disagg")
    fake.deployments = [workload("Deployment", p, 1, 1) for p in (Part.FRONTEND, Part.DECODE, Part.PREFILL)]
    fake.pods = [pod(f"{NAMES.of(p)}-1", p, running(True)) for p in (Part.FRONTEND, Part.DECODE, Part.PREFILL)]
    fake.proxy = forward_to(frontend)
    app = typer.Typer()
    app.command()(status_command)
    for flags in ([], ["--frontend-url", frontend.url]):
        result = CliRunner().invoke(app, ["--namespace", NS, "--kubeconfig", str(kubeconfig), *flags])
        assert result.exit_code == 0, result.output
        assert result.output.splitlines() == [
            "NAME          KIND        DESIRED  READY  REGISTERED  REASON",
            "dyn-frontend  Deployment  1        1      -           -",
            "dyn-decode    Deployment  1        1      1           -",
            "dyn-prefill   Deployment  1        1      1           -",
        ]


##### The command in a subprocess, through the CLI's error mapping #####


def dyn_k8s_status(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "dynamo_cli.cli.main", "k8s", "status", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def test_the_command_prints_the_table_and_exits_one_while_a_pod_is_not_ready(
    cluster: tuple[FakeCluster, Path],
) -> None:
    fake, kubeconfig = cluster
    disagg(fake)
    result = dyn_k8s_status("--namespace", NS, "--kubeconfig", str(kubeconfig), "--json")
    assert result.returncode == 1, result.stderr
    body = json.loads(result.stdout)
    assert (body["namespace"], body["name"], body["is_ready"], body["registered_error"]) == (NS, "dyn", False, None)
    assert [(c["name"], c["ready"], c["registered"]) for c in body["components"]] == [
        ("dyn-frontend", 1, None),
        ("dyn-decode", 1, 1),
        ("dyn-prefill", 0, 1),
        ("dyn-etcd", 1, None),
    ]


@pytest.mark.parametrize(
    ("args", "code", "expected"),
    [
        pytest.param([], 3, "cannot reach the Kubernetes API server at http://127.0.0.1:", id="unreachable"),
        pytest.param(["--namespace", "Bad_NS"], 2, "--namespace 'Bad_NS' is not a Kubernetes name", id="bad namespace"),
        pytest.param(["--frontend-url", "dyn-frontend"], 2, "--frontend-url 'dyn-frontend' is not a URL", id="bad URL"),
    ],
)
def test_bad_input_is_one_red_line_and_a_non_zero_exit(
    tmp_path: Path, args: list[str], code: int, expected: str
) -> None:
    pytest.importorskip("kubernetes")
    with serving(FakeCluster(NS)) as port:
        pass  # closed: nothing listens on the port any more
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", port, NS)
    result = dyn_k8s_status("--kubeconfig", str(kubeconfig), "--timeout", "5", *args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expected in lines[0] and "Traceback" not in result.stderr
    if code == 3:
        # render's namespace, not the kubeconfig context's (`inference`): status looks where render wrote
        assert "to list deployments in namespace dyn" in lines[0] and "Connection refused" in lines[0]
