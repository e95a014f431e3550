"""`dyn k8s status`'s reads: a rendered deployment's Deployments, StatefulSets, LeaderWorkerSets (multi-node worker
pools, where the cluster has the LWS API) and pods (and, for a pod that
is not ready, its previous log line or latest Warning event) from the API server, and the frontend's /health
through the API server's service proxy (or directly); status.py turns them into rows.

Every call has a timeout (`_request_timeout`) and is made once: a status command that cannot read says so at
once. The required reads (list deployments, statefulsets, pods) fail the command with one line naming the
namespace and the missing permission; the detail reads (pods/log, events, services/proxy) only lose a detail.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from dynamo_cli.errors import ConfigError, DynError
from dynamo_cli.k8s.client import api_client, client_modules, context_namespace
from dynamo_cli.k8s.names import LEADER_WORKER_SET, Names, Part, check_name
from dynamo_cli.k8s.status import (
    ComponentStatus,
    Obj,
    StatusReport,
    Trouble,
    count_registered,
    desired_replicas,
    explain,
    first_trouble,
    latest,
    no_pods_reason,
    part_of,
    ready_replicas,
    role_counts,
)

logger = logging.getLogger(__name__)

NEEDED_BY = "dyn k8s status"
PERMISSIONS = "list on deployments, statefulsets and pods (get on pods/log and services/proxy, list on events: details)"
MAX_LOG_LINE = 300


class StatusUnreadable(DynError):
    """`dyn k8s status` cannot tell: the API server is unreachable or refused a required read, or holds no
    objects of the deployment in the namespace. Exit code 3 (1 means "read, and not ready")."""

    exit_code = 3

    def __init__(self, namespace: str, cause: str) -> None:
        self.namespace = namespace
        self.cause = cause
        super().__init__(cause)


@dataclass(frozen=True, slots=True)
class StatusConfig:
    """What `dyn k8s status` reads, and from where."""

    namespace: str | None = None
    """The namespace the manifests were applied in; None: as kubectl (the pod's, the context's, `default`)."""
    instance: str = "dyn"
    """The deployment's `--name` at render time (`app.kubernetes.io/instance`)."""
    kubeconfig: str | None = None
    """A kubeconfig file; None: in-cluster config, else `KUBECONFIG` (or ~/.kube/config)."""
    frontend_url: str | None = None
    """Read /health here (after `kubectl port-forward`, say) instead of through the API server's service proxy."""
    request_timeout_s: float = 10.0
    """Timeout of each API call and of the /health read."""


def check_status(config: StatusConfig) -> None:
    """ConfigError for a name the API server would refuse, a frontend URL that is not http(s), a bad timeout."""
    check_name("--namespace", config.namespace or "default")  # as `dyn k8s render` took them
    check_name("--name", config.instance)
    if config.frontend_url is not None:
        parts = urlsplit(config.frontend_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"--frontend-url '{config.frontend_url}' is not a URL; give it as http://HOST:PORT")
    if not config.request_timeout_s > 0:
        raise ConfigError(f"--timeout ({config.request_timeout_s}) must be a positive number of seconds")


def read_status(config: StatusConfig) -> StatusReport:
    """One reading of the deployment: a row per component, with reasons and registered instances."""
    check_status(config)
    api = api_client(config.kubeconfig, NEEDED_BY)
    try:
        namespace = config.namespace or context_namespace(config.kubeconfig, NEEDED_BY)
        return _Reader(api, namespace, config).report()
    finally:
        api.close()


class _Reader:
    def __init__(self, api: Any, namespace: str, config: StatusConfig) -> None:
        client, _ = client_modules(NEEDED_BY)
        import urllib3.exceptions  # installed with the client

        self._transport_errors: tuple[type[Exception], ...] = (urllib3.exceptions.HTTPError, OSError)
        self._core = client.CoreV1Api(api)
        self._apps = client.AppsV1Api(api)
        self._custom = client.CustomObjectsApi(api)
        self._api_exception: type[Exception] = client.ApiException
        self._host = str(api.configuration.host)
        self._namespace = namespace
        self._config = config
        self._names = Names(config.instance)

    def report(self) -> StatusReport:
        selector = _selector(self._names.instance_selector())
        workloads = [
            *self._list("deployments", self._apps.list_namespaced_deployment, selector, "Deployment"),
            *self._list("statefulsets", self._apps.list_namespaced_stateful_set, selector, "StatefulSet"),
            *self._list("leaderworkersets", self._list_groups, selector, LEADER_WORKER_SET.kind, missing_ok=True),
        ]
        found = sorted(((p, w) for w in workloads if (p := part_of(w, self._names))), key=_order)
        if not found:
            ns, name = self._namespace, self._config.instance
            raise StatusUnreadable(
                ns,
                f"no Deployment, StatefulSet or LeaderWorkerSet labelled app.kubernetes.io/instance={name} in "
                f"namespace {ns}; was `dyn k8s render --name {name}` applied there? (--namespace and --name say where "
                "to look)",
            )
        pods = self._list("pods", self._core.list_namespaced_pod, selector, "Pod")
        frontend = next((w for p, w in found if p is Part.FRONTEND), None)
        counts, registered_error = self._registered(frontend)
        has_routers = any(p is Part.ROUTER for p, _ in found)
        rows = []
        for part, workload in found:
            mine = [pod for pod in pods if part_of(pod, self._names) is part]
            registered = count_registered(part, counts, has_routers)
            rows.append(ComponentStatus.of(part, workload, registered, self._reason(workload, mine)))
        return StatusReport(self._namespace, self._config.instance, tuple(rows), registered_error)

    ##### The pods #####

    def _reason(self, workload: Obj, pods: list[Obj]) -> str | None:
        if not pods:
            if ready_replicas(workload) >= desired_replicas(workload):
                return None
            return no_pods_reason(workload, self._latest_warning(str(workload["metadata"]["name"])))
        trouble = first_trouble(pods)
        if trouble is None:
            return None
        log_line = warning = None
        if trouble.trouble is Trouble.CRASH_LOOPING and trouble.container is not None:
            log_line = self._last_log_line(trouble.pod, trouble.container, trouble.is_previous_log)
        elif trouble.trouble is Trouble.NOT_READY:
            warning = self._latest_warning(trouble.pod)
        return explain(trouble, log_line, warning)

    def _last_log_line(self, pod: str, container: str, previous: bool) -> str | None:
        read = self._core.read_namespaced_pod_log
        raw = self._detail(f"get pods/log {pod}", read, pod, container=container, previous=previous, tail_lines=1)
        if raw is None:
            return None
        lines = [line for line in raw.decode(errors="replace").splitlines() if line.strip()]
        if not lines:
            return None
        line = " ".join(lines[-1].split())
        return line if len(line) <= MAX_LOG_LINE else line[: MAX_LOG_LINE - 1] + "…"

    def _latest_warning(self, name: str) -> str | None:
        selector = f"involvedObject.name={name},type=Warning"
        raw = self._detail(f"list events of {name}", self._core.list_namespaced_event, field_selector=selector)
        if raw is None:
            return None
        try:
            return latest(json.loads(raw).get("items") or [])
        except (ValueError, AttributeError):
            return None

    ##### Registered instances #####

    def _registered(self, frontend: Mapping[str, Any] | None) -> tuple[dict[str, int] | None, str | None]:
        """Instances per role from the frontend's /health, or None and why it could not be read."""
        if self._config.frontend_url is not None:
            return self._health_direct(self._config.frontend_url.rstrip("/") + "/health")
        if frontend is None:
            return None, f"no {self._names.of(Part.FRONTEND)} Deployment to ask"
        containers = frontend.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or [{}]
        scheme = "https:" if "--tls-cert-file" in (containers[0].get("args") or []) else ""  # the proxy's scheme
        service = f"{scheme}{self._names.of(Part.FRONTEND)}:http"
        where = f"GET /health through the API server's proxy to service {service}"
        try:
            answer = self._core.connect_get_namespaced_service_proxy_with_path(
                service,
                self._namespace,
                "health",
                _preload_content=False,
                _request_timeout=self._config.request_timeout_s,
            )
        except self._api_exception as exc:
            status, body = getattr(exc, "status", None), getattr(exc, "body", None)
            counts = _health_counts(body)  # the frontend's own 503: no instances
            return (counts, None) if counts is not None else (None, f"{where}: HTTP {status} {_status_message(exc)}")
        except self._transport_errors as exc:  # unreachable, timed out
            return None, f"{where}: {_why(exc)}"
        counts = _health_counts(answer.data)
        return (counts, None) if counts is not None else (None, f"{where}: the answer is not a dyn frontend's /health")

    def _health_direct(self, url: str) -> tuple[dict[str, int] | None, str | None]:
        try:
            answer = httpx.get(url, timeout=self._config.request_timeout_s)
        except httpx.HTTPError as exc:
            return None, f"GET {url}: {type(exc).__name__} {exc}".rstrip()
        counts = _health_counts(answer.content)
        if counts is None:
            return None, f"GET {url}: HTTP {answer.status_code}, not a dyn frontend's /health"
        return counts, None

    ##### Calls #####

    def _list_groups(self, namespace: str, **kwargs: Any) -> Any:
        """`list_namespaced_*`'s shape for the LeaderWorkerSets, a custom resource (`--nodes-per-worker`)."""
        group, _, version = LEADER_WORKER_SET.api_version.partition("/")
        return self._custom.list_namespaced_custom_object(group, version, namespace, LEADER_WORKER_SET.plural, **kwargs)

    def _list(
        self, resource: str, method: Callable[..., Any], selector: str, kind: str, *, missing_ok: bool = False
    ) -> list[Obj]:
        """A required read: every failure is one StatusUnreadable naming the namespace and the permission (with
        `missing_ok`, a resource the cluster does not have, 404, is none: LWS not installed)."""
        ns = self._namespace
        try:
            answer = method(
                ns, label_selector=selector, _preload_content=False, _request_timeout=self._config.request_timeout_s
            )
            items = json.loads(answer.data).get("items") or []
        except self._api_exception as exc:
            if missing_ok and getattr(exc, "status", None) == 404:
                return []
            raise StatusUnreadable(ns, self._refused(exc, f"list {resource}")) from None
        except (ValueError, AttributeError):
            raise StatusUnreadable(ns, f"list {resource} in namespace {ns}: the answer is not JSON") from None
        except self._transport_errors as exc:  # refused, unresolvable, timed out
            raise StatusUnreadable(
                ns,
                f"cannot reach the Kubernetes API server at {self._host} to list {resource} in namespace {ns}: "
                f"{_why(exc)}; check --kubeconfig / KUBECONFIG",
            ) from None
        return [{"kind": kind, **item} for item in items]

    def _refused(self, exc: Exception, action: str) -> str:
        status, ns = getattr(exc, "status", None), self._namespace
        if status == 401:
            return (
                f"unauthorized (401): the API server at {self._host} refused the kubeconfig's credentials "
                f"({action} in namespace {ns}); renew them or pass another --kubeconfig"
            )
        if status == 403:
            return f"forbidden (403): may not {action} in namespace {ns}; `dyn k8s status` needs {PERMISSIONS}"
        return f"{action} in namespace {ns}: HTTP {status} {_status_message(exc)}"

    def _detail(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> bytes | None:
        """A detail read: its failure drops the detail (logged at DEBUG), never the command."""
        try:
            answer = method(
                *args,
                self._namespace,
                _preload_content=False,
                _request_timeout=self._config.request_timeout_s,
                **kwargs,
            )
            return bytes(answer.data)
        except (self._api_exception, *self._transport_errors) as exc:
            logger.debug("%s in namespace %s: %s", what, self._namespace, _why(exc))
            return None


def _order(found: tuple[Part, Obj]) -> tuple[int, str]:
    return list(Part).index(found[0]), str(found[1]["metadata"]["name"])


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in labels.items())


def _health_counts(body: bytes | str | None) -> dict[str, int] | None:
    """Instances per role, when `body` is a dyn frontend's /health (200, or 503 with no instances)."""
    try:
        health = json.loads(body or b"")
    except ValueError:
        return None
    if not isinstance(health, dict) or not isinstance(health.get("instances"), list):
        return None
    return role_counts(health)


def _status_message(exc: Exception) -> str:
    """The message of the API server's Status body, else the HTTP reason."""
    try:
        message = json.loads(getattr(exc, "body", None) or b"").get("message")
    except (ValueError, AttributeError):
        message = None
    return " ".join(str(message or getattr(exc, "reason", "") or "").split())


def _why(exc: BaseException) -> str:
    """urllib3's error in a few words: `[Errno 111] Connection refused`, `read timed out` ..."""
    reason = getattr(exc, "reason", None) or exc
    text = " ".join(str(reason).split())
    text = text.split("Failed to establish a new connection: ", 1)[-1]
    return text or type(exc).__name__
