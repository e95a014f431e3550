"""The frontend's Prometheus metrics, with Dynamo's `dynamo_frontend_*` names."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram

from dynamo_cli.kv.handles import TransferReport
from dynamo_cli.kv.tier_stats import KVBM_SERIES
from dynamo_cli.kv.tiers import KvTierStats
from dynamo_cli.router.registry import Worker

WORKER_SERIES = {
    "active_decode_blocks": "KV blocks in use on the worker (its last load report)",
    "active_prefill_tokens": "Prompt tokens the worker is prefilling (its last load report)",
    "total_blocks": "KV blocks the worker has (its last load report)",
    "running_requests": "Requests the worker is running (its last load report)",
    "waiting_requests": "Requests waiting in the worker's scheduler (its last load report)",
    "inflight_requests": "Streams this frontend has open on the worker",
}
"""Per-worker gauges `dynamo_frontend_worker_{name}`, labelled model, worker_id, dp_rank, worker_type."""

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class FrontendMetrics:
    """One registry per app (no global state)."""

    def __init__(self, prefix: str = "dynamo_frontend", *, gc: bool = True) -> None:
        """`gc`: count garbage collections here (a process that serves the global registry too has them there)."""
        self.registry = r = CollectorRegistry()
        if gc:
            GCCollector(registry=r)  # python_gc_collections_total by generation: collections stall the event loop
        self.requests = Counter(
            f"{prefix}_requests", "Requests", ["model", "endpoint", "request_type", "status"], registry=r
        )
        self.inflight = Gauge(f"{prefix}_inflight_requests", "Requests in flight", ["model"], registry=r)
        self.disconnected = Counter(f"{prefix}_disconnected_clients", "Clients gone mid-request", ["model"], registry=r)
        self.ttft = Histogram(f"{prefix}_time_to_first_token_seconds", "TTFT", ["model"], buckets=_LATENCY, registry=r)
        self.itl = Histogram(f"{prefix}_inter_token_latency_seconds", "ITL", ["model"], buckets=_LATENCY, registry=r)
        self.isl = Histogram(f"{prefix}_input_sequence_tokens", "ISL", ["model"], buckets=_TOKENS, registry=r)
        self.osl = Histogram(f"{prefix}_output_sequence_tokens", "OSL", ["model"], buckets=_TOKENS, registry=r)
        self.cached = Histogram(f"{prefix}_cached_tokens", "Prefix-cache hits", ["model"], buckets=_TOKENS, registry=r)
        self.duration = Histogram(f"{prefix}_request_duration_seconds", "e2e", ["model"], buckets=_LATENCY, registry=r)
        self.output_tokens = Counter(f"{prefix}_output_tokens", "Output tokens", ["model"], registry=r)
        self.migrations = Counter(f"{prefix}_model_migration", "Migrations", ["model", "migration_type"], registry=r)
        self.cancellations = Counter(f"{prefix}_model_cancellation", "Cancelled requests", ["model"], registry=r)
        self.worker_restarts = Counter(f"{prefix}_worker_restarts", "Workers restarted by dyn serve", registry=r)
        self.worker_stalls = Counter(
            f"{prefix}_worker_stalls",
            "Workers taken out of routing as hung (router/health.py), by what found them: deadline | canary",
            ["model", "worker_id", "reason"],
            registry=r,
        )
        self.worker_recoveries = Counter(
            f"{prefix}_worker_recoveries",
            "Hung workers that answered a canary again",
            ["model", "worker_id"],
            registry=r,
        )
        self.refused = Counter(f"{prefix}_auth_refused", "Refused by API key or per-key limit", ["code"], registry=r)
        self.workers = Gauge(f"{prefix}_workers", "Routable workers", ["model"], registry=r)
        self.queued = Gauge(f"{prefix}_queued_requests", "Requests waiting for a free worker", ["model"], registry=r)
        self.queue_wait = Histogram(
            f"{prefix}_queue_wait_seconds",
            "Time queued for a free worker (the queued only)",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.kv_repairs = Counter("dynamo_router_kv_gap_repairs", "KV event gaps repaired", ["kind"], registry=r)
        self.router = Gauge("dynamo_router_counter", "KV router counters (monotonic)", ["model", "name"], registry=r)
        self.disagg = Counter(
            f"{prefix}_disagg_decisions",
            "Where prompts were prefilled, by outcome of the local-or-remote rule",
            ["model", "outcome"],
            registry=r,
        )
        labels = ["model", "backend"]
        self.transfer_seconds = Histogram(
            f"{prefix}_kv_transfer_seconds", "KV pulls by decode workers", labels, buckets=_LATENCY, registry=r
        )
        self.transfer_bytes = Counter(f"{prefix}_kv_transfer_bytes", "KV bytes pulled", labels, registry=r)
        self.transfer_gbps = Gauge(f"{prefix}_kv_transfer_gbps", "Last KV pull's GB/s", labels, registry=r)
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
        self.worker_requests = Counter(
            f"{prefix}_worker_requests",
            "Requests a worker served part of (prefill or decode), from this frontend",
            ["model", "worker_id", "worker_type"],
            registry=r,
        )
        self._worker_series: set[tuple[str, str, str]] = set()
        self._served: dict[tuple[str, int, str], Any] = {}
        """(model, worker id, role) -> its `worker_requests` child (looked up once per worker, not per request)."""
        """(model, worker id, role) of every worker with series, so that one that left loses them."""

    def observe_transfer(self, model: str, report: TransferReport) -> None:
        """One decode worker's KV pull: time, bytes and rate by backend (`local`: it failed and prefilled)."""
        self.transfer_seconds.labels(model, report.backend).observe(report.seconds)
        self.transfer_bytes.labels(model, report.backend).inc(report.nbytes)
        if report.seconds > 0:
            self.transfer_gbps.labels(model, report.backend).set(report.nbytes / report.seconds / 1e9)

    def observe_queue_wait(self, model: str, seconds: float) -> None:
        self.queue_wait.labels(model).observe(seconds)

    def count_migration(self, model: str, kind: str) -> None:
        self.migrations.labels(model, kind).inc()

    def count_disagg(self, model: str, outcome: str) -> None:
        self.disagg.labels(model, outcome).inc()

    def count_stall(self, model: str, worker_id: int, reason: str) -> None:
        self.worker_stalls.labels(model, f"{worker_id:x}", reason).inc()

    def count_recovery(self, model: str, worker_id: int) -> None:
        self.worker_recoveries.labels(model, f"{worker_id:x}").inc()

    def count_repair(self, kind: str) -> None:
        self.kv_repairs.labels(kind).inc()

    def export_kv_tiers(self, model: str, worker_id: int, stats: KvTierStats) -> None:
        """A worker's KV tier counters, as it last published them (`LoadMetrics.kv_tiers`)."""
        for name, field in KVBM_SERIES.items():
            self.kvbm[name].labels(model, f"{worker_id:x}").set(getattr(stats, field))

    def export_router(self, model: str, counters: dict[str, int]) -> None:
        """Copy a KV policy's counters (decisions, hit blocks, reachable hit blocks ...) into gauges."""
        for name, value in counters.items():
            self.router.labels(model, name).set(value)

    def count_served(self, model: str, worker_id: int, role: str) -> None:
        """A request had `worker_id` serve part of it (once per request per worker)."""
        child = self._served.get((model, worker_id, role))
        if child is None:  # once per worker: the request path then only increments
            labels = (model, f"{worker_id:x}", role)
            self._worker_series.add(labels)
            child = self._served[model, worker_id, role] = self.worker_requests.labels(*labels)
        child.inc()

    def export_workers(self, workers: Iterable[tuple[str, Worker]]) -> None:
        """Every (model, worker)'s load and in-flight streams now; a worker no longer listed loses its series."""
        now = set()
        for model, worker in workers:
            labels = (model, f"{worker.instance_id:x}", worker.card.role)
            now.add(labels)
            load = worker.load
            values = {
                "active_decode_blocks": load.active_blocks if load else 0,
                "active_prefill_tokens": load.active_prefill_tokens if load else 0,
                "total_blocks": load.total_blocks if load else 0,
                "running_requests": load.num_running if load else 0,
                "waiting_requests": load.num_waiting if load else 0,
                "inflight_requests": worker.num_inflight,
            }
            for name, value in values.items():
                self.worker_gauges[name].labels(labels[0], labels[1], "0", labels[2]).set(value)
        for model, worker_id, role in self._worker_series - now:
            for gauge in self.worker_gauges.values():
                with contextlib.suppress(KeyError):
                    gauge.remove(model, worker_id, "0", role)
            with contextlib.suppress(KeyError):
                self.worker_requests.remove(model, worker_id, role)
            self._served.pop((model, int(worker_id, 16), role), None)
        self._worker_series = now
