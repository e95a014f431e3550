"""KEDA ScaledObjects: each worker pool scaled by KEDA on its workers' own load (the requests their engines run and
hold waiting), queried from Prometheus; the alternative to the planner (`dyn k8s render --keda-prometheus`).

The trigger is an `AverageValue` one, so KEDA's HPA asks for ceil(load / threshold) workers whatever their number
now: workers still loading their model do not make the next scale-up bigger. Scale-down waits for the load to stay
low for the cooldown (the HPA's stabilization window), then removes one worker at a time. See
docs/guides/kubernetes.md (Scaling).
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_cli.k8s.names import DEPLOYMENT, Names, Part, Workload
from dynamo_cli.k8s.objects import Obj, metadata

WORKER_LOAD = ("dynamo_component_running_requests", "dynamo_component_waiting_requests")
"""A worker's own gauges on its system port (worker_metrics.py): requests its engine runs, and requests waiting in
its scheduler. Their sum over a pool is the load KEDA sizes it to."""
MAX_COOLDOWN_S = 3600
"""The HPA's largest stabilization window."""
SCALE_DOWN_PERIOD_S = 60
"""At most one worker removed per this many seconds: each drains its streams before the next goes."""


@dataclass(frozen=True, slots=True)
class KedaScaling:
    """How KEDA scales every worker pool (`--keda-*`)."""

    prometheus: str
    """The Prometheus server KEDA queries (`http://prometheus.monitoring:9090`), which scrapes the worker pods."""
    requests_per_worker: float
    """The trigger's threshold: running + waiting requests one worker is sized for."""
    min_workers: int = 1
    """At least 1: with no worker, no load reaches the metric, and the model leaves `/v1/models`."""
    max_workers: int = 8
    cooldown_s: int = 600
    """Seconds the load must stay low before a worker is removed (at least a worker's start-up: one removed and
    wanted again within it costs a start-up of queued requests)."""


POD_NAMES = {"Deployment": "[a-z0-9]+-[a-z0-9]+", "LeaderWorkerSet": "[0-9]+"}
"""What follows `NAME-` in the name of a pool's pod that exports its load: a Deployment's `<hash>-<id>`, a
LeaderWorkerSet's leader `<group>` (a follower, `<group>-<index>`, exports none)."""


def load_query(namespace: str, pool: str, workload: Workload = DEPLOYMENT) -> str:
    """PromQL: the pool's running + waiting requests, summed over its pods (a group's: its leader's), selected by
    the `namespace` and `pod` labels a PodMonitor (`--pod-monitor`) or a `kubernetes-pods` scrape job adds."""
    pods = f'namespace="{namespace}",pod=~"{pool}-{POD_NAMES[workload.kind]}"'
    return " + ".join(f"sum({series}{{{pods}}})" for series in WORKER_LOAD)


def scaled_object(names: Names, namespace: str, part: Part, keda: KedaScaling, workload: Workload = DEPLOYMENT) -> Obj:
    """The pool's ScaledObject: its Deployment (or LeaderWorkerSet: its groups) between the bounds, sized to its
    load by a Prometheus trigger."""
    target = names.of(part)
    trigger = {
        "type": "prometheus",
        "metricType": "AverageValue",  # desired workers = ceil(query / threshold)
        "metadata": {
            "serverAddress": keda.prometheus,
            "query": load_query(namespace, target, workload),
            "threshold": _decimal(keda.requests_per_worker),
        },
    }
    scale_down = {
        "stabilizationWindowSeconds": keda.cooldown_s,
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": SCALE_DOWN_PERIOD_S}],
    }
    spec = {
        "scaleTargetRef": {"apiVersion": workload.api_version, "kind": workload.kind, "name": target},
        "minReplicaCount": keda.min_workers,
        "maxReplicaCount": keda.max_workers,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": scale_down}}},
        "triggers": [trigger],
    }
    meta = metadata(names, namespace, part)
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": meta, "spec": spec}


def _decimal(value: float) -> str:
    """`8`, `2.5`: a threshold as KEDA parses it (no exponent)."""
    return f"{value:f}".rstrip("0").rstrip(".")
