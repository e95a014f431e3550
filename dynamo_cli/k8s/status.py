"""`dyn k8s status`'s pure core: a rendered deployment's Deployments, StatefulSets and pods, read back as the
API server's JSON, become one row per component (desired, ready, registered) with the first reason a pod
is not ready. Synchronous and deterministic; cluster.py does the reading."""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from dynamo_cli.k8s.names import WORKER_PARTS, Names, Part

Obj = Mapping[str, Any]
"""One API object as the API server's JSON (camelCase keys, as `kubectl get -o json` shows it)."""

CRASHING = frozenset({"CrashLoopBackOff", "Error"})
IMAGE_PULL = frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"})
MISCONFIGURED = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
_INSUFFICIENT = re.compile(r"Insufficient ([A-Za-z0-9./_-]*[A-Za-z0-9_])")
_ROLE_OF = {Part.WORKER: "both", Part.DECODE: "decode", Part.PREFILL: "prefill"}
"""The `role` a worker pool's instances have in the frontend's /health."""


class Trouble(enum.Enum):
    """Why a pod is not ready; the value starts the reason line."""

    PENDING = "pending"  # not scheduled (no node fits), or its containers are still being created
    CRASH_LOOPING = "crash-looping"  # a container exits and is restarted
    IMAGE_PULL = "image pull"  # the image cannot be pulled (tag, registry, credentials)
    CONFIG = "config"  # the container cannot be created: a missing Secret or ConfigMap, a bad command
    NOT_READY = "not ready"  # running, but its readiness probe fails
    FAILED = "failed"  # the pod is over: evicted, or its containers exited for good


@dataclass(frozen=True, slots=True)
class PodTrouble:
    """The first thing wrong with one pod, and what to read to explain it."""

    pod: str
    """The pod's name."""
    trouble: Trouble
    """What kind of wrong."""
    message: str
    """The API server's own words (a condition's or a container state's message)."""
    container: str | None = None
    """The container whose log explains a crash (CRASH_LOOPING), or whose probe fails (NOT_READY)."""
    is_previous_log: bool = True
    """Read the log of the container's previous run (it is waiting to restart), not the current one."""


@dataclass(frozen=True, slots=True)
class ComponentStatus:
    """One row of `dyn k8s status`."""

    component: str
    """The component (`frontend`, `worker`, `decode`, ... : names.Part)."""
    kind: str
    """`Deployment`, `StatefulSet` or `LeaderWorkerSet` (whose replicas are groups of pods)."""
    name: str
    """The object's name in the namespace."""
    desired: int
    """`spec.replicas`."""
    ready: int
    """`status.readyReplicas`."""
    registered: int | None
    """Instances the frontend's /health lists for this component; None: not counted, or /health unreadable."""
    reason: str | None
    """The first reason a pod is not ready (or, with no pods, why none exist); None when nothing is wrong."""

    @property
    def is_ready(self) -> bool:
        return self.ready >= self.desired

    @classmethod
    def of(cls, part: Part, workload: Obj, registered: int | None, reason: str | None) -> ComponentStatus:
        """The row of a Deployment or StatefulSet (its `kind` set by the reader: list items carry none)."""
        return cls(
            component=part.value,
            kind=str(workload.get("kind") or "Deployment"),
            name=str(workload.get("metadata", {}).get("name", "?")),
            desired=desired_replicas(workload),
            ready=ready_replicas(workload),
            registered=registered,
            reason=reason,
        )


@dataclass(frozen=True, slots=True)
class StatusReport:
    """What `dyn k8s status` prints (a table, or the same as JSON)."""

    namespace: str
    """The namespace read."""
    instance: str
    """The deployment's `--name` (`app.kubernetes.io/instance`)."""
    components: tuple[ComponentStatus, ...]
    """One row per component, in names.Part order."""
    registered_error: str | None = None
    """Why the registered instances are unknown (the /health read failed); None when they were read."""

    @property
    def is_ready(self) -> bool:
        """Every component has as many ready replicas as desired (the command's exit code 0)."""
        return all(c.is_ready for c in self.components)

    def to_json(self) -> str:
        rows = [asdict(c) for c in self.components]
        body = {"namespace": self.namespace, "name": self.instance, "is_ready": self.is_ready, "components": rows}
        return json.dumps(body | {"registered_error": self.registered_error}, indent=2)

    def to_table(self) -> str:
        """Aligned columns, one row per component (`?`: not read, `-`: not counted), then the /health error."""
        header = ("NAME", "KIND", "DESIRED", "READY", "REGISTERED", "REASON")
        counted = {part.value for part in (*WORKER_PARTS, Part.ROUTER)}
        rows = [header] + [
            (
                c.name,
                c.kind,
                str(c.desired),
                str(c.ready),
                _registered_cell(c, self.registered_error is not None and c.component in counted),
                c.reason or "-",
            )
            for c in self.components
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
        lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]) for row in rows]
        if self.registered_error is not None:
            lines.append(f"registered instances unknown: {self.registered_error}")
        return "\n".join(line.rstrip() for line in lines)


def _registered_cell(row: ComponentStatus, is_unknown: bool) -> str:
    if row.registered is not None:
        return str(row.registered)
    return "?" if is_unknown else "-"


def part_of(obj: Obj, names: Names) -> Part | None:
    """The component a Deployment, StatefulSet or pod is, by its labels; None when not one of `names`'."""
    labels = obj.get("metadata", {}).get("labels") or {}
    for part in Part:
        if all(labels.get(key) == value for key, value in names.selector(part).items()):
            return part
    return None


def first_trouble(pods: list[Obj]) -> PodTrouble | None:
    """The first pod (by name) that is not ready and not being deleted, and why."""
    for pod in sorted(pods, key=lambda p: str(p.get("metadata", {}).get("name", ""))):
        if pod.get("metadata", {}).get("deletionTimestamp") or _condition(pod, "Ready", "True") is not None:
            continue
        trouble = pod_trouble(pod)
        if trouble is not None:
            return trouble
    return None


def pod_trouble(pod: Obj) -> PodTrouble | None:
    """Why this pod is not ready: unscheduled, then a waiting container, then a failing probe."""
    name = str(pod.get("metadata", {}).get("name", "?"))
    status = pod.get("status") or {}
    unscheduled = _condition(pod, "PodScheduled", "False")
    if unscheduled is not None:
        return PodTrouble(name, Trouble.PENDING, _message(unscheduled) or "not scheduled")
    if status.get("phase") == "Failed":
        why = ": ".join(str(status[key]) for key in ("reason", "message") if status.get(key))
        return PodTrouble(name, Trouble.FAILED, " ".join(why.split()) or "its containers exited")
    containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    for container in containers:
        trouble = _container_trouble(name, container)
        if trouble is not None:
            return trouble
    waiting = next((c for c in containers if "waiting" in (c.get("state") or {})), None)
    if status.get("phase") == "Pending" or waiting is not None:
        state = (waiting or {}).get("state", {}).get("waiting") or {}
        return PodTrouble(name, Trouble.PENDING, _message(state) or "waiting for its containers")
    unready = next((c for c in containers if not c.get("ready") and "running" in (c.get("state") or {})), None)
    if unready is not None:
        return PodTrouble(name, Trouble.NOT_READY, "readiness probe failing", container=str(unready.get("name")))
    return None


def _container_trouble(pod: str, container: Obj) -> PodTrouble | None:
    state = container.get("state") or {}
    waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
    last = (container.get("lastState") or {}).get("terminated") or {}
    reason, name = waiting.get("reason"), str(container.get("name"))
    if reason in CRASHING or (terminated and terminated.get("exitCode") != 0):
        if "OOMKilled" in (last.get("reason"), terminated.get("reason")):
            return PodTrouble(pod, Trouble.CRASH_LOOPING, "out of memory (OOMKilled)")
        exit_code = (terminated or last).get("exitCode")
        detail = _message(waiting) or (f"exit code {exit_code}" if exit_code is not None else "restarting")
        return PodTrouble(pod, Trouble.CRASH_LOOPING, detail, container=name, is_previous_log=not terminated)
    if reason in IMAGE_PULL:
        return PodTrouble(pod, Trouble.IMAGE_PULL, _message(waiting) or reason)
    if reason in MISCONFIGURED:
        return PodTrouble(pod, Trouble.CONFIG, _message(waiting) or reason)
    return None


def explain(trouble: PodTrouble, log_line: str | None = None, warning: str | None = None) -> str:
    """The reason line: `pending: insufficient nvidia.com/gpu`, `crash-looping: <the last log line>` ...

    `log_line`: the crashed container's last log line (CRASH_LOOPING); `warning`: the pod's latest Warning
    event (NOT_READY). Either may be None when it could not be read."""
    if trouble.trouble is Trouble.PENDING:
        short = list(dict.fromkeys(_INSUFFICIENT.findall(trouble.message)))
        return f"pending: insufficient {', '.join(short)}" if short else f"pending: {trouble.message}"
    if trouble.trouble is Trouble.CRASH_LOOPING and trouble.container is not None and log_line:
        return f"crash-looping: {log_line.strip()}"
    if trouble.trouble is Trouble.NOT_READY and warning:
        return f"not ready: readiness probe failing ({warning.strip()})"
    return f"{trouble.trouble.value}: {trouble.message}"


def desired_replicas(workload: Obj) -> int:
    """`spec.replicas` (1 when unset, as the API server defaults it)."""
    replicas = (workload.get("spec") or {}).get("replicas")
    return 1 if replicas is None else int(replicas)


def ready_replicas(workload: Obj) -> int:
    """`status.readyReplicas` (absent while none is ready)."""
    return int((workload.get("status") or {}).get("readyReplicas") or 0)


def no_pods_reason(workload: Obj, warning: str | None = None) -> str:
    """Why a workload that wants pods has none: its failed condition (a Deployment over quota), else its
    latest Warning event (a StatefulSet's), else `no pods`."""
    for kind, status in (("ReplicaFailure", "True"), ("Progressing", "False")):
        condition = _condition(workload, kind, status)
        if condition is not None and _message(condition):
            return f"no pods: {_message(condition)}"
    return f"no pods: {' '.join(warning.split())}" if warning else "no pods"


def role_counts(health: Obj) -> dict[str, int]:
    """A frontend's /health body → instances per role (`both`, `prefill`, `decode`)."""
    counts: dict[str, int] = {}
    for instance in health.get("instances") or []:
        role = str(instance.get("role", "both")) if isinstance(instance, Mapping) else "both"
        counts[role] = counts.get(role, 0) + 1
    return counts


def count_registered(part: Part, counts: Mapping[str, int] | None, has_routers: bool) -> int | None:
    """A component's registered instances: behind `dyn router`s the frontend lists only the routers."""
    if counts is None:
        return None
    if has_routers:
        return sum(counts.values()) if part is Part.ROUTER else None
    role = _ROLE_OF.get(part)
    return counts.get(role, 0) if role is not None else None


def latest(events: list[Obj]) -> str | None:
    """The message of the newest event (by last, else event, else creation time)."""

    def when(event: Obj) -> str:
        created = event.get("metadata", {}).get("creationTimestamp")
        return str(event.get("lastTimestamp") or event.get("eventTime") or created or "")

    newest = max(events, key=when, default=None)
    return None if newest is None else _message(newest)


def _condition(obj: Obj, kind: str, status: str) -> Obj | None:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind and c.get("status") == status), None)


def _message(obj: Obj) -> str:
    return " ".join(str(obj.get("message") or obj.get("reason") or "").split())
