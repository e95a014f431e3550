"""The frontend's Prometheus metrics, with Dynamo's `dynamo_frontend_*` names."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram

from dynamo_cli.core.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, DispatchSeries
from dynamo_cli.core.registry import Worker
from dynamo_cli.frontend.tenants import TenantSeries
from dynamo_cli.kv.tier_stats import KVBM_SERIES
from dynamo_cli.kv.tiers import KvTierStats

WORKER_SERIES = {
    "active_decode_blocks": "KV blocks in use on the worker (its last load report)",
    "active_prefill_tokens": "Prompt tokens the worker is prefilling (its last load report)",
    "total_blocks": "KV blocks the worker has (its last load report)",
    "running_requests": "Requests the worker is running (its last load report)",
    "waiting_requests": "Requests waiting in the worker's scheduler (its last load report)",
    "inflight_requests": "Streams this frontend has open on the worker",
    "lora_adapters_loaded": "LoRA adapters loaded on the worker now (its last load report)",
    "lora_loads": "LoRA adapter loads on the worker since it started, reloads after an eviction included",
    "kv_events": "1: the KV router routes to the worker from its KV events; 0: approximately, from its own decisions "
    "(the worker publishes none); -1: the router does not route by KV",
}
"""Per-worker gauges `dynamo_frontend_worker_{name}`, labelled model, worker_id, dp_rank, worker_type."""


class FrontendMetrics(DispatchSeries):
    """One registry per app (no global state): the dispatch series (core/metrics.py) and the frontend's own."""

    def __init__(self, prefix: str = "dynamo_frontend", *, gc: bool = True) -> None:
        """`gc`: count garbage collections here (a process that serves the global registry too has them there)."""
        self.registry = r = CollectorRegistry()
        if gc:
            GCCollector(registry=r)  # python_gc_collections_total by generation: collections stall the event loop
        super().__init__(r, prefix)
        self.requests = Counter(
            f"{prefix}_requests", "Requests", ["model", "endpoint", "request_type", "status"], registry=r
        )
        self.inflight = Gauge(f"{prefix}_inflight_requests", "Requests in flight", ["model"], registry=r)
        self.disconnected = Counter(f"{prefix}_disconnected_clients", "Clients gone mid-request", ["model"], registry=r)
        self.cached = Histogram(
            f"{prefix}_cached_tokens", "Prefix-cache hits", ["model"], buckets=TOKEN_BUCKETS, registry=r
        )
        self.duration = Histogram(
            f"{prefix}_request_duration_seconds", "e2e", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.output_tokens = Counter(f"{prefix}_output_tokens", "Output tokens", ["model"], registry=r)
        self.cancellations = Counter(f"{prefix}_model_cancellation", "Cancelled requests", ["model"], registry=r)
        self.worker_restarts = Counter(f"{prefix}_worker_restarts", "Workers restarted by dyn serve", registry=r)
        self.frontend_restarts = Counter(
            f"{prefix}_frontend_restarts", "Frontend processes restarted by dyn serve --frontends", registry=r
        )
        self.refused = Counter(f"{prefix}_auth_refused", "Refused by API key or per-key limit", ["code"], registry=r)
        self.tenants = TenantSeries(r, prefix)
        self.router = Gauge("dynamo_router_counter", "KV router counters (monotonic)", ["model", "name"], registry=r)
        self.kvbm = {
            name: Gauge(
                name, f"KV tiers: {field} (cumulative unless a holding or rate)", ["model", "worker"], registry=r
            )
            for name, field in KVBM_SERIES.items()
        }
        worker_labels = ["model", "worker_id", "dp_rank", "worker_type"]
        self.worker_gauges = {
            name: Gauge(f"{prefix}_worker_{name}", help, worker_labels, registry=r)
            for name, help in WORKER_SERIES.items()
        }
        self._worker_series: set[tuple[str, int, str, str]] = set()
        """(model, worker id, rank, role) of every series, so that a worker that left loses them."""

    def export_kv_tiers(self, model: str, worker_id: int, stats: KvTierStats) -> None:
        """A worker's KV tier counters, as it last published them (`LoadMetrics.kv_tiers`)."""
        for name, field in KVBM_SERIES.items():
            self.kvbm[name].labels(model, f"{worker_id:x}").set(getattr(stats, field))

    def export_router(self, model: str, counters: dict[str, int]) -> None:
        """Copy a KV policy's counters (decisions, hit blocks, reachable hit blocks ...) into gauges."""
        for name, value in counters.items():
            self.router.labels(model, name).set(value)

    def export_workers(self, workers: Iterable[tuple[str, Worker, frozenset[int] | None]]) -> None:
        """Every (model, worker)'s load and in-flight streams now, one series per data-parallel rank of a worker
        serving several (its streams and adapters on its first rank's); a worker no longer listed (or counted in
        `count_served` and gone before this scrape) loses its series. With each worker, the workers its model's router
        routes from their KV events (None: a router blind to caches)."""
        now: set[tuple[str, int, str, str]] = set()
        for model, worker, precise in workers:
            for rank, values in _rank_values(worker, precise):
                now.add((model, worker.instance_id, rank, worker.card.role))
                for name, value in values.items():
                    self.worker_gauges[name].labels(model, f"{worker.instance_id:x}", rank, worker.card.role).set(value)
        for model, worker_id, rank, role in self._worker_series - now:
            for gauge in self.worker_gauges.values():
                with contextlib.suppress(KeyError):
                    gauge.remove(model, f"{worker_id:x}", rank, role)
        live = {(model, worker_id, role) for model, worker_id, _, role in now}
        for model, worker_id, role in set(self._served) - live:
            self.forget_served(model, worker_id, role)
        self._worker_series = now


def _rank_values(worker: Worker, precise: frozenset[int] | None) -> list[tuple[str, dict[str, float]]]:
    """(dp_rank label, gauge values) per rank of `worker`; one row for a rank-blind worker, or before its report."""
    load = worker.load
    whole: dict[str, float] = {
        "active_decode_blocks": load.active_blocks if load else 0,
        "active_prefill_tokens": load.active_prefill_tokens if load else 0,
        "total_blocks": load.total_blocks if load else 0,
        "running_requests": load.num_running if load else 0,
        "waiting_requests": load.num_waiting if load else 0,
        "inflight_requests": worker.num_inflight,
        "lora_adapters_loaded": len(load.loras) if load else 0,
        "lora_loads": load.lora_loads if load else 0,
        "kv_events": -1 if precise is None else int(worker.instance_id in precise),
    }
    if load is None or not load.ranks:
        return [(str(worker.card.dp_start), whole)]
    rows = []
    for i, rank in enumerate(load.ranks):
        own: dict[str, float] = {
            "active_decode_blocks": rank.active_blocks,
            "active_prefill_tokens": rank.active_prefill_tokens,
            "total_blocks": rank.total_blocks,
            "running_requests": rank.num_running,
            "waiting_requests": rank.num_waiting,
        }
        rows.append((str(rank.dp_rank), {**whole, **own} if i == 0 else {**dict.fromkeys(whole, 0.0), **own}))
    return rows
