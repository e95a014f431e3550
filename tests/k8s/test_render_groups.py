"""`dyn k8s render --nodes-per-worker N` (issue 50, item 4): every worker pool a LeaderWorkerSet of groups of N pods
running one engine. Each rendered LeaderWorkerSet validates against the LWS v1 API's schema (tests/k8s/lws_schema.py),
closed to undeclared fields as kubectl's strict field validation is; its pod templates validate against four
Kubernetes versions; the leader and follower command lines parse back into the group they describe
and, run here, form it, serve, and die together."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import time
from importlib.metadata import EntryPoint
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from typer.testing import CliRunner

from dynamo_cli.cli import k8s, plan
from dynamo_cli.cli import worker as worker_cmd
from dynamo_cli.config.group import GroupConfig
from dynamo_cli.errors import ConfigError
from tests.k8s.lws_schema import LWS_API, LWS_SCHEMA
from tests.k8s.render_cases import CLUSTER_SECRET, CRD_KINDS, KUBE_VERSIONS, Files, by_kind, make_files, render
from tests.k8s.test_render_commands import _as_here, _parse, _start
from tests.k8s.test_render_gpu_cluster import _guide_renders
from tests.planes import free_port

kubernetes_validate = pytest.importorskip("kubernetes_validate")
kubernetes = pytest.importorskip("kubernetes")

KEDA = ["--keda-prometheus", "http://prometheus.monitoring:9090", "--keda-requests-per-worker", "4"]
GPU_GROUPS = [
    *["--nodes-per-worker", "4", "--disagg", "--prefill-workers", "2", "--decode-workers", "1", "--engine", "mocker"],
    *["--gpus-per-worker", "8", "--node-selector", "nvidia.com/gpu.product=H200", "--toleration", "nvidia.com/gpu"],
    *["--worker-resource", "rdma/ib=1", "--ipc-lock", "--scheduler-name", "volcano", "--priority-class", "high"],
    *["--env", "NCCL_DEBUG=WARN", "--kv-disk-cache-gb", "20"],
]
LEADER_HOST = "dyn-worker-0.dyn-worker.dyn"
"""What LWS sets LWS_LEADER_ADDRESS to in group 0 of `dyn-worker` in namespace `dyn`."""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return make_files(tmp_path_factory.mktemp("groups-render-files"))


def _shapes(files: Files) -> dict[str, list[str]]:
    planner = ["--planner", "--planner-ttft", "200", "--planner-itl", "20", "--planner-profile", str(files.profile)]
    return {
        "agg": ["--nodes-per-worker", "2", "--workers", "3", "--engine", "mocker"],
        "gpu-disagg": GPU_GROUPS,
        "planner": ["--nodes-per-worker", "2", "--engine", "mocker", *planner],
        "keda-monitor": ["--nodes-per-worker", "3", "--engine", "mocker", "--pod-monitor", *KEDA],
    }


@pytest.fixture(scope="module")
def rendered(files: Files) -> dict[str, list[dict[str, Any]]]:
    return {name: render(args)[0] for name, args in _shapes(files).items()}


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    jsonschema.Draft7Validator.check_schema(LWS_SCHEMA)
    return jsonschema.Draft7Validator(LWS_SCHEMA)


def _errors(validator: jsonschema.protocols.Validator, obj: dict[str, Any]) -> list[str]:
    found = sorted(validator.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in found]


def _sets(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in by_kind(objects, "LeaderWorkerSet")}


def _templates(lws: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    template = lws["spec"]["leaderWorkerTemplate"]
    return template["leaderTemplate"], template["workerTemplate"]


def _container(template: dict[str, Any]) -> dict[str, Any]:
    (container,) = template["spec"]["containers"]
    return dict(container)


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """`args` as the kubelet runs them: `$(VAR)` replaced by the container's variable VAR."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg) for arg in args]


##### The shape, validated #####


def test_every_rendered_leader_worker_set_validates_strictly_against_the_lws_crd(
    rendered: dict[str, list[dict[str, Any]]], validator: jsonschema.protocols.Validator
) -> None:
    for case, objects in rendered.items():
        sets = by_kind(objects, "LeaderWorkerSet")
        assert sets and not [o for o in by_kind(objects, "Deployment") if "worker" in o["metadata"]["name"]], case
        for lws in sets:
            assert lws["apiVersion"] == LWS_API
            assert _errors(validator, lws) == [], f"{case}: {lws['metadata']['name']}"


def test_an_object_the_crd_refuses_is_caught_naming_the_field(
    rendered: dict[str, list[dict[str, Any]]], validator: jsonschema.protocols.Validator
) -> None:
    lws = copy.deepcopy(_sets(rendered["agg"])["dyn-worker"])
    template = lws["spec"]["leaderWorkerTemplate"]
    template["restartPolicy"] = "Always"
    template["size"] = "2"
    template["sizee"] = 2  # a typo the API server would drop
    lws["spec"]["startupPolicy"] = "LeaderFirst"
    errors = _errors(validator, lws)
    assert [e.split(": ")[0] for e in errors] == [
        "spec.leaderWorkerTemplate",
        "spec.leaderWorkerTemplate.restartPolicy",
        "spec.leaderWorkerTemplate.size",
        "spec.startupPolicy",
    ]
    assert "'sizee' was unexpected" in errors[0]
    assert "'Always' is not one of ['Default', 'RecreateGroupOnPodRestart', 'None']" in errors[1]


def test_the_guides_group_renders_validate_against_the_crd(
    files: Files, validator: jsonschema.protocols.Validator
) -> None:
    shown = [(line, args) for line, args in _guide_renders(files) if "--nodes-per-worker" in args]
    assert shown
    for line, args in shown:
        objects = render(args)[0]
        assert by_kind(objects, "LeaderWorkerSet"), line
        for lws in by_kind(objects, "LeaderWorkerSet"):
            assert _errors(validator, lws) == [], f"kubernetes.md:{line}"
        _check_against_kubernetes(f"kubernetes.md:{line}", objects)


def test_the_other_objects_and_both_pod_templates_validate_against_four_kubernetes_versions(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for case, objects in rendered.items():
        _check_against_kubernetes(case, objects)


def _check_against_kubernetes(case: str, objects: list[dict[str, Any]]) -> None:
    """Every object but the CRDs' (strictly, on each of KUBE_VERSIONS), and each LeaderWorkerSet's pod templates
    as PodTemplates (and through the client's model)."""
    client = kubernetes.client.ApiClient()
    checked = [o for o in objects if o["kind"] not in (*CRD_KINDS, "LeaderWorkerSet")]
    for lws in by_kind(objects, "LeaderWorkerSet"):
        for template in _templates(lws):
            meta = {"name": lws["metadata"]["name"], "namespace": lws["metadata"]["namespace"]}
            checked.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": meta, "template": template})
            typed = client._ApiClient__deserialize(template, "V1PodTemplateSpec")
            assert client.sanitize_for_serialization(typed) == template, f"{case}: changes in the model"
    for obj, version in ((o, v) for o in checked for v in KUBE_VERSIONS):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{case}: {obj['kind']} {obj['metadata']['name']} is invalid on {version}: {exc}")


def test_each_pool_is_its_count_of_groups_restarted_and_rolled_as_units(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    def shape(case: str) -> dict[str, tuple[Any, ...]]:
        found = {}
        for name, lws in _sets(rendered[case]).items():
            spec = lws["spec"]
            rolling = spec["rolloutStrategy"]["rollingUpdateConfiguration"]
            found[name] = (spec.get("replicas"), spec["leaderWorkerTemplate"]["size"], rolling["maxSurge"])
            assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
            assert spec["startupPolicy"] == "LeaderCreated"  # the leader is ready only once its followers joined
            assert rolling["maxUnavailable"] == 1 - rolling["maxSurge"]
        return found

    assert shape("agg") == {"dyn-worker": (3, 2, 1)}  # CPU: a new group surges in before an old one goes
    (frontend,) = [o for o in by_kind(rendered["agg"], "Deployment") if o["metadata"]["name"] == "dyn-frontend"]
    assert "--nodes-per-worker" not in frontend["spec"]["template"]["spec"]["containers"][0]["args"]  # no worker
    assert shape("gpu-disagg") == {"dyn-decode": (1, 4, 0), "dyn-prefill": (2, 4, 0)}  # GPUs: no extra group
    assert shape("planner") == {"dyn-worker": (None, 2, 1)}  # the planner's count: a re-apply must not reset it
    assert shape("keda-monitor") == {"dyn-worker": (None, 3, 1)}


def test_probes_ports_and_metrics_are_the_leaders_only(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for case in rendered:
        for lws in by_kind(rendered[case], "LeaderWorkerSet"):
            leader, follower = _templates(lws)
            led, followed = _container(leader), _container(follower)
            named = {p["name"] for p in led["ports"]}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert led[probe]["httpGet"]["port"] == "system" in named, case
                assert probe not in followed, case
            assert {"request", "system"} <= named and "ports" not in followed
            assert leader["metadata"]["annotations"]["prometheus.io/port"] == "9090"
            assert "annotations" not in follower["metadata"]  # a kubernetes-pods scrape job skips it
            assert "--system-port" in led["args"] and "--system-port" not in followed["args"]


def test_both_templates_get_the_same_resources_placement_environment_and_volumes(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for name, lws in _sets(rendered["gpu-disagg"]).items():
        leader, follower = (t["spec"] for t in _templates(lws))
        same = ("nodeSelector", "tolerations", "schedulerName", "priorityClassName", "securityContext", "volumes")
        assert {k: leader[k] for k in same} == {k: follower[k] for k in same}, name
        assert leader["schedulerName"] == "volcano" and leader["tolerations"][0]["key"] == "nvidia.com/gpu"
        led, followed = _container({"spec": leader}), _container({"spec": follower})
        for key in ("image", "resources", "env", "securityContext", "volumeMounts"):
            assert led[key] == followed[key], (name, key)
        assert led["resources"]["limits"] | {"memory": None} == {"memory": None, "nvidia.com/gpu": "8", "rdma/ib": "1"}
        assert led["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert {v["name"] for v in leader["volumes"]} == {"tmp", "shm", "kv-disk"}
        # a follower's SIGTERM waits out the leader's drain (60 s), within the same grace period
        assert leader["terminationGracePeriodSeconds"] == follower["terminationGracePeriodSeconds"] == 75
        assert led["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
        assert followed["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "65"]


def test_every_variable_the_args_expand_is_one_lws_puts_in_each_container(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for case in rendered:
        for lws in by_kind(rendered[case], "LeaderWorkerSet"):
            for template in _templates(lws):
                args = " ".join(_container(template)["args"])
                assert set(re.findall(r"\$\(([^)]*)\)", args)) <= {"LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX"}, case


##### The command lines #####


def test_the_leader_and_follower_command_lines_parse_back_into_one_group(
    files: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("DYN_WORKER_HOST", "DYN_CLUSTER_SECRET"):
        monkeypatch.delenv(variable, raising=False)
    flags = ["--workers", "2", "--engine", "mocker", "--speedup-ratio", "20", "--kv-host-cache-gb", "1"]
    (single,) = [o for o in render(flags)[0] if o["metadata"]["name"] == "dyn-worker" and o["kind"] == "Deployment"]
    lws = _sets(render([*flags, "--nodes-per-worker", "3"])[0])["dyn-worker"]
    (leader_args, follower_args) = (_container(t)["args"] for t in _templates(lws))

    def config(args: list[str], index: str) -> Any:
        expanded = _expand(args, {"LWS_LEADER_ADDRESS": LEADER_HOST, "LWS_WORKER_INDEX": index})
        assert expanded[0] == "worker"
        return worker_cmd._from_flags(_parse(worker_cmd.command, expanded[1:]))

    alone = config(single["spec"]["template"]["spec"]["containers"][0]["args"], "0")
    group = GroupConfig(nnodes=3, node_rank=0, leader_addr=f"{LEADER_HOST}:9000", join_timeout_s=7200.0)
    leader = config(leader_args, "0")
    assert leader.group == group and leader.port == 9000  # it listens where its followers join
    assert leader == type(alone)(**{**_fields(alone), "group": group})  # the group flags add the group, only
    for index in ("1", "2"):
        follower = config(follower_args, index)
        assert follower.group == GroupConfig(**{**_fields(group), "node_rank": int(index)})
        assert follower.telemetry.system_port is None  # the leader's probes and metrics are the group's
        assert _fields(follower) | {"group": None, "telemetry": None} == _fields(leader) | {
            "group": None,
            "telemetry": None,
        }


def _fields(config: Any) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def test_a_group_of_an_engine_over_gpus_spans_every_gpu_of_its_pods(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that spans nodes (vLLM registered as one here, whatever is installed) gets its tensor parallelism
    over the group's GPUs, pods x GPUs per pod, as a one-pod worker gets it over its pod's."""
    spanning = [EntryPoint(name=name, value="x:y", group="dyn.headless") for name in ("mocker", "vllm")]
    monkeypatch.setattr("dynamo_cli.cli.k8s_groups.entry_points", lambda group: spanning)
    gpus = ["--engine", "vllm", "--model", "/models/m", "--model-pvc", "weights", "--gpus-per-worker", "8"]
    lws = _sets(render([*gpus, "--nodes-per-worker", "2"])[0])["dyn-worker"]
    for template in _templates(lws):
        args = _container(template)["args"]
        engine = json.loads(args[args.index("--extra-engine-args") + 1])
        assert engine == {"tensor_parallel_size": 16}


def test_the_planner_scales_the_leader_worker_sets_replicas_in_groups(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["planner"]
    (planner,) = [o for o in by_kind(objects, "Deployment") if o["metadata"]["name"] == "dyn-planner"]
    args = planner["spec"]["template"]["spec"]["containers"][0]["args"]
    values = _parse(plan.run_command, args[2:])
    kubernetes_config = plan.plan_run(values).kubernetes
    assert kubernetes_config is not None
    assert (kubernetes_config.kind, kubernetes_config.decode_deployment) == ("LeaderWorkerSet", "dyn-worker")
    (role,) = by_kind(objects, "Role")[:1]
    assert role["metadata"]["name"] == "dyn-planner"
    assert role["rules"] == [
        {
            "apiGroups": ["leaderworkerset.x-k8s.io"],
            "resources": ["leaderworkersets/scale"],
            "resourceNames": ["dyn-worker"],
            "verbs": ["get", "patch"],
        },
        {
            "apiGroups": ["leaderworkerset.x-k8s.io"],
            "resources": ["leaderworkersets"],
            "resourceNames": ["dyn-worker"],
            "verbs": ["get"],
        },
    ]


def test_keda_scales_the_leader_worker_set_on_its_leaders_load(rendered: dict[str, list[dict[str, Any]]]) -> None:
    (scaled,) = by_kind(rendered["keda-monitor"], "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "name": "dyn-worker"}
    (trigger,) = scaled["spec"]["triggers"]
    patterns = set(re.findall(r'pod=~"([^"]+)"', trigger["metadata"]["query"]))
    (pattern,) = patterns  # PromQL's =~ is anchored: fullmatch
    assert [bool(re.fullmatch(pattern, pod)) for pod in ("dyn-worker-0", "dyn-worker-12")] == [True, True]
    assert not any(re.fullmatch(pattern, pod) for pod in ("dyn-worker-0-1", "dyn-worker-0-2", "dyn-prefill-0"))


def test_the_pod_monitor_selects_every_pod_but_the_groups_followers(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    (monitor,) = by_kind(rendered["keda-monitor"], "PodMonitor")
    selector = monitor["spec"]["selector"]
    index = "leaderworkerset.sigs.k8s.io/worker-index"
    assert selector["matchExpressions"] == [{"key": index, "operator": "NotIn", "values": ["1", "2"]}]

    def selected(labels: dict[str, str]) -> bool:  # NotIn also selects a pod without the label
        (expression,) = selector["matchExpressions"]
        return selector["matchLabels"].items() <= labels.items() and labels.get(index) not in expression["values"]

    lws = _sets(rendered["keda-monitor"])["dyn-worker"]
    leader, follower = (t["metadata"]["labels"] for t in _templates(lws))
    frontend = next(o for o in by_kind(rendered["keda-monitor"], "Deployment") if "frontend" in o["metadata"]["name"])
    assert selected({**leader, index: "0"}) and selected(frontend["spec"]["template"]["metadata"]["labels"])
    assert not selected({**follower, index: "1"}) and not selected({**follower, index: "2"})


##### Refused #####


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["--nodes-per-worker", "2", "--engine", "llamacpp"],
            "--nodes-per-worker 2: --engine llamacpp runs on one node",
            id="an engine with no headless part",
        ),
        pytest.param(["--nodes-per-worker", "0"], "--nodes-per-worker must be between 1 and 64", id="no node"),
        pytest.param(
            ["--scheduler-name", "Volcano_1"], "--scheduler-name 'Volcano_1' is not a Kubernetes name", id="bad name"
        ),
    ],
)
def test_what_cannot_work_is_refused_naming_the_flag(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        render(args)


def test_the_groups_wait_for_their_pods_as_long_as_a_worker_may_take_to_start() -> None:
    """A pod of a group may wait for a node (GPUs) as long as `--startup-timeout` allows a model load: the leader
    waits that long for its followers, and they for it (render has no --group-join-timeout of its own)."""
    lws = _sets(render(["--nodes-per-worker", "2", "--engine", "mocker", "--startup-timeout", "900"])[0])["dyn-worker"]
    for template in _templates(lws):
        args = _container(template)["args"]
        assert args[args.index("--group-join-timeout") + 1] == "900.0"
    help_text = CliRunner().invoke(k8s.app, ["render", "--help"], terminal_width=200).output
    assert "--nodes-per-worker" in help_text and "--group-join-timeout" not in help_text


def test_the_real_binary_prints_one_red_line_for_a_group_of_a_one_node_engine() -> None:
    proc = subprocess.run(
        ["dyn", "k8s", "render", "--nodes-per-worker", "2", "--engine", "llamacpp"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and proc.stdout == ""
    assert len(lines) == 1 and lines[0].startswith("error: --nodes-per-worker 2: --engine llamacpp"), proc.stderr


##### The rendered command lines, run here #####


def test_the_rendered_group_forms_serves_here_and_dies_with_its_follower(etcd_server: str, nats_server: str) -> None:
    objects = render(["--nodes-per-worker", "2", "--engine", "mocker", "--speedup-ratio", "50"])[0]
    leader_args, follower_args = (_container(t)["args"] for t in _templates(_sets(objects)["dyn-worker"]))
    frontend = next(o for o in by_kind(objects, "Deployment") if o["metadata"]["name"] == "dyn-frontend")
    env = {**os.environ, "DYN_CLUSTER_SECRET": CLUSTER_SECRET, "DYN_WORKER_HOST": "127.0.0.1"}
    http, request, system = free_port(), free_port(), free_port()
    leader_at = {"--port": request, "--system-port": system, "--leader-addr": f"127.0.0.1:{request}"}
    commands = {
        "frontend": _as_here(
            frontend["spec"]["template"]["spec"]["containers"][0]["args"], etcd_server, nats_server, {"--port": http}
        ),
        "leader": _as_here(_expand(leader_args, {"LWS_WORKER_INDEX": "0"}), etcd_server, nats_server, leader_at),
        "follower": _as_here(
            _expand(follower_args, {"LWS_WORKER_INDEX": "1"}), etcd_server, nats_server, {**leader_at, "--port": 0}
        ),
    }
    lines: dict[str, list[str]] = {part: [] for part in commands}
    procs = {part: _start(args, env, lines[part]) for part, args in commands.items()}
    try:
        _wait_healthy(f"http://127.0.0.1:{http}", lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", timeout=30)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].message.content
        health = httpx.get(f"http://127.0.0.1:{system}/health", timeout=5).json()
        assert health["group"] == {"nnodes": 2, "node_rank": 0, "joined": [1]}, health
        procs["follower"].send_signal(signal.SIGKILL)  # its node lost: the leader ends at once (LWS recreates both)
        assert procs["leader"].wait(15) != 0, lines["leader"][-5:]
        assert any("node 1 of the group left" in line for line in lines["leader"]), lines["leader"][-5:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(url: str, lines: dict[str, list[str]]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail("the frontend never became healthy:\n" + "\n".join(f"{p}: {lines[p][-5:]}" for p in lines))
