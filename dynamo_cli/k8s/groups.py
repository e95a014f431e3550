"""A pool of multi-node workers as a LeaderWorkerSet (kubernetes-sigs/lws, `leaderworkerset.x-k8s.io/v1`): each
replica one group, a leader pod and `nodes - 1` follower pods that run one engine, created, restarted and scaled
as a unit.

NOTE: the group lives and dies together on both sides. `dyn worker` ends a leader whose follower left and a follower
whose leader left (node_group.py); `restartPolicy: RecreateGroupOnPodRestart` makes LWS recreate every pod of a
group when one of its containers restarts, so a group never runs with a member that joined another engine. The
followers are created with the leader (`startupPolicy: LeaderCreated`): the leader is ready only once they joined
(`LeaderReady` would wait forever), and a gang scheduler sees the whole group at once. The leader's address is
the name LWS gives it on the group's headless Service (`LWS_LEADER_ADDRESS`, published before the pod is ready)
and a follower's rank its index in the group (`LWS_WORKER_INDEX`): LWS puts both first in every container's
environment, so the kubelet expands `$(VAR)` in the args with them. `spec.replicas` counts groups: that is what
the planner and KEDA scale, through the LeaderWorkerSet's Scale subresource.
"""

from __future__ import annotations

from dataclasses import replace

from dynamo_cli.k8s.names import LEADER_WORKER_SET, Names
from dynamo_cli.k8s.objects import Component, Obj, metadata, pod_template

LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
"""The leader pod's DNS name (`NAME-GROUP.NAME.NAMESPACE`), as the kubelet expands it in a container's args."""
WORKER_INDEX = "$(LWS_WORKER_INDEX)"
"""The pod's index in its group (0: the leader), likewise."""


def leader_worker_set(names: Names, namespace: str, image: str, component: Component, cluster_secret: str) -> Obj:
    """The component's LeaderWorkerSet: `replicas` groups of `group.nodes` pods, the probes and the metrics on the
    leader only, groups rolled one at a time."""
    assert component.group is not None, "a LeaderWorkerSet is rendered for a pool of groups"
    template = {
        "size": component.group.nodes,
        "restartPolicy": "RecreateGroupOnPodRestart",
        "leaderTemplate": pod_template(names, image, component, cluster_secret),
        "workerTemplate": pod_template(names, image, follower(component), cluster_secret),
    }
    spec: Obj = {"startupPolicy": "LeaderCreated", "rolloutStrategy": _rollout(component)}
    if component.replicas is not None:  # None: the planner's or KEDA's count, which a re-apply must not reset
        spec = {"replicas": component.replicas} | spec
    spec["leaderWorkerTemplate"] = template
    meta = metadata(names, namespace, component.part)
    return {"apiVersion": LEADER_WORKER_SET.api_version, "kind": LEADER_WORKER_SET.kind, "metadata": meta, "spec": spec}


def follower(component: Component) -> Component:
    """A follower pod of the component's groups: its own args, no probe (a follower serves nothing the kubelet
    could ask; its leader's readiness is the group's), no port and no scrape; the same resources and placement,
    and a preStop that lasts through the leader's drain."""
    assert component.group is not None
    args = component.group.follower_args
    return replace(component, args=args, probe=None, scrape_port=None, ports=(), outlasts_drain=True)


def _rollout(component: Component) -> Obj:
    """One group replaced at a time: with GPUs the old group goes first (a full cluster has no GPUs for a whole
    extra group), else a new group is surged in before an old one goes."""
    surge, unavailable = (0, 1) if component.resources.gpus else (1, 0)
    rolling = {"maxUnavailable": unavailable, "maxSurge": surge}
    return {"type": "RollingUpdate", "rollingUpdateConfiguration": rolling}
