"""What `dyn top` shows, from two snapshots of a frontend's /metrics: per model and per worker, rates over
the interval between them and latency quantiles of the observations made in it.

NOTE: quantiles come from the histograms' bucket counts as Prometheus's `histogram_quantile` reads them
(linear inside the bucket the rank falls in), so they are only as fine as the buckets. An interval with no
observation (idle, or the first reading) shows the whole history instead, flagged `is_since_start`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynamo_cli.top.snapshot import Buckets, MetricsSnapshot, ModelSample, TenantSample, WorkerSample

QUANTILES = (0.5, 0.99)


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile (0 ≤ q ≤ 1) of a histogram, as Prometheus computes it; None with no observation.

    The rank q·total falls in the first bucket whose count reaches it; the value is interpolated linearly
    between that bucket's lower and upper bound (the first bucket starts at 0). A rank in the +Inf bucket
    gives the highest finite bound."""
    total = buckets.total
    if total <= 0 or len(buckets.bounds) < 2:
        return None
    rank = q * total
    finite = len(buckets.bounds) - 1
    index = next((i for i in range(finite) if buckets.counts[i] >= rank), finite)
    if index == finite:
        return buckets.bounds[finite - 1]
    upper = buckets.bounds[index]
    if index == 0 and upper <= 0:
        return upper
    lower, below = (buckets.bounds[index - 1], buckets.counts[index - 1]) if index else (0.0, 0.0)
    in_bucket = buckets.counts[index] - below
    return lower + (upper - lower) * (rank - below) / in_bucket


@dataclass(frozen=True, slots=True)
class Latency:
    """Quantiles of one latency (seconds) over the interval, or over the whole history when it had none."""

    p50: float | None
    p99: float | None
    is_since_start: bool
    """No observation in the interval: these are the cumulative histogram's."""


def latency(now: Buckets, before: Buckets | None) -> Latency:
    """The quantiles of the observations since `before`; of all of them when there is none since (or no
    `before`: the first reading)."""
    window = now.minus(before) if before is not None else Buckets()
    is_since_start = window.total <= 0
    p50, p99 = (histogram_quantile(q, now if is_since_start else window) for q in QUANTILES)
    return Latency(p50, p99, is_since_start and now.total > 0)


@dataclass(frozen=True, slots=True)
class WorkerRow:
    """One worker's line."""

    worker_id: str
    role: str
    num_running: float
    num_waiting: float
    kv_usage: float | None
    """Fraction of its KV blocks in use (None: it reported no capacity)."""
    num_inflight: float
    num_requests: float
    """Requests it served part of, since the frontend started."""
    requests_per_s: float
    routing: str = "-"
    """How the KV router sees its cache: events | approximate | - (a router that does not route by KV)."""


@dataclass(frozen=True, slots=True)
class ModelRow:
    """One model's figures and its workers, prefill workers last."""

    name: str
    requests_per_s: float
    ttft: Latency
    itl: Latency
    num_queued: float
    num_inflight: float
    disagg: dict[str, float]
    """Disaggregation decisions by outcome, since the frontend started."""
    transfer_gbps: float | None
    """KV bytes pulled per second of pulling, over the interval (None: no pull ever)."""
    is_transfer_since_start: bool
    """No pull in the interval: `transfer_gbps` is over the whole history."""
    num_migrations: float
    workers: tuple[WorkerRow, ...]
    prefix_hits: tuple[float, float] | None = None
    """The KV router's achieved and reachable prefix hits, as fractions of the prompt blocks it routed since the
    frontend started (None: it routed none, or does not route by KV)."""


@dataclass(frozen=True, slots=True)
class TenantRow:
    """One tenant's line: its rates over the interval, its queue wait, its 429s since the frontend started."""

    name: str
    requests_per_s: float
    tokens_per_s: float
    queue_wait: Latency
    num_rejections: float


@dataclass(frozen=True, slots=True)
class TopFrame:
    """Everything one refresh shows."""

    interval_s: float
    """Seconds between the two readings (0: one reading only, so no rates)."""
    models: tuple[ModelRow, ...]
    num_stalls: float
    num_restarts: float
    tenants: tuple[TenantRow, ...] = ()


def rate(now: float, before: float | None, seconds: float) -> float:
    """A counter's increase per second; a reset counter (lower now) counts from 0, as Prometheus's rate does."""
    if before is None or seconds <= 0:
        return 0.0
    increase = now - before if now >= before else now
    return increase / seconds


def frame_between(before: MetricsSnapshot | None, now: MetricsSnapshot) -> TopFrame:
    """The rows for the interval from `before` to `now` (`before` None: the first reading, no rates)."""
    seconds = now.at - before.at if before is not None else 0.0
    models = tuple(_model_row(before, now, model, seconds) for model in now.models.values())
    tenants = tuple(_tenant_row(before, tenant, seconds) for tenant in now.tenants.values())
    return TopFrame(seconds, models, now.num_stalls, now.num_restarts, tenants)


def _tenant_row(before: MetricsSnapshot | None, tenant: TenantSample, seconds: float) -> TenantRow:
    then = None
    if before is not None:  # a tenant first seen in the interval counted from 0
        then = before.tenants.get(tenant.name, TenantSample(tenant.name, 0.0, 0.0, Buckets(), 0.0))
    return TenantRow(
        name=tenant.name,
        requests_per_s=rate(tenant.num_requests, then.num_requests if then else None, seconds),
        tokens_per_s=rate(tenant.num_tokens, then.num_tokens if then else None, seconds),
        queue_wait=latency(tenant.queue_wait, then.queue_wait if then else None),
        num_rejections=tenant.num_rejections,
    )


def _model_row(before: MetricsSnapshot | None, now: MetricsSnapshot, model: ModelSample, seconds: float) -> ModelRow:
    then = before.models.get(model.name) if before is not None else None
    workers = sorted(
        (w for w in now.workers.values() if w.model == model.name),
        key=lambda w: (w.role == "prefill", w.worker_id),
    )
    gbps = _transfer_gbps(model, then)
    return ModelRow(
        name=model.name,
        requests_per_s=rate(model.num_requests, then.num_requests if then else None, seconds),
        ttft=latency(model.ttft, then.ttft if then else None),
        itl=latency(model.itl, then.itl if then else None),
        num_queued=model.num_queued,
        num_inflight=model.num_inflight,
        disagg=dict(model.disagg),
        transfer_gbps=gbps if gbps is not None else _transfer_gbps(model, None),
        is_transfer_since_start=gbps is None and model.transfer_seconds > 0,
        num_migrations=model.num_migrations,
        workers=tuple(_worker_row(w, before, seconds) for w in workers),
        prefix_hits=_prefix_hits(model),
    )


def _prefix_hits(model: ModelSample) -> tuple[float, float] | None:
    request, hit, reachable = model.prefix_blocks
    return (hit / request, reachable / request) if request > 0 else None


def _transfer_gbps(now: ModelSample, before: ModelSample | None) -> float | None:
    nbytes = now.transfer_bytes - (before.transfer_bytes if before else 0.0)
    seconds = now.transfer_seconds - (before.transfer_seconds if before else 0.0)
    if seconds <= 0 or nbytes < 0 or not math.isfinite(nbytes / seconds):
        return None
    return nbytes / seconds / 1e9


def _worker_row(worker: WorkerSample, before: MetricsSnapshot | None, seconds: float) -> WorkerRow:
    then = before.workers.get((worker.model, worker.worker_id)) if before is not None else None
    return WorkerRow(
        worker_id=worker.worker_id,
        role=worker.role,
        num_running=worker.num_running,
        num_waiting=worker.num_waiting,
        kv_usage=worker.active_blocks / worker.total_blocks if worker.total_blocks > 0 else None,
        num_inflight=worker.num_inflight,
        num_requests=worker.num_requests,
        requests_per_s=rate(worker.num_requests, then.num_requests if then else None, seconds),
        routing=ROUTING.get(worker.kv_events, "-"),
    )


ROUTING = {1.0: "events", 0.0: "approximate"}
"""`dynamo_frontend_worker_kv_events` -> how a worker's line names it."""
