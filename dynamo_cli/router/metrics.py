"""`dyn router`'s Prometheus series on its system server, with Dynamo's `dynamo_component_router_*` names: the
requests it routed (TTFT, ITL, ISL, OSL, KV hit rate) and what its request core reports (`DispatchMetrics`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynamo_cli.kv.handles import TransferReport

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)
_RATIO = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class RouterMetrics:
    """One registry per router process."""

    def __init__(self, prefix: str = "dynamo_component_router") -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(f"{prefix}_requests", "Requests routed, by outcome", ["model", "status"], registry=r)
        self.ttft = Histogram(f"{prefix}_time_to_first_token_seconds", "TTFT", ["model"], buckets=_LATENCY, registry=r)
        self.itl = Histogram(f"{prefix}_inter_token_latency_seconds", "ITL", ["model"], buckets=_LATENCY, registry=r)
        self.isl = Histogram(f"{prefix}_input_sequence_tokens", "ISL", ["model"], buckets=_TOKENS, registry=r)
        self.osl = Histogram(f"{prefix}_output_sequence_tokens", "OSL", ["model"], buckets=_TOKENS, registry=r)
        self.kv_hit_rate = Histogram(
            f"{prefix}_kv_hit_rate", "Prompt blocks cached on the chosen worker", ["model"], buckets=_RATIO, registry=r
        )
        self.queue_wait = Histogram(
            f"{prefix}_queue_wait_seconds", "Time queued for a free backend", ["model"], buckets=_LATENCY, registry=r
        )
        self.queued = Gauge(f"{prefix}_queued_requests", "Requests waiting for a free backend", ["model"], registry=r)
        self.workers = Gauge(f"{prefix}_workers", "Routable backends", ["model"], registry=r)
        self.migrations = Counter(f"{prefix}_model_migration", "Re-dispatches", ["model", "migration_type"], registry=r)
        self.disagg = Counter(
            f"{prefix}_disagg_decisions", "Where prompts were prefilled", ["model", "outcome"], registry=r
        )
        self.transfer_seconds = Histogram(
            f"{prefix}_kv_transfer_seconds", "KV pulls", ["model", "backend"], buckets=_LATENCY, registry=r
        )
        self.transfer_bytes = Counter(
            f"{prefix}_kv_transfer_bytes", "KV bytes pulled", ["model", "backend"], registry=r
        )
        worker_labels = ["model", "worker_id", "worker_type"]
        self.served = Counter(f"{prefix}_worker_requests", "Requests per backend", worker_labels, registry=r)
        self.stalls = Counter(
            f"{prefix}_worker_stalls",
            "Backends taken out of routing as hung",
            ["model", "worker_id", "reason"],
            registry=r,
        )
        self.recoveries = Counter(
            f"{prefix}_worker_recoveries", "Hung backends that answered again", ["model", "worker_id"], registry=r
        )
        self.kv_repairs = Counter("dynamo_router_kv_gap_repairs", "KV event gaps repaired", ["kind"], registry=r)

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

    ##### DispatchMetrics #####

    def observe_queue_wait(self, model: str, seconds: float) -> None:
        self.queue_wait.labels(model).observe(seconds)

    def count_migration(self, model: str, kind: str) -> None:
        self.migrations.labels(model, kind).inc()

    def count_disagg(self, model: str, outcome: str) -> None:
        self.disagg.labels(model, outcome).inc()

    def observe_transfer(self, model: str, report: TransferReport) -> None:
        self.transfer_seconds.labels(model, report.backend).observe(report.seconds)
        self.transfer_bytes.labels(model, report.backend).inc(report.nbytes)

    def count_served(self, model: str, worker_id: int, role: str) -> None:
        self.served.labels(model, f"{worker_id:x}", role).inc()

    def count_stall(self, model: str, worker_id: int, reason: str) -> None:
        self.stalls.labels(model, f"{worker_id:x}", reason).inc()

    def count_recovery(self, model: str, worker_id: int) -> None:
        self.recoveries.labels(model, f"{worker_id:x}").inc()

    def count_repair(self, kind: str) -> None:
        self.kv_repairs.labels(kind).inc()
