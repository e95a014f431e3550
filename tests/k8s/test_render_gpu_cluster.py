"""`dyn k8s render` as a platform team applies it to a GPU cluster (issue 49): where the model comes from, start-up
that a slow load survives, every GPU of a pod used, per-pool resources, upgrades that change no immutable field, no
public API without keys, drains that let streams finish, and flags that are refused rather than dropped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_cli import __version__
from dynamo_cli.errors import ConfigError
from dynamo_cli.k8s import names as k8s_names
from tests.docs.blocks import ROOT, fenced_blocks, shell_commands
from tests.k8s.render_cases import (
    CRD_KINDS,
    KUBE_VERSIONS,
    Files,
    containers,
    deployment,
    make_files,
    pod_specs,
    render,
)

kubernetes_validate = pytest.importorskip("kubernetes_validate")

HUB = ["--engine", "vllm", "--model", "Qwen/Qwen3-8B", "--gpus-per-worker", "1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return make_files(tmp_path_factory.mktemp("gpu-render-files"))


def _pod(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return deployment(objects, name)["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _engine_options(container: dict[str, Any]) -> dict[str, Any]:
    args = container["args"]
    return json.loads(args[args.index("--extra-engine-args") + 1]) if "--extra-engine-args" in args else {}


def test_a_hub_model_needs_somewhere_to_download_to() -> None:
    with pytest.raises(ConfigError, match="--model 'Qwen/Qwen3-8B' is a hub id: give --model-cache-pvc"):
        render(HUB)


def test_a_hub_model_downloads_into_the_shared_cache_the_frontend_reads_its_tokenizer_from() -> None:
    objects, stderr = render([*HUB, "--model-cache-pvc", "models", "--hf-token-secret", "hf"])
    for name in ("dyn-worker", "dyn-frontend"):
        pod = _pod(objects, name)
        volume = next(v for v in pod["volumes"] if v["name"] == "model-cache")
        assert volume["persistentVolumeClaim"] == {"claimName": "models"}  # read-write: no readOnly
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model-cache")
        assert mount == {"name": "model-cache", "mountPath": "/var/cache/dyn-models"}
        env = _env(pod["containers"][0])
        assert env["HF_HOME"] == "/var/cache/dyn-models"
        assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert "# yours: Secret hf with key token (HF_TOKEN)" in stderr
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == "models"]


def test_the_model_claim_is_mounted_in_the_frontend_too_and_the_model_must_be_on_it() -> None:
    objects, _ = render([*HUB[:2], "--model", "/models/qwen", "--model-pvc", "weights", "--gpus-per-worker", "1"])
    for name in ("dyn-worker", "dyn-frontend"):  # the frontend loads the tokenizer at the worker's path
        volumes = {v["name"]: v for v in _pod(objects, name)["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    with pytest.raises(ConfigError, match="must be a path under it"):
        render([*HUB[:2], "--model", "/opt/qwen", "--model-pvc", "weights", "--gpus-per-worker", "1"])


def test_a_startup_probe_lets_a_model_load_for_the_startup_timeout_before_liveness_counts() -> None:
    objects, _ = render(["--engine", "mocker", "--startup-timeout", "3600"])
    for container in containers([o for o in objects if o["metadata"]["name"].startswith("dyn-")]):
        if container["name"] in ("etcd", "nats"):
            continue
        startup = container["startupProbe"]
        allowed = startup["periodSeconds"] * startup["failureThreshold"]
        assert startup["httpGet"]["path"] == "/live"
        assert allowed >= (3600 if container["name"] == "worker" else 600), container["name"]
        assert container["livenessProbe"]["periodSeconds"] * container["livenessProbe"]["failureThreshold"] >= 60
    worker = deployment(objects, "dyn-worker")
    assert worker["spec"]["progressDeadlineSeconds"] > 3600  # a rollout is not failed while its pod still loads


@pytest.mark.parametrize(
    ("engine", "key"), [("vllm", "tensor_parallel_size"), ("sglang", "tp_size"), ("trtllm", "tensor_parallel_size")]
)
def test_one_engine_spans_every_gpu_of_its_pod(engine: str, key: str) -> None:
    flags = ["--engine", engine, "--model", "/models/m", "--model-pvc", "weights", "--gpus-per-worker", "4"]
    worker = _pod(render(flags)[0], "dyn-worker")["containers"][0]
    assert _engine_options(worker)[key] == 4
    pinned = _pod(render([*flags, "--engine-arg", f"{key}=2"])[0], "dyn-worker")["containers"][0]
    assert _engine_options(pinned)[key] == 2  # one given is kept (pipeline parallel over the rest, say)


def test_disaggregated_pools_have_resources_and_engine_options_of_their_own() -> None:
    flags = ["--engine", "vllm", "--model", "/models/m", "--model-pvc", "weights", "--disagg", "--gpus-per-worker", "4"]
    flags += ["--prefill-gpus-per-worker", "1", "--prefill-worker-memory", "40Gi", "--worker-memory", "160Gi"]
    flags += ["--prefill-engine-arg", "max_num_batched_tokens=16384", "--decode-engine-arg", "max_num_seqs=512"]
    objects, _ = render(flags)
    prefill, decode = (_pod(objects, f"dyn-{pool}")["containers"][0] for pool in ("prefill", "decode"))
    assert prefill["resources"]["limits"] == {"memory": "40Gi", "nvidia.com/gpu": "1"}
    assert decode["resources"]["limits"] == {"memory": "160Gi", "nvidia.com/gpu": "4"}
    assert _engine_options(prefill) == {"max_num_batched_tokens": 16384}  # one GPU: no tensor parallelism
    assert _engine_options(decode) == {"max_num_seqs": 512, "tensor_parallel_size": 4}


IMMUTABLE = {
    "StatefulSet": ("selector", "serviceName", "volumeClaimTemplates", "podManagementPolicy"),
    "Deployment": ("selector",),
    "PersistentVolumeClaim": ("accessModes", "storageClassName", "volumeMode"),
}
"""The spec fields the API server refuses to change on an apply (a StatefulSet's claim templates: whole)."""


def test_an_upgrade_re_render_changes_no_immutable_field(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["--planner", "--planner-ttft", "200", "--planner-itl", "20", "--engine", "mocker"]
    before = render([*flags, "--planner-profile", str(make_files(Path("/tmp/dyn-upgrade-files")).profile)])[0]
    monkeypatch.setattr(k8s_names, "__version__", __version__ + ".post1")
    after = render([*flags, "--planner-profile", "/tmp/dyn-upgrade-files/profile.json"])[0]
    assert any(o["metadata"]["labels"]["app.kubernetes.io/version"].endswith(".post1") for o in after)

    def immutable(objects: list[dict[str, Any]]) -> dict[tuple[str, str], Any]:
        return {
            (o["kind"], o["metadata"]["name"]): {f: o["spec"].get(f) for f in IMMUTABLE[o["kind"]]}
            for o in objects
            if o["kind"] in IMMUTABLE
        }

    assert immutable(before) == immutable(after)
    assert {kind for kind, _ in immutable(before)} >= {"StatefulSet", "Deployment"}


@pytest.mark.parametrize("kind", ["NodePort", "LoadBalancer"])
def test_a_public_service_needs_api_keys_or_a_word_that_it_is_meant(kind: str, files: Files) -> None:
    with pytest.raises(ConfigError, match=f"--service-type {kind} with no --api-key-file"):
        render(["--service-type", kind])
    keyed, _ = render(["--service-type", kind, "--api-key-file", str(files.api_keys)])
    public, _ = render(["--service-type", kind, "--allow-public"])
    for objects in (keyed, public):
        assert (
            next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "dyn-frontend")["spec"][
                "type"
            ]
            == kind
        )


def test_a_pod_drains_its_streams_after_the_services_dropped_it() -> None:
    objects, _ = render(["--engine", "mocker", "--router", "remote"])
    for name, drain in (("dyn-worker", 60), ("dyn-router", 60), ("dyn-frontend", 30)):
        pod = _pod(objects, name)
        container = pod["containers"][0]
        assert container["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "5"]}}
        args = container["args"]
        if name != "dyn-frontend":  # render's drain: 60 s, not dyn serve's 5 (the frontend's HTTP server: 30 s)
            assert args[args.index("--graceful-shutdown") + 1] == "60.0"
        assert pod["terminationGracePeriodSeconds"] == 5 + drain + 10, name
    short = _pod(render(["--engine", "mocker", "--graceful-shutdown", "20"])[0], "dyn-worker")
    assert short["terminationGracePeriodSeconds"] == 35


def test_no_pod_gets_service_links_that_dyn_would_read_as_settings() -> None:
    objects, _ = render(["--router", "remote", "--routers", "2"])
    for spec in pod_specs(objects):
        assert spec["enableServiceLinks"] is False  # a Service dyn-router would inject DYN_ROUTER_PORT=tcp://...


def test_the_disk_tier_requests_its_space_and_shm_and_etcd_are_sized() -> None:
    objects, _ = render(["--engine", "mocker", "--kv-disk-cache-gb", "20"])
    worker = _pod(objects, "dyn-worker")["containers"][0]
    assert worker["resources"]["requests"]["ephemeral-storage"] == "20G"
    etcd = next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "dyn-etcd")
    storage = etcd["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    assert storage == "4Gi"  # above etcd's 2 GiB backend quota
    gpu = _pod(render([*HUB[:2], "--model", "/m", "--gpus-per-worker", "1", "--shm-size", "16Gi"])[0], "dyn-worker")
    shm = next(v for v in gpu["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}


def test_variables_and_secrets_reach_every_dyn_container() -> None:
    objects, stderr = render(["--router", "remote", "--env", "NCCL_DEBUG=WARN", "--env-from", "team-env"])
    for name in ("dyn-frontend", "dyn-worker", "dyn-router"):
        container = _pod(objects, name)["containers"][0]
        assert _env(container)["NCCL_DEBUG"] == "WARN"
        assert container["envFrom"] == [{"secretRef": {"name": "team-env"}}]
    assert "# yours: Secret team-env" in stderr


def _guide_renders(files: Files) -> list[tuple[int, list[str]]]:
    """Every `dyn k8s render` of the Kubernetes guide, with its local files made real and `--out` dropped."""
    local = {"api-keys.txt": files.api_keys, "profile.json": files.profile, "pg-password": files.batch_db_password}
    found = []
    for block in fenced_blocks(ROOT / "docs" / "guides" / "kubernetes.md"):
        for line, words in shell_commands(block):
            if words[:3] != ["dyn", "k8s", "render"]:
                continue
            args = [str(local.get(word, word)) for word in words[3:]]
            if "--out" in args:
                at = args.index("--out")
                args = args[:at] + args[at + 2 :]
            found.append((line, args))
    return found


def test_every_render_the_guide_shows_validates_strictly(files: Files) -> None:
    shown = _guide_renders(files)
    assert len(shown) >= 4
    for line, args in shown:
        objects, _ = render(args)
        # the CRDs' own: test_render_crds.py, and test_render_groups.py (LeaderWorkerSet, the guide's included)
        for obj in (o for o in objects if o["kind"] not in (*CRD_KINDS, "LeaderWorkerSet")):
            for version in KUBE_VERSIONS:
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    pytest.fail(f"kubernetes.md:{line}: {obj['kind']} {obj['metadata']['name']} on {version}: {exc}")


def test_one_planner_patches_the_pools_even_during_its_rollout(files: Files) -> None:
    flags = ["--planner", "--planner-ttft", "200", "--planner-itl", "20", "--planner-profile", str(files.profile)]
    planner = deployment(render([*flags, "--engine", "mocker"])[0], "dyn-planner")
    assert planner["spec"]["strategy"] == {"type": "Recreate"}  # never two planners at once


def test_gpu_pools_can_be_scheduled_onto_tainted_labelled_rdma_nodes() -> None:
    flags = ["--engine", "vllm", "--model", "/m", "--gpus-per-worker", "8", "--router", "remote", "--routers", "2"]
    flags += ["--node-selector", "nvidia.com/gpu.product=H200", "--toleration", "nvidia.com/gpu:NoSchedule"]
    flags += ["--toleration", "dedicated=inference:NoExecute", "--worker-resource", "rdma/ib=1", "--ipc-lock"]
    flags += ["--priority-class", "inference-high", "--image-pull-secret", "registry"]
    objects, _ = render(flags)
    worker = _pod(objects, "dyn-worker")
    assert worker["nodeSelector"] == {"nvidia.com/gpu.product": "H200"}
    assert worker["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoExecute"},
    ]
    container = worker["containers"][0]
    assert container["resources"]["limits"] == {"memory": "8Gi", "nvidia.com/gpu": "8", "rdma/ib": "1"}
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    for name in ("dyn-worker", "dyn-frontend", "dyn-router"):
        pod = _pod(objects, name)
        assert (pod["priorityClassName"], pod["imagePullSecrets"]) == ("inference-high", [{"name": "registry"}])
    router = _pod(objects, "dyn-router")  # only the workers go to the GPU nodes
    assert "nodeSelector" not in router and "tolerations" not in router
    spread = router["topologySpreadConstraints"][0]  # two routers: one a node where it can
    assert (spread["topologyKey"], spread["whenUnsatisfiable"]) == ("kubernetes.io/hostname", "ScheduleAnyway")
    with pytest.raises(ConfigError, match="--toleration 'gpu:Sometimes' must be KEY"):
        render([*flags, "--toleration", "gpu:Sometimes"])


def test_out_writes_a_kustomization_an_overlay_can_patch(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from dynamo_cli.cli import k8s

    out = tmp_path / "manifests"
    result = CliRunner().invoke(k8s.app, ["render", "--out", str(out)])
    assert result.exit_code == 0, result.output
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    listed = sorted(kustomization["resources"])
    assert listed == sorted(p.name for p in out.glob("*.yaml") if p.name != "kustomization.yaml")
    assert f"kubectl apply -k {out}" in result.stderr


def test_several_frontend_pods_share_one_routing_view_and_the_planner_reads_each(files: Files) -> None:
    flags = ["--frontend-replicas", "3", "--batch-db", "off", "--router", "kv", "--engine", "mocker"]
    flags += ["--planner", "--planner-ttft", "200", "--planner-itl", "20", "--planner-profile", str(files.profile)]
    objects, _ = render(flags)
    frontend = deployment(objects, "dyn-frontend")
    assert frontend["spec"]["replicas"] == 3
    assert frontend["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}  # drops no pod
    container = frontend["spec"]["template"]["spec"]["containers"][0]
    assert "--router-replica-sync" in container["args"]  # the pods' routers count each other's in-flight load
    assert _env(container)["DYN_HTTP_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    budget = next(o for o in objects if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "dyn-frontend")
    assert budget["spec"]["maxUnavailable"] == 1  # a drain leaves two of three up
    planner = _pod(objects, "dyn-planner")["containers"][0]["args"]
    assert "--frontend" not in planner  # each pod's /metrics, found in discovery, not a random pod behind the Service
    with pytest.raises(ConfigError, match="--frontend-replicas > 1 needs --batch-db postgresql"):
        render(["--frontend-replicas", "2"])


def test_bundled_planes_run_as_quorums_with_budgets_that_keep_one_and_probes_a_restart_can_clear() -> None:
    single, _ = render([])
    assert not [o for o in single if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "dyn-etcd"]
    objects, _ = render(["--planes-replicas", "3"])
    etcd = next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "dyn-etcd")
    assert (etcd["spec"]["replicas"], etcd["spec"]["podManagementPolicy"]) == (3, "Parallel")
    container = etcd["spec"]["template"]["spec"]["containers"][0]
    cluster = next(a for a in container["args"] if a.startswith("--initial-cluster="))
    assert cluster.count("=http://dyn-etcd-") == 3 and "dyn-etcd-2.dyn-etcd:2380" in cluster
    assert (container["livenessProbe"]["httpGet"]["path"], container["readinessProbe"]["httpGet"]["path"]) == (
        "/livez",
        "/readyz",
    )
    nats = next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "dyn-nats")
    args = nats["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--routes") + 1].count("nats://dyn-nats-") == 3
    for name in ("dyn-etcd", "dyn-nats"):
        budget = next(o for o in objects if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == name)
        assert budget["spec"]["minAvailable"] == 2  # a drain takes one member, never the quorum
    worker = _pod(objects, "dyn-worker")["containers"][0]["args"]
    discovery = worker[worker.index("--discovery") + 1]
    assert discovery == "etcd://dyn-etcd-0.dyn-etcd:2379,dyn-etcd-1.dyn-etcd:2379,dyn-etcd-2.dyn-etcd:2379"
    with pytest.raises(ConfigError, match="--planes-replicas must be 1, 3 or 5"):
        render(["--planes-replicas", "2"])


def test_a_viewer_role_grants_what_dyn_k8s_status_reads_and_nothing_more() -> None:
    from dynamo_cli.k8s.cluster import PERMISSIONS

    objects, _ = render([])
    (viewer,) = [o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "dyn-viewer"]
    granted = {
        (group, resource, verb)
        for r in viewer["rules"]
        for group in r["apiGroups"]
        for resource in r["resources"]
        for verb in r["verbs"]
    }
    assert granted == {
        ("apps", "deployments", "list"),
        ("apps", "statefulsets", "list"),
        ("", "pods", "list"),
        ("", "events", "list"),
        ("", "pods/log", "get"),
        ("", "services/proxy", "get"),
    }
    for resource in ("deployments", "statefulsets", "pods", "pods/log", "services/proxy", "events"):
        assert resource in PERMISSIONS  # what status says it needs is what the Role grants
    assert not [o for o in objects if o["kind"] == "RoleBinding" and o["metadata"]["name"] == "dyn-viewer"]


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("extra", [[], ["--router", "remote", "--disagg"]])
def test_a_pod_monitor_scrapes_every_pod_on_the_port_its_annotations_name(extra: list[str], files: Files) -> None:
    objects, _ = render(["--pod-monitor", *extra])
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    for workload in (o for o in objects if o["kind"] == "Deployment"):
        template = workload["spec"]["template"]
        assert _labels_match(selector, template["metadata"]["labels"]), workload["metadata"]["name"]
        (container,) = template["spec"]["containers"]
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        scraped = [named[p] for p in ports if p in named]
        assert scraped == [int(template["metadata"]["annotations"]["prometheus.io/port"])], workload["metadata"]["name"]
    keyed, _ = render(["--pod-monitor", "--api-key-file", str(files.api_keys), "--metrics-require-key"])
    (monitor,) = [o for o in keyed if o["kind"] == "PodMonitor"]
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["system"]  # /metrics behind a key: not


def test_an_http_route_sends_a_gateways_traffic_to_the_frontend_with_no_timeout() -> None:
    objects, _ = render(["--gateway", "infra/public", "--hostname", "llm.example.com", "--port", "8080"])
    (route,) = [o for o in objects if o["kind"] == "HTTPRoute"]
    assert route["spec"]["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "public", "namespace": "infra"}
    ]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    (rule,) = route["spec"]["rules"]
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "dyn-frontend")
    assert rule["backendRefs"] == [{"name": "dyn-frontend", "port": 8080}]
    assert service["spec"]["ports"][0]["port"] == 8080
    assert rule["timeouts"] == {"request": "0s"}  # a stream is not cut at the gateway's default
    with pytest.raises(ConfigError, match="--hostname needs --gateway"):
        render(["--hostname", "llm.example.com"])
