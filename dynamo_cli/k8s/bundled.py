"""The etcd and NATS servers a rendered deployment brings (`--etcd bundled`, `--nats bundled`): one StatefulSet
each, with a persistent volume and a headless Service, reachable only from the deployment's own pods (the
NetworkPolicy), so they run without credentials.

One member each by default: losing its pod pauses discovery or the event plane until the StatefulSet brings it back
on the same volume (workers keep serving the requests they hold; leases are renewed on reconnect), and no
disruption budget is written for it (one would either protect nothing or block every node drain). With
`--planes-replicas 3` (or 5) each is a cluster: an etcd of that many members, a NATS cluster with routes between
its servers, started together (`Parallel`), each with a budget that keeps a quorum up through a drain.
"""

from __future__ import annotations

from dynamo_cli.k8s.names import PORTS, Names, Part
from dynamo_cli.k8s.objects import (
    Obj,
    Probe,
    Resources,
    claim_spec,
    container_security,
    metadata,
    pod_security,
)

ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
NATS_IMAGE = "nats:2.10.24-alpine"
NATS_CLUSTER_PORT = 6222
POD_NAME_ENV = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
"""`$(POD_NAME)` in a member's arguments: its name, and through the headless Service its DNS name."""
ETCD_STORAGE = "4Gi"
"""The etcd member's volume: room for its 2 GiB backend quota (etcd's default), the WAL and snapshots besides."""


def etcd_url(names: Names, replicas: int = 1) -> str:
    """What `--discovery` is when etcd is bundled: the headless Service's name (one member), or each member's."""
    return "etcd://" + ",".join(f"{host}:{PORTS.etcd_client}" for host in _hosts(names, Part.ETCD, replicas))


def nats_url(names: Names, replicas: int = 1) -> str:
    return "nats://" + ",".join(f"{host}:{PORTS.nats_client}" for host in _hosts(names, Part.NATS, replicas))


def _hosts(names: Names, part: Part, replicas: int) -> list[str]:
    service = names.of(part)
    return [service] if replicas == 1 else [f"{service}-{i}.{service}" for i in range(replicas)]


def etcd(names: Names, namespace: str, storage: str, storage_class: str | None, replicas: int = 1) -> list[Obj]:
    """etcd 3.5, `replicas` members, each one's data on a claim; probed on /livez and /readyz (3.5.11+: a NOSPACE
    alarm, which a restart cannot clear, fails neither)."""
    service = names.of(Part.ETCD)
    peer = f"http://$(POD_NAME).{service}:{PORTS.etcd_peer}"
    members = [f"{service}-{i}=http://{service}-{i}.{service}:{PORTS.etcd_peer}" for i in range(replicas)]
    cluster = ",".join(members) if replicas > 1 else f"$(POD_NAME)={peer}"
    args = [
        "--name=$(POD_NAME)",
        "--data-dir=/var/lib/etcd/data",
        f"--listen-client-urls=http://0.0.0.0:{PORTS.etcd_client}",
        f"--advertise-client-urls=http://$(POD_NAME).{service}:{PORTS.etcd_client}",
        f"--listen-peer-urls=http://0.0.0.0:{PORTS.etcd_peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster={cluster}",
        "--initial-cluster-state=new",
        "--auto-compaction-retention=1h",
    ]
    ports = [("client", PORTS.etcd_client), ("peer", PORTS.etcd_peer)]
    container = _container(Part.ETCD, ETCD_IMAGE, "etcd", args, ports, POD_NAME_ENV)
    container |= _probes(Probe("client"), "/livez", "/readyz") | _data("/var/lib/etcd")
    return _stateful(names, namespace, Part.ETCD, container, storage, storage_class, replicas)


def nats(names: Names, namespace: str, storage: str, storage_class: str | None, replicas: int = 1) -> list[Obj]:
    """nats-server 2.10 with JetStream on a claim, `replicas` servers routed to each other; its monitoring port
    answers the probes."""
    args = [
        "--port",
        str(PORTS.nats_client),
        "--http_port",
        str(PORTS.nats_monitor),
        "--jetstream",
        "--store_dir",
        "/data",
    ]
    ports = [("client", PORTS.nats_client), ("monitor", PORTS.nats_monitor)]
    env = None
    if replicas > 1:
        routes = ",".join(f"nats://{host}:{NATS_CLUSTER_PORT}" for host in _hosts(names, Part.NATS, replicas))
        args += ["--server_name", "$(POD_NAME)", "--cluster_name", names.of(Part.NATS)]
        args += ["--cluster", f"nats://0.0.0.0:{NATS_CLUSTER_PORT}", "--routes", routes]
        ports.append(("cluster", NATS_CLUSTER_PORT))
        env = POD_NAME_ENV
    container = _container(Part.NATS, NATS_IMAGE, "nats-server", args, ports, env)
    container |= _probes(Probe("monitor"), "/healthz", "/healthz?js-enabled-only=true") | _data("/data")
    return _stateful(names, namespace, Part.NATS, container, storage, storage_class, replicas)


def _container(
    part: Part, image: str, command: str, args: list[str], ports: list[tuple[str, int]], env: list[Obj] | None = None
) -> Obj:
    """The server's container: `command ARGS` in `image`, its named ports, as unprivileged as dyn's own."""
    container: Obj = {
        "name": part.value,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": [command],
        "args": args,
    }
    if env:
        container["env"] = env
    return container | {
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports],
        "resources": Resources("250m", "512Mi").spec(),
        "securityContext": container_security(),
    }


def _probes(probe: Probe, live: str, ready: str) -> Obj:
    return {"livenessProbe": probe.spec(live, 10, 3), "readinessProbe": probe.spec(ready, 5, 3)}


def _data(path: str) -> Obj:
    """The claim `data` mounted at `path`."""
    return {"volumeMounts": [{"name": "data", "mountPath": path}]}


def _headless(names: Names, namespace: str, part: Part, container: Obj) -> Obj:
    """The headless Service: each member's stable DNS name (`NAME-0.NAME`), published before it is ready (the
    members of a cluster must find each other to become ready)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(names, namespace, part),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": names.selector(part),
            "ports": [
                {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
                for p in container["ports"]
            ],
        },
    }


def _stateful(
    names: Names, namespace: str, part: Part, container: Obj, storage: str, storage_class: str | None, replicas: int
) -> list[Obj]:
    """The StatefulSet, its headless Service (the stable DNS names) and, for a cluster, its disruption budget."""
    # volumeClaimTemplates cannot change once applied: the selector's labels only, no version (an upgrade re-renders)
    claim = {"metadata": {"name": "data", "labels": names.selector(part)}, "spec": claim_spec(storage, storage_class)}
    pod = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security(),
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "containers": [container],
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(names, namespace, part),
        "spec": {
            "serviceName": names.of(part),
            "replicas": replicas,
            "podManagementPolicy": "Parallel",  # a cluster's members find each other only once all start
            "selector": {"matchLabels": names.selector(part)},
            "template": {"metadata": {"labels": names.labels(part)}, "spec": pod},
            "volumeClaimTemplates": [claim],
        },
    }
    headless = _headless(names, namespace, part, container)
    if replicas == 1:
        return [statefulset, headless]
    quorum = {"minAvailable": replicas // 2 + 1, "selector": {"matchLabels": names.selector(part)}}
    budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": metadata(names, namespace, part)}
    return [statefulset, headless, budget | {"spec": quorum}]
