"""`dyn k8s render`: every shape validates against two Kubernetes versions' schemas (strict) and round-trips through
the official client's models; invariants hold on every object; nothing secret is written; bad input is one line."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_cli.errors import ConfigError
from tests.k8s.render_cases import (
    KUBE_VERSIONS,
    Files,
    by_kind,
    cases,
    containers,
    deployment,
    dump,
    make_files,
    pod_specs,
    render,
)

kubernetes_validate = pytest.importorskip("kubernetes_validate")
kubernetes = pytest.importorskip("kubernetes")

CASES = list(cases(make_files(Path("/tmp/unused-render-files"))))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return make_files(tmp_path_factory.mktemp("render-files"))


@pytest.fixture(scope="module")
def rendered(files: Files) -> dict[str, list[dict[str, Any]]]:
    return {name: render(args)[0] for name, args in cases(files).items()}


def test_there_are_at_least_twelve_shapes() -> None:
    assert len(CASES) >= 12


@pytest.mark.parametrize("case", CASES)
def test_every_object_validates_strictly_against_two_kubernetes_versions(
    case: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    for obj in rendered[case]:
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{case}: {obj['kind']} {obj['metadata']['name']} is invalid on {version}: {exc}")


@pytest.mark.parametrize("case", CASES)
def test_every_object_round_trips_through_the_client_models(
    case: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    client = kubernetes.client.ApiClient()
    for obj in rendered[case]:
        group, _, version = obj["apiVersion"].rpartition("/")
        model = f"V1{obj['kind']}"
        typed = client._ApiClient__deserialize(obj, model)  # the client's own decoder, as for an API response
        assert type(typed).__name__ == model
        assert client.sanitize_for_serialization(typed) == obj, f"{case}: {obj['kind']} changes in the model"


@pytest.mark.parametrize("case", CASES)
def test_services_disruption_budgets_and_policies_select_rendered_pods(
    case: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    objects = rendered[case]
    pods = [o["spec"]["template"]["metadata"]["labels"] for o in objects if "template" in o.get("spec", {})]
    for controller in (o for o in objects if "template" in o.get("spec", {})):
        labels = controller["spec"]["template"]["metadata"]["labels"]
        assert controller["spec"]["selector"]["matchLabels"].items() <= labels.items()
    selectors = [o["spec"]["selector"] for o in by_kind(objects, "Service")]
    selectors += [o["spec"]["selector"]["matchLabels"] for o in by_kind(objects, "PodDisruptionBudget")]
    selectors += [o["spec"]["podSelector"]["matchLabels"] for o in by_kind(objects, "NetworkPolicy")]
    for selector in selectors:
        assert any(selector.items() <= labels.items() for labels in pods), f"{case}: {selector} selects no pod"
    for service in by_kind(objects, "Service"):
        selected = next(
            o
            for o in objects
            if "template" in o.get("spec", {})
            and service["spec"]["selector"].items() <= o["spec"]["template"]["metadata"]["labels"].items()
        )
        named_ports = {p["name"] for c in selected["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= named_ports


@pytest.mark.parametrize("case", CASES)
def test_every_container_has_probes_requests_and_a_pinned_image(
    case: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    for container in containers(rendered[case]):
        named = {p["name"] for p in container["ports"]}
        for probe in ("livenessProbe", "readinessProbe"):
            check = container[probe].get("httpGet") or container[probe]["tcpSocket"]
            assert check["port"] in named, f"{case}: {container['name']} probes a port it does not declare"
        assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
        name, _, tag = container["image"].rpartition(":")
        assert name and tag and tag != "latest" and "/" not in tag, container["image"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
    for spec in pod_specs(rendered[case]):
        assert spec["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("case", CASES)
def test_no_secret_value_is_written_and_no_secret_object_either(
    case: str, files: Files, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    text = dump(rendered[case])
    for value in files.secret_texts():
        assert value not in text
    assert not by_kind(rendered[case], "Secret")


@pytest.mark.parametrize("case", CASES)
def test_only_the_frontend_http_port_is_open_beyond_the_namespace(
    case: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    frontend_ports = [
        {"protocol": "TCP", "port": p["containerPort"]}
        for c in containers(rendered[case])
        for p in c["ports"]
        if p["name"] in ("http", "grpc")
    ]
    for policy in by_kind(rendered[case], "NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            sources = rule.get("from")
            if sources is None:  # from anywhere
                assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "frontend"
                assert rule["ports"] == frontend_ports
            else:
                assert all("podSelector" in s or "namespaceSelector" in s for s in sources)
                assert all("ipBlock" not in s for s in sources)


def test_the_planners_role_grants_exactly_scale_get_patch_and_deployment_get(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for case in ("planner-agg", "planner-disagg"):
        objects = rendered[case]
        (role,) = [r for r in by_kind(objects, "Role") if r["metadata"]["name"] == "dyn-planner"]  # (and dyn-viewer)
        pools = sorted(
            o["metadata"]["name"]
            for o in by_kind(objects, "Deployment")
            if o["metadata"]["labels"]["app.kubernetes.io/component"] in ("worker", "decode", "prefill")
        )
        grants = sorted(
            (rule["apiGroups"][0], res, verb, tuple(rule["resourceNames"]))
            for rule in role["rules"]
            for res in rule["resources"]
            for verb in rule["verbs"]
        )
        assert grants == sorted(
            [
                ("apps", "deployments/scale", "get", tuple(pools)),
                ("apps", "deployments/scale", "patch", tuple(pools)),
                ("apps", "deployments", "get", tuple(pools)),
            ]
        )
        (binding,) = by_kind(objects, "RoleBinding")
        planner = deployment(objects, "dyn-planner")["spec"]["template"]["spec"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": planner["serviceAccountName"], "namespace": "dyn"}
        ]
        assert planner["automountServiceAccountToken"] is True
        args = planner["containers"][0]["args"]
        assert args[args.index("--k8s-decode-deployment") + 1] in pools
        for pool in pools:  # the planner owns the count: a re-apply must not reset it
            assert "replicas" not in deployment(objects, pool)["spec"]
    for case in CASES:  # no other pod holds an API token, no other shape any RBAC
        tokens = [s for s in pod_specs(rendered[case]) if s.get("automountServiceAccountToken") is not False]
        assert len(tokens) == (1 if case.startswith("planner") else 0)
        roles = {r["metadata"]["name"].rsplit("-", 1)[1] for r in by_kind(rendered[case], "Role")}
        assert roles == ({"planner", "viewer"} if case.startswith("planner") else {"viewer"})  # the viewer: unbound


def test_the_shapes_have_the_components_and_counts_the_flags_ask_for(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    def replicas(case: str) -> dict[str, int | None]:
        return {o["metadata"]["name"]: o["spec"].get("replicas") for o in by_kind(rendered[case], "Deployment")}

    assert replicas("agg") == {"dyn-frontend": 1, "dyn-worker": 1}
    assert replicas("agg-kv-3") == {"dyn-frontend": 1, "dyn-worker": 3}
    frontends = deployment(rendered["agg-kv-3"], "dyn-frontend")["spec"]["template"]["spec"]["containers"][0]
    assert "--frontends" in frontends["args"] and frontends["resources"]["requests"]["cpu"] == "2"  # 2 in the pod
    assert replicas("disagg") == {"dyn-frontend": 1, "dyn-decode": 3, "dyn-prefill": 2}
    assert replicas("remote-2") == {"dyn-frontend": 1, "dyn-worker": 2, "dyn-router": 2}
    assert {o["metadata"]["name"] for o in by_kind(rendered["agg"], "StatefulSet")} == {"dyn-etcd", "dyn-nats"}
    assert not by_kind(rendered["external-planes"], "StatefulSet")
    assert {o["metadata"]["name"] for o in by_kind(rendered["external-etcd-bundled-nats"], "StatefulSet")} == {
        "dyn-nats"
    }
    gpu = deployment(rendered["gpu-vllm"], "dyn-worker")["spec"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["requests"]["nvidia.com/gpu"] == gpu["resources"]["limits"]["nvidia.com/gpu"] == "2"
    cpu = deployment(rendered["agg"], "dyn-worker")["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cpu["resources"]["requests"]


def test_pods_read_secrets_from_references_the_printed_kubectl_lines_create(files: Files) -> None:
    objects, stderr = render(cases(files)["tls-keys"])
    frontend = deployment(objects, "dyn-frontend")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in frontend["containers"][0]["env"]}
    assert env["DYN_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": "dyn-cluster-secret", "key": "secret"}
    volumes = {v["name"]: v for v in frontend["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "dyn-api-keys"
    assert volumes["tls"]["secret"]["secretName"] == "dyn-tls"
    args = frontend["containers"][0]["args"]
    assert args[args.index("--api-key-file") + 1] == "/etc/dyn/api-keys/keys"
    assert args[args.index("--tls-key-file") + 1] == "/etc/dyn/tls/tls.key"
    probe = frontend["containers"][0]["readinessProbe"]["httpGet"]
    assert probe["scheme"] == "HTTPS"
    assert f"--from-file=secret={files.cluster_secret}" in stderr
    assert f"--from-file=keys={files.api_keys}" in stderr
    assert f"--from-file=tls.key={files.key}" in stderr
    mtls = deployment(render(cases(files)["mtls"])[0], "dyn-frontend")["spec"]["template"]["spec"]["containers"][0]
    assert "tcpSocket" in mtls["readinessProbe"]  # the kubelet has no client certificate


def test_external_plane_files_move_into_a_secret_and_the_url_names_their_mounts(files: Files) -> None:
    objects, stderr = render(cases(files)["external-planes"])
    worker = deployment(objects, "dyn-worker")["spec"]["template"]["spec"]
    args = worker["containers"][0]["args"]
    discovery = args[args.index("--discovery") + 1]
    events = args[args.index("--events") + 1]
    assert discovery == "etcd://dyn@etcd.infra:2379?password-file=/etc/dyn/planes/etcd-password-file-etcd-password"
    assert events == "tls://nats.infra:4222?ca=/etc/dyn/planes/nats-ca-ca.pem"
    assert {"name": "planes", "secret": {"secretName": "dyn-planes", "defaultMode": 0o440}} in worker["volumes"]
    assert f"--from-file=etcd-password-file-etcd-password={files.password}" in stderr


def test_pods_get_their_own_address_from_the_downward_api(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["remote-2"]
    for name, variable in (("dyn-worker", "DYN_WORKER_HOST"), ("dyn-router", "DYN_ROUTER_HOST")):
        env = {e["name"]: e for e in deployment(objects, name)["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env[variable]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_a_values_file_renders_what_the_same_flags_render(files: Files, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(
        "disagg: true\nprefill-workers: 2\ndecode_workers: 3\nrouter: kv\nengine: mocker\nnamespace: prod\n"
        "gpus-per-worker: 1\nengine-arg: [num_gpu_blocks=4096]\n"
    )
    flags = [
        "--disagg",
        "--prefill-workers",
        "2",
        "--decode-workers",
        "3",
        "--router",
        "kv",
        "--engine",
        "mocker",
        "--namespace",
        "prod",
        "--gpus-per-worker",
        "1",
        "--engine-arg",
        "num_gpu_blocks=4096",
    ]
    assert render(["--values", str(values)])[0] == render(flags)[0]
    overridden = render(["--values", str(values), "--prefill-workers", "4"])[0]  # a flag beats the file
    assert deployment(overridden, "dyn-prefill")["spec"]["replicas"] == 4


def test_out_writes_one_file_per_component_and_the_secrets_script(files: Files, tmp_path: Path) -> None:
    out = tmp_path / "manifests"
    render([*cases(files)["planner-disagg"], "--out", str(out)])
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(
        [
            "decode.yaml",
            "deployment.yaml",
            "etcd.yaml",
            "frontend.yaml",
            "kustomization.yaml",
            "nats.yaml",
            "planner.yaml",
            "prefill.yaml",
            "secrets.sh",
        ]
    )
    kinds = [o["kind"] for o in yaml.safe_load_all((out / "planner.yaml").read_text())]
    assert sorted(kinds) == sorted(["ServiceAccount", "Role", "RoleBinding", "Deployment", "PodDisruptionBudget"])
    assert "kubectl -n dyn create secret generic dyn-cluster-secret" in (out / "secrets.sh").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--api-key", "sk-1"], "--api-key would write a key into the manifests"),
        (["--image", "dyn:latest"], "must carry a pinned tag"),
        (["--image", "registry.local:5000/dyn"], "must carry a pinned tag"),
        (["--etcd", "etcd://root:hunter2@etcd:2379"], "holds a password or token"),
        (["--nats", "nats://s3cr3t-token@nats:4222"], "holds a password or token"),
        (["--service-type", "Ingress"], "--service-type 'Ingress' is invalid"),
        (["--planner", "--planner-ttft", "100", "--planner-itl", "10", "--engine", "mocker"], "--planner-profile"),
        (["--gpus-per-worker", "-1"], "--gpus-per-worker must be >= 0"),
        (["--name", "Chat_1"], "--name 'Chat_1' is not a Kubernetes name"),
        (["--namespace", "9inference"], "--namespace '9inference' is not a Kubernetes name"),
        # flags that act only with another, or that a cluster could not run as rendered: refused, not dropped
        (["--prefill-workers", "2"], "--prefill-workers needs --disagg"),
        (["--prefill-gpus-per-worker", "1"], "--prefill-gpus-per-worker needs --disagg"),
        (["--planner-ttft", "200"], "--planner-ttft needs --planner"),
        (["--port", "0"], "--port 0"),
        (["--kv-host-cache-gb", "16", "--worker-memory", "8Gi"], "does not fit in the worker's memory limit"),
        (["--engine", "vllm", "--model", "/models/m"], "--engine vllm runs on GPUs"),
        (["--lora", "sql=/home/me/adapters/sql", "--engine", "mocker"], "a pod sees only its mounts"),
        (["--env", "DYN_ROUTER_MODE=kv"], "DYN_* variables are dyn's settings"),
        (["--env", "no-equals"], "must be NAME=VALUE"),
        (["--planner", "--workers", "3", "--engine", "mocker"], "with --planner: the planner sizes the pools"),
        (["--planner", "--disagg", "--decode-workers", "2"], "--planner-min-workers 2"),
    ],
)
def test_bad_input_is_a_config_error_naming_it(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        render(args)


def test_the_real_binary_prints_one_red_line_for_bad_flags_and_values(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("prefil-workers: 2\n")
    for args, message in (
        (["--image", "dyn:latest"], "pinned tag"),
        (["--values", str(values)], "did you mean 'prefill-workers'"),
        (["--api-key", "sk-x"], "--api-key-file"),
    ):
        proc = subprocess.run(["dyn", "k8s", "render", *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0
        assert proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr


def test_dyn_variables_in_the_shell_do_not_change_a_render(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = render([])[0]
    for variable, value in (("DYN_ROUTER_MODE", "kv"), ("DYN_WORKERS", "5"), ("DYN_DISAGG", "1")):
        monkeypatch.setenv(variable, value)
    assert render([])[0] == plain
