"""`dyn k8s render --keda-prometheus URL`: KEDA scales each worker pool on its workers' own load, the alternative to
the planner (dynamo_cli/k8s/keda.py writes the ScaledObjects). One writer per replica count: refused with
`--planner`, and with a worker count of its own (`--workers`), which a re-apply would reset KEDA's to.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from dynamo_cli.cli.k8s_target import opt, refuse_pool_counts
from dynamo_cli.errors import ConfigError
from dynamo_cli.k8s.keda import MAX_COOLDOWN_S, KedaScaling

KEDA = [
    opt(
        "keda_prometheus",
        "--keda-prometheus",
        str | None,
        None,
        "URL of a Prometheus scraping the pods (e.g. via --pod-monitor): a KEDA ScaledObject per worker pool scales "
        "it on its workers' running + waiting requests (not with --planner).",
    ),
    opt(
        "keda_requests_per_worker",
        "--keda-requests-per-worker",
        float | None,
        None,
        "--keda-prometheus: running + waiting requests one worker is sized for (the trigger's threshold; required).",
    ),
    opt("keda_min_workers", "--keda-min-workers", int, 1, "--keda-prometheus: fewest workers per pool (>= 1)."),
    opt("keda_max_workers", "--keda-max-workers", int, 8, "--keda-prometheus: most workers per pool."),
    opt(
        "keda_cooldown",
        "--keda-cooldown",
        int,
        600,
        "--keda-prometheus: seconds a pool's load must stay low before a worker is removed (at least a worker's "
        f"start-up; at most {MAX_COOLDOWN_S}).",
    ),
]
"""Render's KEDA options (in its Kubernetes panel)."""


def keda_scaling(values: dict[str, Any]) -> KedaScaling | None:
    """`--keda-*`, popped from `values` and checked against the flags left there (`--planner`, the worker counts),
    which it reads only."""
    given = {p.name: values.pop(p.name) for p in KEDA}
    if given["keda_prometheus"] is None:
        named = [p.name for p in KEDA[1:] if given[p.name] != p.default]
        if named:
            raise ConfigError(f"--{_flag(named[0])} needs --keda-prometheus")
        return None
    _check_one_writer(values)
    if given["keda_requests_per_worker"] is None or given["keda_requests_per_worker"] <= 0:
        raise ConfigError(
            "--keda-prometheus needs --keda-requests-per-worker N > 0: the running + waiting requests one worker "
            "serves within your latency targets (measure it, e.g. with dyn bench at rising concurrency)"
        )
    keda = KedaScaling(
        prometheus=_prometheus(given["keda_prometheus"]),
        requests_per_worker=given["keda_requests_per_worker"],
        min_workers=given["keda_min_workers"],
        max_workers=given["keda_max_workers"],
        cooldown_s=given["keda_cooldown"],
    )
    _check_bounds(keda)
    return keda


def _check_one_writer(values: dict[str, Any]) -> None:
    if values["planner"]:
        raise ConfigError(
            "--keda-prometheus and --planner would both set the worker pools' replicas (two writers of one count "
            "undo each other's decisions); pick one"
        )
    hint = "give their bounds with --keda-min-workers and --keda-max-workers"
    refuse_pool_counts(values, "--keda-prometheus", "KEDA", hint)


def _check_bounds(keda: KedaScaling) -> None:
    if keda.min_workers < 1:
        raise ConfigError(
            f"--keda-min-workers must be >= 1, got {keda.min_workers}: with no worker no load reaches the metric "
            "and the model leaves /v1/models, so the pool would never scale up again"
        )
    if keda.max_workers < keda.min_workers:
        raise ConfigError(
            f"--keda-max-workers ({keda.max_workers}) is below --keda-min-workers ({keda.min_workers}); raise it"
        )
    if not 0 <= keda.cooldown_s <= MAX_COOLDOWN_S:
        raise ConfigError(
            f"--keda-cooldown must be between 0 and {MAX_COOLDOWN_S} s (the HPA's stabilization window), "
            f"got {keda.cooldown_s}"
        )


def _prometheus(url: str) -> str:
    """An http(s) URL with a host and no credentials (they would be in the manifests)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(
            f"--keda-prometheus '{url}' must be the http:// or https:// URL of a Prometheus server, "
            "e.g. http://prometheus.monitoring:9090"
        )
    if parsed.username or parsed.password:
        raise ConfigError(
            "--keda-prometheus holds a user or password, which would be written into the manifests; give KEDA a "
            "TriggerAuthentication instead (docs/guides/kubernetes.md, Scaling)"
        )
    return url


def _flag(name: str) -> str:
    return name.replace("_", "-")
