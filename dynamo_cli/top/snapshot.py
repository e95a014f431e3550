"""One reading of a frontend's /metrics: the `dynamo_frontend_*` series `dyn top` shows, per model and per
worker, cumulative as the frontend exports them (rates and quantiles take two readings: frame.py).

A series the frontend does not export (an older frontend, a feature not in use) reads as 0."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "dynamo_frontend_"

Series = dict[str, list[tuple[dict[str, str], float]]]
"""Sample name (`dynamo_frontend_requests_total`, `…_bucket`) → (labels, value) of each sample."""


@dataclass(frozen=True, slots=True)
class Buckets:
    """A Prometheus histogram of one model: cumulative counts by upper bound."""

    bounds: tuple[float, ...] = ()
    """Upper bounds (`le`), ascending, `inf` last."""
    counts: tuple[float, ...] = ()
    """Observations at or under each bound (cumulative, as `_bucket{le=…}` reads)."""

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, before: Buckets) -> Buckets:
        """The observations since `before`; a reset counter (fewer now than then) or other bounds: these whole."""
        if before.bounds != self.bounds or any(n < b for n, b in zip(self.counts, before.counts, strict=True)):
            return self
        return Buckets(self.bounds, tuple(n - b for n, b in zip(self.counts, before.counts, strict=True)))


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One worker of one model, as the frontend last saw it (`dynamo_frontend_worker_*`)."""

    model: str
    worker_id: str
    """Hex, as the frontend labels it."""
    role: str
    """both | prefill | decode (`worker_type`)."""
    num_running: float
    num_waiting: float
    active_blocks: float
    total_blocks: float
    num_inflight: float
    """Streams this frontend has open on the worker."""
    num_requests: float
    """Requests the worker served part of, cumulative."""
    kv_events: float = -1.0
    """1: the KV router routes to it from its KV events; 0: approximately; -1: not by KV (or not exported)."""


@dataclass(frozen=True, slots=True)
class ModelSample:
    """One model's frontend-wide series, cumulative where they are counters."""

    name: str
    num_requests: float
    """Requests finished (`requests_total`, every status)."""
    num_inflight: float
    num_queued: float
    """Waiting for a free worker now."""
    ttft: Buckets
    itl: Buckets
    disagg: dict[str, float]
    """Disaggregation decisions by outcome (remote, local, local_fallback ...)."""
    transfer_bytes: float
    """KV bytes pulled by decode workers."""
    transfer_seconds: float
    """Time those pulls took (the histogram's sum)."""
    num_migrations: float
    prefix_blocks: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """The KV router's (request, achieved hit, reachable hit) prompt blocks, cumulative (`dynamo_router_counter`)."""


@dataclass(frozen=True, slots=True)
class TenantSample:
    """One tenant's series (`dynamo_frontend_tenant_*`), cumulative."""

    name: str
    num_requests: float
    """Requests ended, every status (refused ones too)."""
    num_tokens: float
    """Prompt and output tokens."""
    queue_wait: Buckets
    num_rejections: float
    """429s, every limit."""


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """A frontend's /metrics at one moment."""

    at: float
    """Monotonic time of the reading, seconds."""
    models: dict[str, ModelSample]
    workers: dict[tuple[str, str], WorkerSample]
    """(model, worker id) → the worker."""
    num_stalls: float
    """Workers found stalled (`worker_stalls_total`), every label summed."""
    num_restarts: float
    """Workers `dyn serve` restarted."""
    tenants: dict[str, TenantSample] = dataclasses.field(default_factory=dict)


def read_series(text: str) -> Series:
    """Every sample of the exposition by name; ValueError when the text is not Prometheus's text format."""
    series: Series = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                series.setdefault(sample.name, []).append((sample.labels, sample.value))
    except (IndexError, KeyError, TypeError) as exc:  # the parser's other ways of saying "not this format"
        raise ValueError(f"unparsable ({type(exc).__name__}: {exc})") from None
    return series


def parse_snapshot(text: str, at: float) -> MetricsSnapshot:
    """The snapshot in a frontend's /metrics text; ValueError when it is not one (no `dynamo_frontend_*`)."""
    series = read_series(text)
    ours = [name for name in series if name.startswith(PREFIX)]
    if not ours:
        raise ValueError(f"no {PREFIX}* series: is this a dyn frontend?")
    names = sorted({labels["model"] for name in ours for labels, _ in series[name] if "model" in labels})
    workers = _workers(series)
    return MetricsSnapshot(
        at=at,
        models={name: _model(series, name) for name in names},
        workers={(w.model, w.worker_id): w for w in workers},
        num_stalls=_total(series, "worker_stalls_total"),
        num_restarts=_total(series, "worker_restarts_total"),
        tenants=_tenants(series),
    )


def _total(series: Series, name: str, model: str | None = None, label: str = "model") -> float:
    """The sum of a series' samples (of one model's only, when given; or of what `label` names)."""
    return sum(v for labels, v in series.get(PREFIX + name, ()) if model is None or labels.get(label) == model)


def _tenants(series: Series) -> dict[str, TenantSample]:
    kinds = ("requests", "tokens", "rejections")
    names = sorted({labels["tenant"] for k in kinds for labels, _ in series.get(f"{PREFIX}tenant_{k}_total", ())})
    return {
        name: TenantSample(
            name=name,
            num_requests=_total(series, "tenant_requests_total", name, "tenant"),
            num_tokens=_total(series, "tenant_tokens_total", name, "tenant"),
            queue_wait=_buckets(series, "tenant_queue_wait_seconds", name, "tenant"),
            num_rejections=_total(series, "tenant_rejections_total", name, "tenant"),
        )
        for name in names
    }


def _model(series: Series, name: str) -> ModelSample:
    disagg: dict[str, float] = {}
    for labels, value in series.get(f"{PREFIX}disagg_decisions_total", ()):
        if labels.get("model") == name:
            disagg[labels.get("outcome", "")] = disagg.get(labels.get("outcome", ""), 0.0) + value
    return ModelSample(
        name=name,
        num_requests=_total(series, "requests_total", name),
        num_inflight=_total(series, "inflight_requests", name),
        num_queued=_total(series, "queued_requests", name),
        ttft=_buckets(series, "time_to_first_token_seconds", name),
        itl=_buckets(series, "inter_token_latency_seconds", name),
        disagg=disagg,
        transfer_bytes=_total(series, "kv_transfer_bytes_total", name),
        transfer_seconds=_total(series, "kv_transfer_seconds_sum", name),
        num_migrations=_total(series, "model_migration_total", name),
        prefix_blocks=_router_blocks(series, name),
    )


ROUTER_COUNTERS = ("num_request_blocks", "num_hit_blocks", "num_reachable_hit_blocks")


def _router_blocks(series: Series, model: str) -> tuple[float, float, float]:
    """A model's KV router counters in ROUTER_COUNTERS' order (zeros for a router that does not count them)."""
    counters = {
        labels.get("name"): value
        for labels, value in series.get("dynamo_router_counter", ())
        if labels.get("model") == model
    }
    request, hit, reachable = (counters.get(name, 0.0) for name in ROUTER_COUNTERS)
    return request, hit, reachable


def _buckets(series: Series, name: str, model: str, label: str = "model") -> Buckets:
    """One model's histogram (or what `label` names), its buckets summed by bound (one per bound from one
    frontend)."""
    by_bound: dict[float, float] = {}
    for labels, value in series.get(f"{PREFIX}{name}_bucket", ()):
        if labels.get(label) == model and "le" in labels:
            bound = float(labels["le"])
            by_bound[bound] = by_bound.get(bound, 0.0) + value
    if not by_bound or not math.isinf(max(by_bound)):
        return Buckets()  # no histogram, or one without its +Inf bucket: nothing to read a quantile from
    bounds = tuple(sorted(by_bound))
    return Buckets(bounds, tuple(by_bound[b] for b in bounds))


_WORKER_GAUGES = {
    "num_running": "worker_running_requests",
    "num_waiting": "worker_waiting_requests",
    "active_blocks": "worker_active_decode_blocks",
    "total_blocks": "worker_total_blocks",
    "num_inflight": "worker_inflight_requests",
    "kv_events": "worker_kv_events",
}
"""WorkerSample field → the gauge it is read from (`dynamo_frontend_` + name)."""


def _workers(series: Series) -> list[WorkerSample]:
    """Every worker the frontend lists (gauges: present while registered), with its requests counter; a worker of
    several data-parallel ranks is one line per rank, `worker/rank` (its requests on its first rank's line)."""
    values: dict[tuple[str, str, str, str], dict[str, float]] = {}
    for field, name in _WORKER_GAUGES.items():
        for labels, value in series.get(PREFIX + name, ()):
            get = labels.get
            key = (get("model", ""), get("worker_id", ""), get("dp_rank", "0"), get("worker_type", ""))
            values.setdefault(key, {})[field] = value
    requests: dict[tuple[str, str], float] = {}
    for labels, value in series.get(f"{PREFIX}worker_requests_total", ()):
        key2 = (labels.get("model", ""), labels.get("worker_id", ""))
        requests[key2] = requests.get(key2, 0.0) + value
    ranks: dict[tuple[str, str], list[str]] = {}
    for model, worker_id, rank, _ in sorted(values, key=lambda k: (k[0], k[1], int(k[2]) if k[2].isdigit() else 0)):
        ranks.setdefault((model, worker_id), []).append(rank)
    return [
        WorkerSample(
            model=model,
            worker_id=worker_id if len(ranks[model, worker_id]) == 1 else f"{worker_id}/{rank}",
            role=role,
            num_running=got.get("num_running", 0.0),
            num_waiting=got.get("num_waiting", 0.0),
            active_blocks=got.get("active_blocks", 0.0),
            total_blocks=got.get("total_blocks", 0.0),
            num_inflight=got.get("num_inflight", 0.0),
            num_requests=requests.get((model, worker_id), 0.0) if rank == ranks[model, worker_id][0] else 0.0,
            kv_events=got.get("kv_events", -1.0),
        )
        for (model, worker_id, rank, role), got in sorted(values.items())
    ]
