"""Kubernetes objects as plain dicts, one builder per kind: what a rendered deployment is made of.

Every pod runs as UID 10001 with no privilege, no capability and a read-only root filesystem (`/tmp` is an
emptyDir), and gets no service-account token unless it calls the API server (the planner). Only the planner's
Role grants anything: `get`/`patch` on its worker Deployments' (or LeaderWorkerSets') `scale` subresource and `get`
on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dynamo_cli.k8s.names import CLUSTER_SECRET_KEY, DEPLOYMENT, LWS_WORKER_INDEX_LABEL, PORTS, Names, Part, Workload

Obj = dict[str, Any]
UID = 10001
"""The image's user (Containerfile `USER 10001`)."""


@dataclass(frozen=True, slots=True)
class Resources:
    """A container's requests (memory is also its limit: an inference process over it is killed, not throttled)."""

    cpu: str
    memory: str
    gpus: int = 0
    """`nvidia.com/gpu`, requested and limited (an extended resource must be both)."""
    extra: tuple[tuple[str, str], ...] = ()
    """Other extended resources (`rdma/ib`, `amd.com/gpu`, a MIG profile), requested and limited."""
    ephemeral_storage: str | None = None
    """Node disk the pod's emptyDirs may fill (the disk KV tier): requested, so the scheduler places it where that
    much is free, and the kubelet does not evict it for using what it asked for."""

    def spec(self) -> Obj:
        requests: Obj = {"cpu": self.cpu, "memory": self.memory}
        limits: Obj = {"memory": self.memory}
        if self.gpus:
            requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(self.gpus)
        for name, quantity in self.extra:
            requests[name] = limits[name] = quantity
        if self.ephemeral_storage is not None:
            requests["ephemeral-storage"] = self.ephemeral_storage
        return {"requests": requests, "limits": limits}


@dataclass(frozen=True, slots=True)
class Mount:
    """A volume and where a container sees it: one of a Secret, a ConfigMap, a claim, or an emptyDir."""

    name: str
    path: str
    secret: str | None = None
    config_map: str | None = None
    claim: str | None = None
    """A PersistentVolumeClaim: one of yours, mounted read-only (model weights), or a `writable` one."""
    writable: bool = False
    """The claim is mounted read-write and rendered with the deployment (ReadWriteOnce, of `size`): the
    frontend's batch database. Its Deployment recreates its pod instead of surging a second one."""
    shared: bool = False
    """A claim of yours mounted read-write by every pod that names it (ReadWriteMany: the model cache the workers
    download into); not rendered."""
    size: str | None = None
    """An emptyDir's sizeLimit, or the storage a writable claim requests."""
    memory: bool = False
    """An emptyDir in RAM (`/dev/shm` for GPU engines)."""

    def volume(self) -> Obj:
        if self.secret is not None:
            return {"name": self.name, "secret": {"secretName": self.secret, "defaultMode": 0o440}}
        if self.config_map is not None:
            return {"name": self.name, "configMap": {"name": self.config_map}}
        if self.claim is not None:
            read_only: Obj = {} if self.writable or self.shared else {"readOnly": True}
            return {"name": self.name, "persistentVolumeClaim": {"claimName": self.claim} | read_only}
        empty: Obj = {"medium": "Memory"} if self.memory else {}
        return {"name": self.name, "emptyDir": empty | ({"sizeLimit": self.size} if self.size else {})}

    def mount(self) -> Obj:
        read_only = self.secret is not None or self.config_map is not None or self.claim is not None
        read_only = read_only and not self.writable and not self.shared
        return {"name": self.name, "mountPath": self.path} | ({"readOnly": True} if read_only else {})


@dataclass(frozen=True, slots=True)
class Toleration:
    """A taint the pod tolerates: `key` with `value` (None: any value, operator Exists) and `effect` (None: all)."""

    key: str
    value: str | None = None
    effect: str | None = None

    def spec(self) -> Obj:
        found: Obj = {"key": self.key, "operator": "Exists" if self.value is None else "Equal"}
        found |= {"value": self.value} if self.value is not None else {}
        return found | ({"effect": self.effect} if self.effect is not None else {})


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a pod may run and what of the node it may use (GPU pools: taints, labels, RDMA)."""

    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Toleration, ...] = ()
    priority_class: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    ipc_lock: bool = False
    """CAP_IPC_LOCK, which RDMA (NIXL over UCX verbs) needs to pin memory; outside the restricted Pod Security
    Standard, so only on request."""
    scheduler_name: str | None = None
    """The scheduler that places the pods (`volcano`, `kai-scheduler`: gang scheduling of a multi-node group);
    None: the cluster's default."""


@dataclass(frozen=True, slots=True)
class SecretEnv:
    """An environment variable read from a Secret's key (secretKeyRef): the value never in the manifest."""

    name: str
    secret: str
    key: str


TMP = Mount("tmp", "/tmp", size="1Gi")
"""HOME and scratch: small on purpose (a model is never downloaded here: render refuses a hub model with no model
cache, `--model-cache-pvc`, or model claim, `--model-pvc`)."""
STARTUP_PERIOD_S = 10
PRE_STOP_S = 5
"""The preStop sleep: the endpoints controller takes a terminating pod out of its Services meanwhile, so no new
request reaches a process that is draining."""


@dataclass(frozen=True, slots=True)
class Probe:
    """Where the kubelet asks: liveness at `live`, readiness at `ready`, on the named port."""

    port: str
    live: str = "/live"
    ready: str = "/health"
    scheme: str = "HTTP"
    tcp: bool = False
    """A TCP connect instead of a GET: the kubelet cannot present the client certificate mutual TLS asks for."""

    def spec(self, path: str, period_s: int, failures: int) -> Obj:
        how: Obj = {"tcpSocket": {"port": self.port}}
        if not self.tcp:
            how = {"httpGet": {"path": path, "port": self.port, "scheme": self.scheme}}
        return how | {"periodSeconds": period_s, "timeoutSeconds": 5, "failureThreshold": failures}


@dataclass(frozen=True, slots=True)
class Group:
    """One engine over `nodes` pods: the leader runs the component's args, the followers `follower_args`."""

    nodes: int
    follower_args: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Component:
    """One Deployment of `dyn` processes (a pool of multi-node workers: one LeaderWorkerSet, groups.py)."""

    part: Part
    args: tuple[str, ...]
    """The command line after `dyn` (the image's entrypoint)."""
    replicas: int | None
    """None: left out, so a re-apply does not undo the planner's scaling (it starts at 1)."""
    resources: Resources
    ports: tuple[tuple[str, int], ...]
    probe: Probe | None
    """None: no probe (a multi-node group's follower: the leader's probes are the group's)."""
    scrape_port: int | None
    """The port Prometheus scrapes `/metrics` on (the annotations); None: not scraped."""
    advertise_env: str | None = None
    """The variable set to the pod's IP: the request-plane address it listens on and registers."""
    cluster_secret: bool = True
    """Gets `DYN_CLUSTER_SECRET` from the cluster Secret."""
    mounts: tuple[Mount, ...] = ()
    grace_s: float = 30.0
    """The process's drain (`--graceful-shutdown`): terminationGracePeriodSeconds is the preStop sleep, this and
    10 s, so SIGTERM finds no new request and the streams admitted before it finish."""
    startup_s: float = 600.0
    """How long the process may take to serve (`/live` answering) before liveness counts: the startupProbe."""
    service_account: str | None = None
    env: tuple[tuple[str, str], ...] = field(default=())
    secret_env: tuple[SecretEnv, ...] = ()
    """Variables from Secrets (the batch database's PGPASSWORD, HF_TOKEN), beside the cluster secret."""
    env_from: tuple[str, ...] = ()
    """Secrets whose every key becomes a variable (`--env-from`)."""
    placement: Placement = Placement()
    single_writer: bool = False
    """At most one pod at any time, a rollout included (the planner: two would PATCH the same pools)."""
    group: Group | None = None
    """A pool of multi-node engines: each replica a group of pods, rendered as a LeaderWorkerSet (groups.py)."""
    outlasts_drain: bool = False
    """Its preStop sleeps through the drain as well (a group's follower: the engine's other nodes keep serving the
    streams the leader finishes, and SIGTERM comes after; its leader gone, it exits by itself before)."""

    @property
    def has_writable_claim(self) -> bool:
        return any(m.claim is not None and m.writable for m in self.mounts)


def metadata(names: Names, namespace: str, part: Part | None, name: str | None = None) -> Obj:
    """`name` (default: the part's) in `namespace`, labelled as the part (None: the whole deployment)."""
    if name is None:
        assert part is not None, "an object of the whole deployment is named by its caller"
        name = names.of(part)
    return {"name": name, "namespace": namespace, "labels": names.labels(part)}


def pod_security() -> Obj:
    """UID 10001, no root; fsGroup makes a claim's volume writable by it (the kubelet gives the volume that group,
    only when its root does not have it yet, so a full volume does not slow every restart)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": UID,
        "runAsGroup": UID,
        "fsGroup": UID,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security(*, ipc_lock: bool = False) -> Obj:
    capabilities: Obj = {"drop": ["ALL"]} | ({"add": ["IPC_LOCK"]} if ipc_lock else {})
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": capabilities}


def volume_claim(names: Names, namespace: str, part: Part, mount: Mount, storage_class: str | None) -> Obj:
    """The PersistentVolumeClaim a writable mount names, labelled as the part that mounts it."""
    assert mount.claim is not None and mount.size is not None, "a rendered claim has a name and a size"
    spec = claim_spec(mount.size, storage_class)
    meta = metadata(names, namespace, part, mount.claim)
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def claim_spec(storage: str, storage_class: str | None) -> Obj:
    """ReadWriteOnce, `storage` of `storage_class` (None: the cluster's default)."""
    spec: Obj = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": storage}}}
    return spec | ({"storageClassName": storage_class} if storage_class is not None else {})


def deployment(names: Names, namespace: str, image: str, component: Component, cluster_secret: str) -> Obj:
    """The component's Deployment: rolling updates one pod at a time, no surge beyond one (Recreate for a pod
    holding a ReadWriteOnce claim)."""
    part = component.part
    spec: Obj = {
        "selector": {"matchLabels": names.selector(part)},
        "strategy": _strategy(component),
        "template": pod_template(names, image, component, cluster_secret),
    }
    if component.replicas is not None:
        spec = {"replicas": component.replicas} | spec
    # a rollout is failed only once a new pod had its whole start-up to become ready, and a bit more
    spec["progressDeadlineSeconds"] = max(600, int(component.startup_s) + 300)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(names, namespace, part), "spec": spec}


def _strategy(component: Component) -> Obj:
    """A new pod before an old one goes; with GPUs the other way round (a full cluster has no GPU to surge onto).

    A ReadWriteOnce claim attaches to one node at a time. A surge pod scheduled on another node cannot attach it
    while the old pod, which waits for the new one to be ready, holds it: the rollout never finishes. `maxSurge: 0`
    is not enough either: it creates the new pod as soon as the old one starts terminating, and that pod waits on
    a Multi-Attach error while the old one drains. Recreate starts the new pod once every old one is gone."""
    if component.has_writable_claim or component.single_writer:
        return {"type": "Recreate"}
    if component.resources.gpus:
        return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


def pod_template(names: Names, image: str, component: Component, cluster_secret: str) -> Obj:
    """The component's pod: its container, volumes, security and placement, annotated for a Prometheus
    `kubernetes-pods` scrape job where it has metrics."""
    meta: Obj = {"labels": names.labels(component.part)}
    if component.scrape_port is not None:
        scheme = component.probe.scheme.lower() if component.probe is not None else "http"
        meta["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(component.scrape_port),
            "prometheus.io/path": "/metrics",
            "prometheus.io/scheme": scheme,
        }
    pod: Obj = {
        "automountServiceAccountToken": component.service_account is not None,
        "enableServiceLinks": False,  # a Service named like dyn-router would inject DYN_ROUTER_PORT=tcp://...
        "securityContext": pod_security(),
        "terminationGracePeriodSeconds": PRE_STOP_S + int(component.grace_s) + 10,
        "containers": [_container(image, component, cluster_secret)],
        "volumes": [m.volume() for m in (TMP, *component.mounts)],
    }
    if component.service_account is not None:
        pod = {"serviceAccountName": component.service_account} | pod
    pod |= _placement(names, component)
    return {"metadata": meta, "spec": pod}


def _placement(names: Names, component: Component) -> Obj:
    """The pod's scheduling: its node selector, tolerations, priority and pull secrets; its replicas spread over
    nodes where the scheduler can (a node lost takes one pod of a component, not all)."""
    place, found = component.placement, Obj()
    if place.node_selector:
        found["nodeSelector"] = dict(place.node_selector)
    if place.tolerations:
        found["tolerations"] = [t.spec() for t in place.tolerations]
    if place.priority_class is not None:
        found["priorityClassName"] = place.priority_class
    if place.image_pull_secrets:
        found["imagePullSecrets"] = [{"name": name} for name in place.image_pull_secrets]
    if place.scheduler_name is not None:
        found["schedulerName"] = place.scheduler_name
    if component.replicas is None or component.replicas > 1 or component.group is not None:
        spread = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
        found["topologySpreadConstraints"] = [
            spread | {"labelSelector": {"matchLabels": names.selector(component.part)}}
        ]
    return found


def _container(image: str, component: Component, cluster_secret: str) -> Obj:
    container: Obj = {
        "name": component.part.value,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": list(component.args),
    }
    if component.ports:
        container["ports"] = [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in component.ports]
    container["env"] = _env(component, cluster_secret)
    if component.env_from:
        container["envFrom"] = [{"secretRef": {"name": name}} for name in component.env_from]
    pre_stop = PRE_STOP_S + (int(component.grace_s) if component.outlasts_drain else 0)
    return container | {
        "resources": component.resources.spec(),
        **_probes(component),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(pre_stop)]}}},
        "securityContext": container_security(ipc_lock=component.placement.ipc_lock),
        "volumeMounts": [m.mount() for m in (TMP, *component.mounts)],
    }


def _env(component: Component, cluster_secret: str) -> list[Obj]:
    env: list[Obj] = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    env += [{"name": name, "value": value} for name, value in component.env]
    if component.advertise_env is not None:
        env.append({"name": component.advertise_env, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    if component.cluster_secret:
        ref = {"name": cluster_secret, "key": CLUSTER_SECRET_KEY}
        env.append({"name": "DYN_CLUSTER_SECRET", "valueFrom": {"secretKeyRef": ref}})
    for secret in component.secret_env:
        ref = {"name": secret.secret, "key": secret.key}
        env.append({"name": secret.name, "valueFrom": {"secretKeyRef": ref}})
    return env


def _probes(component: Component) -> Obj:
    probe = component.probe
    if probe is None:
        return {}
    return {
        # liveness counts only once the process served: a model load of up to `startup_s` is not a hang
        "startupProbe": probe.spec(probe.live, STARTUP_PERIOD_S, _startup_failures(component.startup_s)),
        "livenessProbe": probe.spec(probe.live, 10, 6),
        "readinessProbe": probe.spec(probe.ready, 5, 2),
    }


def service(names: Names, namespace: str, part: Part, ports: list[tuple[str, int]], kind: str = "ClusterIP") -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(names, namespace, part),
        "spec": {
            "type": kind,
            "selector": names.selector(part),
            "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports],
        },
    }


def disruption_budget(names: Names, namespace: str, part: Part) -> Obj:
    """At most one pod of the component evicted at a time (a node drain moves them one by one)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(names, namespace, part),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": names.selector(part)}},
    }


def network_policies(names: Names, namespace: str, open_ports: list[int], metrics_namespace: str | None) -> list[Obj]:
    """Pods of this deployment reach each other; from anywhere else only the frontend's `open_ports` (HTTP, and
    KServe gRPC when served) are open (and, with `metrics_namespace`, the metrics ports to that namespace's
    Prometheus)."""
    http_port = open_ports[0]
    everyone = {"matchLabels": names.instance_selector()}

    def policy(suffix: str, pods: Obj, ingress: list[Obj]) -> Obj:
        meta = metadata(names, namespace, None, f"{names.instance}-{suffix}")
        spec = {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress}
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta, "spec": spec}

    policies = [
        policy("internal", everyone, [{"from": [{"podSelector": everyone}]}]),
        policy(
            "frontend-http",
            {"matchLabels": names.selector(Part.FRONTEND)},
            [{"ports": [{"protocol": "TCP", "port": port} for port in open_ports]}],
        ),
    ]
    if metrics_namespace is not None:
        source = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": metrics_namespace}}}
        ports = [{"protocol": "TCP", "port": p} for p in sorted({http_port, PORTS.system, PORTS.nats_monitor})]
        policies.append(policy("metrics", everyone, [{"from": [source], "ports": ports}]))
    return policies


def planner_rbac(names: Names, namespace: str, scaled: list[str], workload: Workload = DEPLOYMENT) -> list[Obj]:
    """The planner's ServiceAccount, and a Role bound to it granting exactly what the Scale-subresource connector
    calls: `get`/`patch` of `deployments/scale` and `get` of `deployments` (readyReplicas), or the same of
    `leaderworkersets`, for the pools it scales and nothing else."""
    meta = metadata(names, namespace, Part.PLANNER)
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
    group, plural = [workload.group], workload.plural
    rules = [
        {"apiGroups": group, "resources": [f"{plural}/scale"], "resourceNames": scaled, "verbs": ["get", "patch"]},
        {"apiGroups": group, "resources": [plural], "resourceNames": scaled, "verbs": ["get"]},
    ]
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": rules}
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": meta["name"]},
        "subjects": [{"kind": "ServiceAccount", "name": meta["name"], "namespace": namespace}],
    }
    return [account, role, binding]


def _startup_failures(startup_s: float) -> int:
    """Failed start-up probes (every STARTUP_PERIOD_S) that make `startup_s`."""
    return max(3, math.ceil(startup_s / STARTUP_PERIOD_S))


def pod_monitor(names: Names, namespace: str, frontend_scheme: str | None, group_size: int = 1) -> Obj:
    """A prometheus-operator PodMonitor scraping every pod of the deployment on the ports the prometheus.io
    annotations name: `system` (workers, routers, planner) and `http` (the frontend; None: its /metrics needs an
    API key, so it is left out). A pod without one of the ports is not scraped on it; the followers of multi-node
    groups (`group_size` pods each) are not selected: their leaders' metrics are the groups'."""
    endpoints: list[Obj] = [{"port": "system", "path": "/metrics", "scheme": "http"}]
    if frontend_scheme is not None:
        endpoint: Obj = {"port": "http", "path": "/metrics", "scheme": frontend_scheme}
        if frontend_scheme == "https":  # the frontend's certificate names its Service, not the pod IP scraped
            endpoint["tlsConfig"] = {"insecureSkipVerify": True}
        endpoints.append(endpoint)
    meta = metadata(names, namespace, None, names.instance)
    selector: Obj = {"matchLabels": names.instance_selector()}
    if group_size > 1:  # every pod but the followers (those without the label, the leaders: index 0)
        followers = [str(index) for index in range(1, group_size)]
        selector["matchExpressions"] = [{"key": LWS_WORKER_INDEX_LABEL, "operator": "NotIn", "values": followers}]
    spec = {"selector": selector, "podMetricsEndpoints": endpoints}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": meta, "spec": spec}


def http_route(names: Names, namespace: str, gateway: tuple[str | None, str], hostnames: list[str], port: int) -> Obj:
    """A Gateway API HTTPRoute from `gateway` ((namespace or None, name)) to the frontend Service, with no request
    timeout (a stream runs as long as its tokens do)."""
    gateway_namespace, gateway_name = gateway
    parent: Obj = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway_name}
    parent |= {"namespace": gateway_namespace} if gateway_namespace is not None else {}
    rule = {
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "backendRefs": [{"name": names.of(Part.FRONTEND), "port": port}],
        "timeouts": {"request": "0s"},  # 0s: no timeout (the Gateway API's zero duration)
    }
    spec: Obj = {"parentRefs": [parent], "rules": [rule]}
    if hostnames:
        spec = {"hostnames": hostnames} | spec
    meta = metadata(names, namespace, Part.FRONTEND)
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": meta, "spec": spec}


def viewer_role(names: Names, namespace: str) -> Obj:
    """`NAME-viewer`: what `dyn k8s status` reads, to bind to whoever runs it (`kubectl create rolebinding
    --role NAME-viewer --group ...`): list of the deployment's workloads and pods, and the details (pod logs,
    events, the frontend's /health through the service proxy). Read-only; no binding is rendered."""
    rules = [
        {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["pods", "events"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["services/proxy"], "verbs": ["get"]},  # named https:NAME:PORT with TLS
    ]
    meta = metadata(names, namespace, None, f"{names.instance}-viewer")
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": rules}


def config_map(names: Names, namespace: str, part: Part | None, name: str, data: dict[str, str]) -> Obj:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(names, namespace, part, name), "data": data}
