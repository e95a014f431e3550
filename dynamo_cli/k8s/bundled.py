"""The etcd and NATS servers a rendered deployment brings (`--etcd bundled`, `--nats bundled`): one StatefulSet
each, with a persistent volume and a headless Service, reachable only from the deployment's own pods (the
NetworkPolicy), so they run without credentials.

One member each: losing its pod pauses discovery or the event plane until the StatefulSet brings it back on the
same volume (workers keep serving the requests they hold; leases are renewed on reconnect). For a replicated
etcd or NATS cluster, run one and pass `--etcd URL` / `--nats URL`.
"""

from __future__ import annotations

from dynamo_cli.k8s.names import PORTS, Names, Part
from dynamo_cli.k8s.objects import (
    Obj,
    Resources,
    container_security,
    disruption_budget,
    metadata,
    pod_security,
)

ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
NATS_IMAGE = "nats:2.10.24-alpine"


def etcd_url(names: Names) -> str:
    """What `--discovery` is when etcd is bundled: its headless Service's name resolves to the member's pod."""
    return f"etcd://{names.of(Part.ETCD)}:{PORTS.etcd_client}"


def nats_url(names: Names) -> str:
    return f"nats://{names.of(Part.NATS)}:{PORTS.nats_client}"


def etcd(names: Names, namespace: str, storage: str, storage_class: str | None) -> list[Obj]:
    """etcd 3.5, one member, its data on a claim."""
    service = names.of(Part.ETCD)
    peer = f"http://$(POD_NAME).{service}:{PORTS.etcd_peer}"
    args = [
        "--name=$(POD_NAME)",
        "--data-dir=/var/lib/etcd/data",
        f"--listen-client-urls=http://0.0.0.0:{PORTS.etcd_client}",
        f"--advertise-client-urls=http://$(POD_NAME).{service}:{PORTS.etcd_client}",
        f"--listen-peer-urls=http://0.0.0.0:{PORTS.etcd_peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=$(POD_NAME)={peer}",
        "--auto-compaction-retention=1h",
    ]
    container = {
        "name": "etcd",
        "image": ETCD_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": ["etcd"],
        "args": args,
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [
            {"name": "client", "containerPort": PORTS.etcd_client, "protocol": "TCP"},
            {"name": "peer", "containerPort": PORTS.etcd_peer, "protocol": "TCP"},
        ],
        "resources": Resources("250m", "512Mi").spec(),
        "livenessProbe": _probe("/health", "client", 10),
        "readinessProbe": _probe("/health", "client", 5),
        "securityContext": container_security(),
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
    }
    ports = [("client", PORTS.etcd_client), ("peer", PORTS.etcd_peer)]
    return _stateful(names, namespace, Part.ETCD, container, ports, storage, storage_class)


def nats(names: Names, namespace: str, storage: str, storage_class: str | None) -> list[Obj]:
    """nats-server 2.10 with JetStream on a claim; its monitoring port answers the probes."""
    args = [
        "--port",
        str(PORTS.nats_client),
        "--http_port",
        str(PORTS.nats_monitor),
        "--jetstream",
        "--store_dir",
        "/data",
    ]
    container = {
        "name": "nats",
        "image": NATS_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": ["nats-server"],
        "args": args,
        "ports": [
            {"name": "client", "containerPort": PORTS.nats_client, "protocol": "TCP"},
            {"name": "monitor", "containerPort": PORTS.nats_monitor, "protocol": "TCP"},
        ],
        "resources": Resources("250m", "512Mi").spec(),
        "livenessProbe": _probe("/healthz", "monitor", 10),
        "readinessProbe": _probe("/healthz?js-enabled-only=true", "monitor", 5),
        "securityContext": container_security(),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    ports = [("client", PORTS.nats_client), ("monitor", PORTS.nats_monitor)]
    return _stateful(names, namespace, Part.NATS, container, ports, storage, storage_class)


def _probe(path: str, port: str, period_s: int) -> Obj:
    get = {"path": path, "port": port, "scheme": "HTTP"}
    return {"httpGet": get, "periodSeconds": period_s, "timeoutSeconds": 5, "failureThreshold": 3}


def _stateful(
    names: Names,
    namespace: str,
    part: Part,
    container: Obj,
    ports: list[tuple[str, int]],
    storage: str,
    storage_class: str | None,
) -> list[Obj]:
    """The StatefulSet, its headless Service (the stable DNS name) and its disruption budget."""
    claim: Obj = {
        "metadata": {"name": "data", "labels": names.labels(part)},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": storage}}},
    }
    if storage_class is not None:
        claim["spec"]["storageClassName"] = storage_class
    pod = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security(),
        "terminationGracePeriodSeconds": 30,
        "containers": [container],
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(names, namespace, part),
        "spec": {
            "serviceName": names.of(part),
            "replicas": 1,
            "selector": {"matchLabels": names.selector(part)},
            "template": {"metadata": {"labels": names.labels(part)}, "spec": pod},
            "volumeClaimTemplates": [claim],
        },
    }
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(names, namespace, part),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": names.selector(part),
            "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports],
        },
    }
    return [statefulset, headless, disruption_budget(names, namespace, part)]
