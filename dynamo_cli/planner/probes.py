"""What `dyn plan run --system-port` shows of the planner (runtime/system.py serves it): `/health` says whether
it reads its frontends, `/metrics` what it decided.

    starting   503 until a frontend's /metrics was read once (the planner waits for one, and says why)
    ready      200 while its ticks read them
    unhealthy  503 once its last UNHEALTHY_AFTER reads all failed, with the last failure (which frontends)
    draining   503 once it stops

A probe thus tells a planner that scales nothing because it sees no traffic from one that sees an idle
deployment.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_cli.errors import PlaneUnavailable
from dynamo_cli.planner.observe import Snapshot
from dynamo_cli.planner.planner import Planner, Snapshotter
from dynamo_cli.runtime.system import HealthReport, ServingState, SystemServer

UNHEALTHY_AFTER = 3
"""Failed reads in a row (burst checks and throughput steps alike) that make a running planner unhealthy."""


class WatchedSource:
    """The planner's metric source, its reads counted: a read that fails (no frontend answered, or discovery
    did not in time) is recorded for `/health`, then raised as before."""

    def __init__(self, source: Snapshotter, unhealthy_after: int = UNHEALTHY_AFTER) -> None:
        self.source = source
        self.unhealthy_after = unhealthy_after
        self.state = ServingState.STARTING
        """Set by the planner's owner: ready once the first read succeeded, draining once it stops."""
        self.num_failed = 0
        """Reads in a row that failed."""
        self.num_failed_total = 0
        self.error = ""
        """Why the latest failed read failed."""

    async def snapshot(self) -> Snapshot:
        try:
            snapshot = await self.source.snapshot()
        except (PlaneUnavailable, TimeoutError) as exc:
            self.num_failed += 1
            self.num_failed_total += 1
            self.error = str(exc) or "no answer in time"
            raise
        self.num_failed = 0
        return snapshot

    async def health(self) -> HealthReport:
        """`/health`, as the module docstring tells."""
        if self.state is ServingState.STARTING and self.num_failed:
            return HealthReport(False, self.state.value, {"reason": f"waiting for a frontend: {self.error}"})
        if self.state is ServingState.READY and self.num_failed >= self.unhealthy_after:
            reason = f"the last {self.num_failed} reads of the frontends' metrics failed: {self.error}"
            return HealthReport(False, "unhealthy", {"reason": reason})
        return HealthReport(self.state is ServingState.READY, self.state.value)


class PlannerMetrics(Collector):
    """The planner's figures at scrape time: decisions taken, the workers the latest one asked for, failed reads."""

    def __init__(self, planner: Planner, source: WatchedSource) -> None:
        self.planner = planner
        self.source = source

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily("dynamo_planner_decisions", "Scale decisions taken")
        decisions.add_metric([], self.planner.num_steps)
        failed = CounterMetricFamily("dynamo_planner_failed_reads", "Reads of the frontends' metrics that failed")
        failed.add_metric([], self.source.num_failed_total)
        wanted = GaugeMetricFamily(
            "dynamo_planner_desired_workers", "Workers the latest decision asked for, per pool", labels=["pool"]
        )
        if self.planner.last_step is not None:
            decision = self.planner.last_step.decision
            wanted.add_metric(["prefill"], decision.num_prefill)
            wanted.add_metric(["decode"], decision.num_decode)
        yield from (decisions, failed, wanted)


def planner_system_server(host: str, port: int, planner: Planner, source: WatchedSource) -> SystemServer:
    """`/live`, `/health` and `/metrics` on `host:port` (0: any free port): the source's health, the planner's
    figures."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(PlannerMetrics(planner, source))
    return SystemServer(host, port, source.health, [registry])
