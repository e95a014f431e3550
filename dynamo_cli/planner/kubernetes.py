"""The `kubernetes` connector: a planner decision becomes each role's Deployment `replicas`, set through the
Scale subresource with the official client.

Only `PATCH …/deployments/{name}/scale` with `{"spec": {"replicas": N}}` is sent, and only when `spec.replicas`
differs: a scaler that patches the pod template rolls every pod instead of adding or removing some. A scale-up
counts as served once the Deployment's `status.readyReplicas` reaches the target (the role the local
connector's startup time plays); a scale-down once the PATCH is accepted (Kubernetes drains the pods).
The client is blocking: each call runs in a thread under a timeout. The planner's RBAC needs `get`/`patch`
on `deployments/scale` and `get` on `deployments`; a 403 is one warning naming the verb, and `apply` says False.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dynamo_cli.errors import ConfigError
from dynamo_cli.k8s.client import api_client, client_modules
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
    kubeconfig: str | None = None
    """A kubeconfig file; None: in-cluster config, else `KUBECONFIG` (or ~/.kube/config)."""
    min_replicas: int = 0
    """Each Deployment's replicas are clamped to at least this."""
    max_replicas: int = 8
    """… and at most this."""
    min_patch_interval_s: float = 5.0
    """Least time between two PATCHes of one Deployment; a sooner one waits for it."""
    max_attempts: int = 5
    """Tries per call on 409/429/5xx or a connection error."""
    backoff_s: float = 0.5
    """The first retry's wait; doubles per retry up to 8 s."""
    ready_timeout_s: float = 600.0
    """Longest wait for `status.readyReplicas` to reach a scale-up's target."""
    ready_poll_s: float = 2.0
    """`status.readyReplicas` polling period."""
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
    if config.min_patch_interval_s < 0 or config.ready_timeout_s < 0:
        raise ConfigError(
            f"--k8s-patch-interval and --k8s-ready-timeout must be >= 0, got {config.min_patch_interval_s} and "
            f"{config.ready_timeout_s}"
        )
    if config.max_attempts < 1 or min(config.backoff_s, config.ready_poll_s) < 0 or config.request_timeout_s <= 0:
        raise ConfigError(f"the kubernetes connector needs positive attempts, waits and timeouts, got {config}")


class PermissionDenied(Exception):
    """The API server answered 403: the planner's Role lacks `verb` on `resource`."""

    def __init__(self, verb: str, resource: str) -> None:
        self.verb, self.resource = verb, resource
        super().__init__(f"{verb} {resource}")


class CallFailed(Exception):
    """An API call failed for good (retries spent, or an error not worth retrying)."""


class KubernetesConnector:
    """Sets each role's Deployment replicas through the Scale subresource and waits for readiness."""

    def __init__(self, config: KubernetesConfig) -> None:
        self.config = config
        self._api_client = api_client(config.kubeconfig, NEEDED_BY)
        client, _ = client_modules(NEEDED_BY)
        self._apps = client.AppsV1Api(self._api_client)
        self._api_exception: type[Exception] = client.ApiException
        self._next_id = 1
        self._last_patch: dict[str, float] = {}
        self._denied: set[str] = set()
        self._closed = False

    async def next_decision_id(self) -> int:
        return self._next_id

    async def apply(self, target: ScaleTarget) -> bool:
        self._next_id = target.decision_id + 1
        roles = [("decode", self.config.decode_deployment, target.num_decode)]
        if self.config.prefill_deployment is not None:
            roles.insert(0, ("prefill", self.config.prefill_deployment, target.num_prefill))
        try:
            for role, name, wanted in roles:
                if not await self._scale(role, name, self._clamp(wanted)):
                    return False
        except PermissionDenied as denied:
            self._warn_denied(denied)
            return False
        except CallFailed as failed:
            logger.warning("decision %d not applied: %s", target.decision_id, failed)
            return False
        return True

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._api_client.close)

    def _clamp(self, wanted: int) -> int:
        return max(self.config.min_replicas, min(self.config.max_replicas, wanted))

    async def _scale(self, role: str, name: str, wanted: int) -> bool:
        """PATCH the scale when it differs; True once `wanted` pods are ready (scale-down: once accepted)."""
        ns = self.config.namespace
        scale = await self._call("get", "deployments/scale", self._apps.read_namespaced_deployment_scale, name, ns)
        current = scale.spec.replicas or 0
        if current != wanted:
            await self._wait_patch_interval(name)
            body = {"spec": {"replicas": wanted}}
            patch = self._apps.patch_namespaced_deployment_scale
            await self._call("patch", "deployments/scale", patch, name, ns, body, _content_type=MERGE_PATCH)
            self._last_patch[name] = time.monotonic()
            logger.info("%s: deployment %s/%s replicas %d → %d", role, ns, name, current, wanted)
        return await self._wait_ready(role, name, wanted)

    async def _wait_patch_interval(self, name: str) -> None:
        last = self._last_patch.get(name)
        if last is not None:
            left = last + self.config.min_patch_interval_s - time.monotonic()
            if left > 0:
                logger.debug("deployment %s was patched %.1f s ago; waiting %.1f s", name, -left, left)
                await asyncio.sleep(left)

    async def _wait_ready(self, role: str, name: str, wanted: int) -> bool:
        ns, deadline = self.config.namespace, time.monotonic() + self.config.ready_timeout_s
        while True:
            deployment = await self._call("get", "deployments", self._apps.read_namespaced_deployment, name, ns)
            ready = (deployment.status.ready_replicas if deployment.status else None) or 0
            if ready >= wanted:
                return True
            if time.monotonic() >= deadline:
                logger.warning(
                    "%s: deployment %s/%s has %d of %d replicas ready after %.0f s",
                    role,
                    ns,
                    name,
                    ready,
                    wanted,
                    self.config.ready_timeout_s,
                )
                return False
            await asyncio.sleep(min(self.config.ready_poll_s, max(0.0, deadline - time.monotonic())))

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
        logger.log(
            level,
            "forbidden (403): the planner's service account may not %s %s in namespace %s; grant the verb in its "
            "Role (it needs get/patch on deployments/scale and get on deployments)",
            denied.verb,
            denied.resource,
            self.config.namespace,
        )
