"""Alerting rules as code: what a deployment's operator is paged for, rendered to a Prometheus rules file.

Each rule reads the frontend's `/metrics` (dynamo_cli/frontend/metrics.py). Annotations template labels only,
never `$value`, so `promtool test rules` can state them exactly (tests/monitoring/test_rules.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import yaml

from dynamo_cli.config.routing import QueueConfig
from dynamo_cli.errors import ConfigError

GROUP = "dynamo"
"""The rule group's name in the rendered file."""


@dataclass(frozen=True, slots=True)
class AlertTargets:
    """The numbers the alerts compare against; the defaults suit a mocker or small deployment."""

    ttft_target_s: float = 2.0
    """TTFT p90 (seconds) above which `DynamoTtftOverTarget` fires."""
    queue_wait_target_s: float = QueueConfig().max_wait_s / 2
    """Queue-wait p90 (seconds) above which `DynamoQueueTimingOut` fires. Half of the default
    `--router-queue-timeout`: histogram_quantile interpolates inside a bucket, so the p90 of waits that all
    reach the timeout reads below it."""
    window: str = "5m"
    """The rate window of the latency alerts and how long they must hold."""

    def __post_init__(self) -> None:
        if not self.ttft_target_s > 0 or not self.queue_wait_target_s > 0:
            raise ConfigError(
                f"alert targets must be > 0 (TTFT p90 {self.ttft_target_s} s, queue wait p90 "
                f"{self.queue_wait_target_s} s); pass a positive --ttft-target-ms"
            )


@dataclass(frozen=True, slots=True)
class AlertRule:
    """One Prometheus alerting rule."""

    name: str
    """The alert's name (`alertname`), CamelCase as Prometheus's own."""
    expr: str
    """PromQL: the alert fires for each series this returns, once it has for `hold`."""
    hold: str
    """How long `expr` must hold before the alert fires (the rule's `for`)."""
    severity: str
    """`critical` (pages) or `warning`."""
    summary: str
    """One line; may template the series' labels (`{{ $labels.model }}`)."""
    description: str
    """What it means and what to do."""

    def to_yaml_dict(self) -> dict[str, object]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.hold,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description},
        }


def alert_rules(targets: AlertTargets | None = None) -> list[AlertRule]:
    """Every alert of a deployment, thresholds from `targets` (the defaults when None)."""
    targets = targets or AlertTargets()
    return [
        _no_workers(),
        _ttft(targets),
        _queue(targets),
        _restarts(),
        _kv_transfer_failures(),
        _stalls(),
        _blind_routing(),
    ]


def render_rules(rules: Sequence[AlertRule]) -> str:
    """A Prometheus rules file (`rule_files:`) holding `rules` in one group."""
    document = {"groups": [{"name": GROUP, "rules": [rule.to_yaml_dict() for rule in rules]}]}
    return str(yaml.safe_dump(document, sort_keys=False, width=1000))


def _quantile(q: float, metric: str, window: str) -> str:
    return f"histogram_quantile({q}, sum by (model, le) (rate({metric}_bucket[{window}])))"


def _no_workers() -> AlertRule:
    return AlertRule(
        "DynamoNoWorkers",
        "dynamo_frontend_workers == 0",
        "1m",
        "critical",
        "No worker serves model {{ $labels.model }}",
        "Every request for the model is answered 503. Check the workers' processes and their registration (dyn ls).",
    )


def _ttft(targets: AlertTargets) -> AlertRule:
    return AlertRule(
        "DynamoTtftOverTarget",
        f"{_quantile(0.9, 'dynamo_frontend_time_to_first_token_seconds', targets.window)} > {targets.ttft_target_s}",
        targets.window,
        "warning",
        f"TTFT p90 of model {{{{ $labels.model }}}} is over {targets.ttft_target_s} s",
        "Prompts wait too long for their first token: add workers (prefill workers if disaggregated), or check "
        "the KV cache hit rate and queue wait.",
    )


def _queue(targets: AlertTargets) -> AlertRule:
    return AlertRule(
        "DynamoQueueTimingOut",
        f"{_quantile(0.9, 'dynamo_frontend_queue_wait_seconds', targets.window)} > {targets.queue_wait_target_s}",
        targets.window,
        "warning",
        f"Queued requests for model {{{{ $labels.model }}}} wait over {targets.queue_wait_target_s} s (p90)",
        "Every worker is busy and queued requests near --router-queue-timeout are answered 503: add workers or "
        "raise the busy thresholds.",
    )


def _restarts() -> AlertRule:
    return AlertRule(
        "DynamoWorkerRestarts",
        "increase(dynamo_frontend_worker_restarts_total[15m]) > 0",
        "0s",
        "warning",
        "dyn serve restarted a worker that exited",
        "A worker process died and was restarted; its log says why. Repeated restarts point at the engine or "
        "its memory.",
    )


def _kv_transfer_failures() -> AlertRule:
    return AlertRule(
        "DynamoKvTransferFailures",
        'sum by (model) (increase(dynamo_frontend_kv_transfer_seconds_count{backend="local"}[10m])) > 0',
        "0s",
        "warning",
        "KV pulls fail for model {{ $labels.model }}",
        "Decode workers could not pull remotely prefilled KV and prefilled locally: check the KV transfer plane "
        "(--kv-transfer) between prefill and decode workers.",
    )


def _stalls() -> AlertRule:
    return AlertRule(
        "DynamoWorkerStalls",
        "sum by (model, worker_id) (increase(dynamo_frontend_worker_stalls_total[10m])) > 0",
        "0s",
        "warning",
        "Worker {{ $labels.worker_id }} of model {{ $labels.model }} stalled",
        "The worker stopped producing tokens and was taken out of routing; its streams migrated. Check the "
        "process (stopped, swapping, a hung engine).",
    )


def _blind_routing() -> AlertRule:
    return AlertRule(
        "DynamoKvRoutingBlind",
        "min by (model, worker_id) (dynamo_frontend_worker_kv_events) == 0",
        "15m",
        "warning",
        "The KV router routes to worker {{ $labels.worker_id }} of model {{ $labels.model }} approximately",
        "No KV event of the worker has reached the router, so its cache is guessed from the router's own decisions. "
        "An engine server behind --engine http publishes them with its own flag (vLLM: --kv-events-config) and the "
        "worker's --engine-arg kv_events=tcp://HOST:PORT; other workers reach the router over the event plane.",
    )
