"""A whole deployment as Kubernetes objects: the components' Deployments (a pool of multi-node workers: a
LeaderWorkerSet), the frontend's Service, the bundled planes, the claims the components write to, the planner's
RBAC (or KEDA's ScaledObjects), disruption budgets and NetworkPolicies; and the `kubectl` lines that create the
Secrets they reference (no secret value is ever written into a manifest)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from dynamo_cli.k8s import bundled
from dynamo_cli.k8s.groups import leader_worker_set
from dynamo_cli.k8s.keda import KedaScaling, scaled_object
from dynamo_cli.k8s.names import DEPLOYMENT, LEADER_WORKER_SET, WORKER_PARTS, Names, Part
from dynamo_cli.k8s.objects import (
    Component,
    Obj,
    config_map,
    deployment,
    disruption_budget,
    http_route,
    network_policies,
    planner_rbac,
    pod_monitor,
    service,
    viewer_role,
    volume_claim,
)


@dataclass(frozen=True, slots=True)
class Cluster:
    """Where and how the deployment runs on Kubernetes (the settings `dyn serve` has no use for)."""

    namespace: str
    names: Names
    image: str
    """The `dyn` image (Containerfile), tagged: never `latest`."""
    http_port: int
    grpc_port: int | None = None
    """The frontend's KServe gRPC port (`--kserve-grpc-port`), on its Service and open as its HTTP port is."""
    service_type: str = "ClusterIP"
    """The frontend Service's type: ClusterIP, NodePort or LoadBalancer."""
    etcd_bundled: bool = True
    nats_bundled: bool = True
    storage_class: str | None = None
    """The class of the claims rendered here, the bundled planes' and the batch database's (None: the cluster's
    default)."""
    pod_monitor: bool = False
    """A prometheus-operator PodMonitor of every pod (`--pod-monitor`)."""
    gateway: tuple[str | None, str] | None = None
    """An HTTPRoute to the frontend from this Gateway (namespace or None, name; `--gateway`)."""
    hostnames: tuple[str, ...] = ()
    frontend_scheme: str | None = "http"
    """The frontend's /metrics scheme for the PodMonitor; None: it needs an API key (not scraped by it)."""
    planes_replicas: int = 1
    """Members of the bundled etcd and servers of the bundled NATS (1, or an odd quorum: 3, 5)."""
    metrics_namespace: str | None = None
    """A namespace whose pods (Prometheus) may scrape the metrics ports; None: only the frontend's HTTP port is
    reachable from outside the namespace."""
    keda: KedaScaling | None = None
    """A KEDA ScaledObject per worker pool (`--keda-prometheus`); the pools' Deployments then carry no replicas."""


@dataclass(frozen=True, slots=True)
class SecretSource:
    """A Secret the manifests reference, and what the `kubectl create secret` line that makes it reads."""

    name: str
    files: tuple[tuple[str, str], ...] = ()
    """(key, local file) pairs: `--from-file=KEY=FILE`."""
    random_key: str | None = None
    """A key filled with `openssl rand -hex 32` (the cluster secret, when no file is given)."""

    def command(self, namespace: str) -> str:
        parts = ["kubectl", "-n", namespace, "create", "secret", "generic", self.name]
        parts += [f"--from-file={key}={path}" for key, path in self.files]
        line = shlex.join(parts)
        if self.random_key is not None:
            line += f' --from-literal={self.random_key}="$(openssl rand -hex 32)"'
        return line


def render(
    cluster: Cluster, components: list[Component], config_maps: dict[str, dict[str, str]] | None = None
) -> list[Obj]:
    """Every object, in the order `kubectl apply` creates them well: config, RBAC, planes, then the processes."""
    names, ns = cluster.names, cluster.namespace
    objects: list[Obj] = [config_map(names, ns, None, name, data) for name, data in (config_maps or {}).items()]
    pools = [c for c in components if c.part in WORKER_PARTS]
    group_size = max((c.group.nodes for c in pools if c.group is not None), default=1)
    workload = LEADER_WORKER_SET if group_size > 1 else DEPLOYMENT  # every pool alike (--nodes-per-worker)
    if any(c.part is Part.PLANNER for c in components):
        objects += planner_rbac(names, ns, [names.of(c.part) for c in pools], workload)
    if cluster.etcd_bundled:
        objects += bundled.etcd(names, ns, bundled.ETCD_STORAGE, cluster.storage_class, cluster.planes_replicas)
    if cluster.nats_bundled:
        objects += bundled.nats(names, ns, "2Gi", cluster.storage_class, cluster.planes_replicas)
    for component in components:  # before the pods that mount them
        claims = [m for m in component.mounts if m.claim is not None and m.writable]
        objects += [volume_claim(names, ns, component.part, m, cluster.storage_class) for m in claims]
    for component in components:
        build = deployment if component.group is None else leader_worker_set
        objects.append(build(names, ns, cluster.image, component, names.cluster_secret))
        if component.part is Part.FRONTEND:
            http = [("http", cluster.http_port)] + ([("grpc", cluster.grpc_port)] if cluster.grpc_port else [])
            objects.append(service(names, ns, Part.FRONTEND, http, cluster.service_type))
        objects.append(disruption_budget(names, ns, component.part))
    open_ports = [cluster.http_port] + ([cluster.grpc_port] if cluster.grpc_port else [])
    objects += network_policies(names, ns, open_ports, cluster.metrics_namespace)
    if cluster.pod_monitor:
        objects.append(pod_monitor(names, ns, cluster.frontend_scheme, group_size))
    if cluster.gateway is not None:
        objects.append(http_route(names, ns, cluster.gateway, list(cluster.hostnames), cluster.http_port))
    if cluster.keda is not None:
        objects += [scaled_object(names, ns, c.part, cluster.keda, workload) for c in pools]
    return [*objects, viewer_role(names, ns)]


def kubectl_lines(cluster: Cluster, secrets: list[SecretSource]) -> list[str]:
    """What to run before `kubectl apply`: the namespace, then each Secret from local files."""
    lines = [f"kubectl create namespace {shlex.quote(cluster.namespace)}"]
    return lines + [secret.command(cluster.namespace) for secret in secrets]
