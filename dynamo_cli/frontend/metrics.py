"""The frontend's Prometheus metrics, with Dynamo's `dynamo_frontend_*` names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram

from dynamo_cli.kv.handles import TransferReport
from dynamo_cli.kv.tiers import KvTierStats

KVBM_SERIES = {
    "kvbm_matched_tokens": "matched_tokens",
    "kvbm_offload_blocks_d2h": "offload_blocks_d2h",
    "kvbm_offload_blocks_h2d": "offload_blocks_h2d",
    "kvbm_onboard_blocks_h2d": "onboard_blocks_h2d",
    "kvbm_onboard_blocks_d2d": "onboard_blocks_d2d",
    "kvbm_host_cache_hit_rate": "host_hit_rate",
    "kvbm_disk_cache_hit_rate": "disk_hit_rate",
    "kvbm_offload_bytes_d2h": "offload_bytes_d2h",
    "kvbm_offload_seconds_d2h": "offload_seconds_d2h",
    "kvbm_offload_bytes_h2d": "offload_bytes_h2d",
    "kvbm_offload_seconds_h2d": "offload_seconds_h2d",
    "kvbm_onboard_bytes_h2d": "onboard_bytes_h2d",
    "kvbm_onboard_seconds_h2d": "onboard_seconds_h2d",
    "kvbm_onboard_bytes_d2d": "onboard_bytes_d2d",
    "kvbm_onboard_seconds_d2d": "onboard_seconds_d2d",
    "kvbm_filtered_blocks": "filtered_blocks",
    "kvbm_dropped_blocks": "dropped_blocks",
    "kvbm_disk_files_corrupt": "corrupt_files",
    "kvbm_disk_files_foreign": "foreign_files",
    "kvbm_host_blocks": "host_blocks",
    "kvbm_host_bytes": "host_used_bytes",
    "kvbm_disk_blocks": "disk_blocks",
    "kvbm_disk_bytes": "disk_used_bytes",
}
"""Prometheus series of the workers' KV tiers (`KvTierStats`), with Dynamo's KVBM names where it has one.
Directions as KVBM names them: offload d2h device→host, offload h2d host→disk (G2→G3), onboard h2d
host→device, onboard d2d disk→device."""

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class FrontendMetrics:
    """One registry per app (no global state)."""

    def __init__(self, prefix: str = "dynamo_frontend") -> None:
        self.registry = r = CollectorRegistry()
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
