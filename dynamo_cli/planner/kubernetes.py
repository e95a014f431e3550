"""The `kubernetes` connector: a planner decision becomes each role's Deployment `replicas` (or, for a pool of
multi-node workers, its LeaderWorkerSet's: a count of groups), set through the Scale subresource with the official
client.

Only `PATCH …/deployments/{name}/scale` (`…/leaderworkersets/{name}/scale`) with `{"spec": {"replicas": N}}` is
sent, and only when `spec.replicas` differs: a scaler that patches the pod template rolls every pod instead of
adding or removing some. Each pool is applied on its own, both at once, and `apply` returns once the PATCHes are
accepted: it never waits for pods to start, so a prefill scale-up stuck Pending (no GPU free) neither delays nor
skips the decode pool's, and the planner's loop keeps its cadence (it counts serving workers in discovery). A
scale-up is followed on the next applies: `status.readyReplicas` reaching the target is logged, and a scale-up not
ready `ready_timeout_s` after its PATCH is one warning. The client is blocking: each call runs in a thread under a
timeout. The planner's RBAC needs `get`/`patch` on `deployments/scale` and `get` on `deployments` (or the same of
`leaderworkersets`); a 403 is one warning naming the verb, and `apply` says False.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dynamo_cli.errors import ConfigError
from dynamo_cli.k8s.client import api_client, client_modules
from dynamo_cli.k8s.names import DEPLOYMENT, WORKLOADS, Workload
from dynamo_cli.planner.connectors import ScaleTarget

logger = logging.getLogger(__name__)

T = TypeVar("T")

MERGE_PATCH = "application/merge-patch+json"
NEEDED_BY = "--connector kubernetes"
RETRIED_STATUSES = frozenset({409, 429, 500, 502, 503, 504})
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True, slots=True)
class KubernetesConfig:
    """Where the worker Deployments are and how the connector treats the API server."""

    namespace: str
    """The Kubernetes namespace of the Deployments."""
    decode_deployment: str = "dyn-decode"
    """The decode workers' Deployment (agg mode: the one pool's)."""
    prefill_deployment: str | None = None
    """The prefill workers' Deployment (disagg mode; None in agg mode)."""
    kind: str = DEPLOYMENT.kind
    """The pools' kind: Deployment, or LeaderWorkerSet (a pool of multi-node workers, whose replicas are groups)."""
    kubeconfig: str | None = None
    """A kubeconfig file; None: in-cluster config, else `KUBECONFIG` (or ~/.kube/config)."""
    min_replicas: int = 0
    """Each Deployment's replicas are clamped to at least this."""
    max_replicas: int = 8
    """… and at most this."""
    min_patch_interval_s: float = 5.0
    """Least time between two PATCHes of one Deployment; a sooner one is left to a later decision (`apply` says
    False), not waited for."""
    max_attempts: int = 5
    """Tries per call on 409/429/5xx or a connection error."""
    backoff_s: float = 0.5
    """The first retry's wait; doubles per retry up to 8 s."""
    ready_timeout_s: float = 600.0
    """A scale-up whose `status.readyReplicas` has not reached its target this long after its PATCH is warned
    about once (its pods Pending, crash-looping, or still loading a model)."""
    request_timeout_s: float = 10.0
    """Timeout of each API call."""


def check_kubernetes(config: KubernetesConfig) -> None:
    """ConfigError for a name the API server would refuse or a setting out of range."""
    if not _LABEL.fullmatch(config.namespace) or len(config.namespace) > 63:
        raise ConfigError(f"--k8s-namespace '{config.namespace}' is not a Kubernetes namespace name (a DNS-1123 label)")
    for flag, name in (("decode", config.decode_deployment), ("prefill", config.prefill_deployment)):
        if name is not None and (not _SUBDOMAIN.fullmatch(name) or len(name) > 253):
            raise ConfigError(
                f"--k8s-{flag}-deployment '{name}' is not a Deployment name (lowercase letters, digits, '-', '.')"
            )
    if config.kind not in WORKLOADS:
        raise ConfigError(f"--k8s-kind '{config.kind}' is not one of {', '.join(WORKLOADS)}")
    if config.min_patch_interval_s < 0 or config.ready_timeout_s < 0:
        raise ConfigError(
            f"--k8s-patch-interval and --k8s-ready-timeout must be >= 0, got {config.min_patch_interval_s} and "
            f"{config.ready_timeout_s}"
        )
    if config.max_attempts < 1 or config.backoff_s < 0 or config.request_timeout_s <= 0:
        raise ConfigError(f"the kubernetes connector needs positive attempts, waits and timeouts, got {config}")


@dataclass(slots=True)
class _ScaleUp:
    """A pool's latest scale-up, followed until its pods are ready."""

    wanted: int
    since: float
    """When its PATCH was accepted (monotonic)."""
    warned: bool = False
    """Not ready `ready_timeout_s` after it: said once."""


class PermissionDenied(Exception):
    """The API server answered 403: the planner's Role lacks `verb` on `resource`."""

    def __init__(self, verb: str, resource: str) -> None:
        self.verb, self.resource = verb, resource
        super().__init__(f"{verb} {resource}")


class CallFailed(Exception):
    """An API call failed for good (retries spent, or an error not worth retrying)."""


class _Pools:
    """The API calls of one kind of pool: a Deployment's through AppsV1Api, a LeaderWorkerSet's (a custom resource)
    through CustomObjectsApi; the same Scale subresource and `status.readyReplicas` either way."""

    def __init__(self, client: Any, api: Any, workload: Workload) -> None:
        self.workload = workload
        self._apps = client.AppsV1Api(api)
        self._custom = client.CustomObjectsApi(api)
        group, _, version = workload.api_version.partition("/")
        self._crd = (group, version)

    def read_scale(self, name: str, namespace: str, **kwargs: Any) -> int:
        if self.workload == DEPLOYMENT:
            return int(self._apps.read_namespaced_deployment_scale(name, namespace, **kwargs).spec.replicas or 0)
        scale = self._custom.get_namespaced_custom_object_scale(*self._path(namespace), name, **kwargs)
        return int((scale.get("spec") or {}).get("replicas") or 0)

    def patch_scale(self, name: str, namespace: str, body: dict[str, Any], **kwargs: Any) -> None:
        if self.workload == DEPLOYMENT:
            self._apps.patch_namespaced_deployment_scale(name, namespace, body, **kwargs)
        else:
            self._custom.patch_namespaced_custom_object_scale(*self._path(namespace), name, body, **kwargs)

    def read_ready(self, name: str, namespace: str, **kwargs: Any) -> int:
        if self.workload == DEPLOYMENT:
            deployment = self._apps.read_namespaced_deployment(name, namespace, **kwargs)
            return int((deployment.status.ready_replicas if deployment.status else None) or 0)
        found = self._custom.get_namespaced_custom_object(*self._path(namespace), name, **kwargs)
        return int((found.get("status") or {}).get("readyReplicas") or 0)

    def _path(self, namespace: str) -> tuple[str, str, str, str]:
        return (*self._crd, namespace, self.workload.plural)


class KubernetesConnector:
    """Sets each role's Deployment (LeaderWorkerSet) replicas through the Scale subresource and follows readiness."""

    def __init__(self, config: KubernetesConfig) -> None:
        self.config = config
        self._api_client = api_client(config.kubeconfig, NEEDED_BY)
        client, _ = client_modules(NEEDED_BY)
        self._pools = _Pools(client, self._api_client, WORKLOADS[config.kind])
        self._noun = config.kind.lower()
        """How the log lines name a pool's object: `deployment`, `leaderworkerset`."""
        self._api_exception: type[Exception] = client.ApiException
        self._next_id = 1
        self._last_patch: dict[str, float] = {}
        self._rising: dict[str, _ScaleUp] = {}
        """Deployments scaled up and not yet ready."""
        self._denied: set[str] = set()
        self._closed = False

    async def next_decision_id(self) -> int:
        return self._next_id

    async def apply(self, target: ScaleTarget) -> bool:
        """PATCH each pool whose replicas differ, both at once; True once every pool has its target accepted."""
        self._next_id = target.decision_id + 1
        pools = [("decode", self.config.decode_deployment, target.num_decode)]
        if self.config.prefill_deployment is not None:
            pools.append(("prefill", self.config.prefill_deployment, target.num_prefill))
        applied = await asyncio.gather(
            *(self._apply_pool(target.decision_id, role, name, self._clamp(n)) for role, name, n in pools)
        )
        return all(applied)

    async def _apply_pool(self, decision_id: int, role: str, name: str, wanted: int) -> bool:
        try:
            return await self._scale(role, name, wanted)
        except PermissionDenied as denied:
            self._warn_denied(denied)
        except CallFailed as failed:
            logger.warning("decision %d not applied to the %s pool: %s", decision_id, role, failed)
        return False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._api_client.close)

    def _clamp(self, wanted: int) -> int:
        return max(self.config.min_replicas, min(self.config.max_replicas, wanted))

    async def _scale(self, role: str, name: str, wanted: int) -> bool:
        """PATCH the scale when it differs (False: too soon after the last PATCH, left to the next decision), then
        follow the pool's latest scale-up."""
        ns, noun, scale = self.config.namespace, self._noun, f"{self._pools.workload.plural}/scale"
        current = await self._call("get", scale, self._pools.read_scale, name, ns)
        if current != wanted:
            since = time.monotonic() - self._last_patch.get(name, -math.inf)
            if since < self.config.min_patch_interval_s:
                logger.debug("%s: %s %s was patched %.1f s ago; left to a later decision", role, noun, name, since)
                return False
            body = {"spec": {"replicas": wanted}}
            await self._call("patch", scale, self._pools.patch_scale, name, ns, body, _content_type=MERGE_PATCH)
            self._last_patch[name] = time.monotonic()
            logger.info("%s: %s %s/%s replicas %d → %d", role, noun, ns, name, current, wanted)
            self._rising.pop(name, None)
            if wanted > current:
                self._rising[name] = _ScaleUp(wanted, time.monotonic())
        await self._follow(role, name)
        return True

    async def _follow(self, role: str, name: str) -> None:
        """One read of a scaled-up pool's ready replicas: done once they reach the target; warned about once when
        they have not `ready_timeout_s` after the PATCH."""
        rising = self._rising.get(name)
        if rising is None:
            return
        wanted, ns, noun = rising.wanted, self.config.namespace, self._noun
        ready = await self._call("get", self._pools.workload.plural, self._pools.read_ready, name, ns)
        waited = time.monotonic() - rising.since
        if ready >= wanted:
            del self._rising[name]
            logger.info("%s: %s %s/%s has its %d replicas ready (%.0f s)", role, noun, ns, name, wanted, waited)
        elif waited >= self.config.ready_timeout_s and not rising.warned:
            rising.warned = True
            logger.warning(
                "%s: %s %s/%s has %d of %d replicas ready %.0f s after its scale-up (pods pending or "
                "failing: `dyn k8s status` says why); the other pool scales regardless",
                role,
                noun,
                ns,
                name,
                ready,
                wanted,
                waited,
            )

    async def _call(self, verb: str, resource: str, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One API call in a thread under a timeout, retried with exponential backoff on 409/429/5xx."""
        import urllib3.exceptions

        timeout = self.config.request_timeout_s
        delay = self.config.backoff_s
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                async with asyncio.timeout(timeout + 1.0):
                    return await asyncio.to_thread(method, *args, _request_timeout=timeout, **kwargs)
            except self._api_exception as exc:
                status = getattr(exc, "status", None)
                if status == 403:
                    raise PermissionDenied(verb, resource) from None
                if status not in RETRIED_STATUSES:
                    raise CallFailed(
                        f"{verb} {resource} {args[0]}: HTTP {status} {getattr(exc, 'reason', '')}"
                    ) from None
                why = f"HTTP {status}"
            except (urllib3.exceptions.HTTPError, TimeoutError) as exc:
                why = type(exc).__name__
            if attempt == self.config.max_attempts:
                raise CallFailed(f"{verb} {resource} {args[0]}: {why} after {attempt} attempts")
            logger.info("%s %s %s: %s; retry %d in %.1f s", verb, resource, args[0], why, attempt, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 8.0)
        raise AssertionError("unreachable")

    def _warn_denied(self, denied: PermissionDenied) -> None:
        key = str(denied)
        level = logging.DEBUG if key in self._denied else logging.WARNING
        self._denied.add(key)
        plural = self._pools.workload.plural
        logger.log(
            level,
            "forbidden (403): the planner's service account may not %s %s in namespace %s; grant the verb in its "
            "Role (it needs get/patch on %s/scale and get on %s)",
            denied.verb,
            denied.resource,
            self.config.namespace,
            plural,
            plural,
        )
