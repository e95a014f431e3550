"""A frontend's real metrics registry (`FrontendMetrics`), driven by hand, and its /metrics text: what
`dyn top` reads, without a server."""

from __future__ import annotations

from prometheus_client import generate_latest

from dynamo_cli.engine import Role
from dynamo_cli.frontend.metrics import FrontendMetrics
from dynamo_cli.kv.handles import TransferReport
from dynamo_cli.top.snapshot import MetricsSnapshot, parse_snapshot
from dynamo_cli.wire import LoadMetrics
from tests.frontend.test_worker_series import worker

MODEL = "m"


class Frontend:
    """`FrontendMetrics` plus the registry's workers as the frontend exports them at each scrape."""

    def __init__(self) -> None:
        self.metrics = FrontendMetrics()
        self.workers: dict[int, tuple[Role, LoadMetrics | None, int]] = {}
        self.precise: frozenset[int] | None = None
        """The workers the KV router routes from their KV events (None: a router blind to caches)."""

    def add_worker(self, worker_id: int, role: Role, load: LoadMetrics | None = None, num_inflight: int = 0) -> None:
        self.workers[worker_id] = (role, load, num_inflight)

    def serve(self, worker_id: int, ttft: float, itl: float, num_requests: int = 1) -> None:
        """`num_requests` requests finished on `worker_id`, each with this TTFT and one ITL."""
        role = self.workers[worker_id][0].value
        for _ in range(num_requests):
            self.metrics.count_served(MODEL, worker_id, role)
            self.metrics.requests.labels(MODEL, "chat_completions", "stream", "success").inc()
            self.metrics.ttft.labels(MODEL).observe(ttft)
            self.metrics.itl.labels(MODEL).observe(itl)

    def transfer(self, nbytes: int, seconds: float) -> None:
        self.metrics.observe_transfer(MODEL, TransferReport(nbytes=nbytes, seconds=seconds, backend="tcp"))

    def route(self, request_blocks: int, hit_blocks: int, reachable_blocks: int) -> None:
        """The KV router's counters, as the frontend copies them at a scrape."""
        counters = {"num_request_blocks": request_blocks, "num_hit_blocks": hit_blocks}
        self.metrics.export_router(MODEL, {**counters, "num_reachable_hit_blocks": reachable_blocks})

    def text(self) -> str:
        """/metrics now (as `prometheus()` writes it: the workers' series exported first)."""
        self.metrics.workers.labels(MODEL).set(len(self.workers))
        self.metrics.export_workers(
            (MODEL, worker(worker_id, role, load, num_inflight), self.precise)
            for worker_id, (role, load, num_inflight) in self.workers.items()
        )
        return generate_latest(self.metrics.registry).decode()

    def snapshot(self, at: float) -> MetricsSnapshot:
        return parse_snapshot(self.text(), at)
