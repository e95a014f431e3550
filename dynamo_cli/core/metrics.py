"""The Prometheus series of whatever dispatches requests, and `dyn router`'s own.

`DispatchSeries` is what the request core reports (`DispatchMetrics`: queue waits, migrations, disaggregation
outcomes, KV pulls, requests per worker, hung workers) plus the latency and size histograms every dispatcher
keeps; the frontend's `FrontendMetrics` (prefix `dynamo_frontend`) and `dyn router`'s `RouterMetrics` (Dynamo's
`dynamo_component_router_*`, on its system server) both build on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynamo_cli.kv.handles import TransferReport

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)
_RATIO = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class DispatchSeries:
    """`{prefix}_*` series in `registry`: the request's latencies and sizes, and what the core reports."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        r, model, latency, tokens = registry, ["model"], LATENCY_BUCKETS, TOKEN_BUCKETS
        self.ttft = Histogram(f"{prefix}_time_to_first_token_seconds", "TTFT", model, buckets=latency, registry=r)
        self.itl = Histogram(f"{prefix}_inter_token_latency_seconds", "ITL", model, buckets=latency, registry=r)
        self.isl = Histogram(f"{prefix}_input_sequence_tokens", "ISL", model, buckets=tokens, registry=r)
        self.osl = Histogram(f"{prefix}_output_sequence_tokens", "OSL", model, buckets=tokens, registry=r)
        self.workers = Gauge(f"{prefix}_workers", "Routable workers", model, registry=r)
        self.queued = Gauge(f"{prefix}_queued_requests", "Requests waiting for a free worker", model, registry=r)
        self.queue_wait = Histogram(
            f"{prefix}_queue_wait_seconds",
            "Time queued for a free worker (the queued only)",
            model,
            buckets=latency,
            registry=r,
        )
        self.migrations = Counter(f"{prefix}_model_migration", "Migrations", ["model", "migration_type"], registry=r)
        self.preemptions = Counter(f"{prefix}_preemptions", "Paused for a higher class", model, registry=r)
        self.disagg = Counter(
            f"{prefix}_disagg_decisions",
            "Where prompts were prefilled, by outcome of the local-or-remote rule; encode_*: where images were encoded",
            ["model", "outcome"],
            registry=r,
        )
        backend = ["model", "backend"]
        self.transfer_seconds = Histogram(
            f"{prefix}_kv_transfer_seconds", "KV pulls by decode workers", backend, buckets=latency, registry=r
        )
        self.transfer_bytes = Counter(f"{prefix}_kv_transfer_bytes", "KV bytes pulled", backend, registry=r)
        self.transfer_gbps = Gauge(f"{prefix}_kv_transfer_gbps", "Last KV pull's GB/s", backend, registry=r)
        self.worker_requests = Counter(
            f"{prefix}_worker_requests",
            "Requests a worker served part of (prefill or decode), from this process",
            ["model", "worker_id", "worker_type"],
            registry=r,
        )
        self.worker_stalls = Counter(
            f"{prefix}_worker_stalls",
            "Workers taken out of routing as hung (core/health.py), by what found them: deadline | canary | backend",
            ["model", "worker_id", "reason"],
            registry=r,
        )
        self.worker_recoveries = Counter(
            f"{prefix}_worker_recoveries", "Hung workers that answered again", ["model", "worker_id"], registry=r
        )
        self.kv_repairs = Counter("dynamo_router_kv_gap_repairs", "KV event gaps repaired", ["kind"], registry=r)
        self._served: dict[tuple[str, int, str], Any] = {}  # (model, worker id, role) -> its child, found once

    ##### DispatchMetrics #####

    def observe_queue_wait(self, model: str, seconds: float) -> None:
        self.queue_wait.labels(model).observe(seconds)

    def count_migration(self, model: str, kind: str) -> None:
        self.migrations.labels(model, kind).inc()

    def count_preemption(self, model: str) -> None:
        self.preemptions.labels(model).inc()

    def count_disagg(self, model: str, outcome: str) -> None:
        self.disagg.labels(model, outcome).inc()

    def count_encode(self, model: str, outcome: str, images: int) -> None:
        self.disagg.labels(model, f"encode_{outcome}").inc(images)

    def observe_transfer(self, model: str, report: TransferReport) -> None:
        """One decode worker's KV pull: time, bytes and rate by backend (`local`: it failed and prefilled)."""
        self.transfer_seconds.labels(model, report.backend).observe(report.seconds)
        self.transfer_bytes.labels(model, report.backend).inc(report.nbytes)
        if report.seconds > 0:
            self.transfer_gbps.labels(model, report.backend).set(report.nbytes / report.seconds / 1e9)

    def count_served(self, model: str, worker_id: int, role: str) -> None:
        """A request had `worker_id` serve part of it (once per request per worker)."""
        child = self._served.get((model, worker_id, role))
        if child is None:  # once per worker: the request path then only increments
            child = self._served[model, worker_id, role] = self.worker_requests.labels(model, f"{worker_id:x}", role)
        child.inc()

    def forget_served(self, model: str, worker_id: int, role: str) -> None:
        """A worker that left: its requests counter goes."""
        if self._served.pop((model, worker_id, role), None) is not None:
            self.worker_requests.remove(model, f"{worker_id:x}", role)

    def count_stall(self, model: str, worker_id: int, reason: str) -> None:
        self.worker_stalls.labels(model, f"{worker_id:x}", reason).inc()

    def count_recovery(self, model: str, worker_id: int) -> None:
        self.worker_recoveries.labels(model, f"{worker_id:x}").inc()

    def count_repair(self, kind: str) -> None:
        self.kv_repairs.labels(kind).inc()


class RouterMetrics(DispatchSeries):
    """`dyn router`'s registry: the dispatch series, and each routed request's outcome and prefix hit."""

    def __init__(self, prefix: str = "dynamo_component_router") -> None:
        self.registry = r = CollectorRegistry()
        super().__init__(r, prefix)
        self.requests = Counter(f"{prefix}_requests", "Requests routed, by outcome", ["model", "status"], registry=r)
        self.kv_hit_rate = Histogram(
            f"{prefix}_kv_hit_rate", "Prompt blocks cached on the chosen worker", ["model"], buckets=_RATIO, registry=r
        )
        self.kv_events = Gauge(
            f"{prefix}_worker_kv_events",
            "1: routed from the worker's KV events; 0: approximately (none arrive); -1: not routed by KV",
            ["model", "worker_id"],
            registry=r,
        )
        self._kv_modes: set[tuple[str, int]] = set()

    def export_kv_modes(self, model: str, workers: Iterable[int], precise: frozenset[int] | None) -> None:
        """Each of a model's workers' KV routing mode (`PolicySnapshot.precise`); a worker gone loses its series."""
        now = {(model, worker_id) for worker_id in workers}
        for worker_id in workers:
            mode = -1 if precise is None else int(worker_id in precise)
            self.kv_events.labels(model, f"{worker_id:x}").set(mode)
        for gone, worker_id in {key for key in self._kv_modes if key[0] == model} - now:
            self.kv_events.remove(gone, f"{worker_id:x}")
        self._kv_modes = {key for key in self._kv_modes if key[0] != model} | now

    def observe_request(
        self, model: str, status: str, prompt: int, output: int, ttft: float | None, duration: float, hit: float
    ) -> None:
        """One routed request's end: its outcome, sizes, latencies and prefix hit on the chosen backend."""
        self.requests.labels(model, status).inc()
        self.isl.labels(model).observe(prompt)
        self.osl.labels(model).observe(output)
        self.kv_hit_rate.labels(model).observe(hit)
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
            if output > 1:
                self.itl.labels(model).observe((duration - ttft) / (output - 1))
