"""What a routing process routes with, built one way for both (a frontend and `dyn router`): its registry of
workers, the rules of its dispatches, the health monitor of its workers and the replicas' sync, and `start`, which
runs their loops (discovery watches, load and KV event pumps with gap repair, canaries, the peers' routing
events) as the process's tasks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dynamo_cli.config import BusyThresholds, DisaggConfig, HealthChecks, QueueConfig, SessionConfig
from dynamo_cli.core.dispatch import DispatchRules, ToWorkers, Upstream
from dynamo_cli.core.feeds import follow_workers
from dynamo_cli.core.health import HealthMonitor
from dynamo_cli.core.registry import Registry
from dynamo_cli.core.replicas import ReplicaSync
from dynamo_cli.core.request_plan import DispatchMetrics
from dynamo_cli.core.stalls import NO_DEADLINE, Deadline
from dynamo_cli.runtime.discovery import Discovery
from dynamo_cli.runtime.events import EventBus
from dynamo_cli.runtime.supervisor import ServiceTasks


class StackMetrics(DispatchMetrics, Protocol):
    """What a routing process counts (FrontendMetrics, RouterMetrics)."""

    def count_repair(self, kind: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Routing:
    """How a process routes: the settings its stack is built from."""

    migration_limit: int
    busy: BusyThresholds
    disagg: DisaggConfig
    queue: QueueConfig
    health: HealthChecks
    kv_events: bool
    """Follow the workers' KV events (a KV-aware policy of either pool)."""
    replica_sync: bool
    """Share each decision, first token and end with the other routers of the namespace."""
    upstream: Upstream = field(default_factory=ToWorkers)
    migrates_after_output: bool = True
    sessions: SessionConfig = SessionConfig()
    watches_workers: bool = True
    """False behind `dyn router`s: the routers probe their backends and apply the stall deadline."""


@dataclass(frozen=True, slots=True)
class RoutingStack:
    """A routing process's registry, dispatch rules, health monitor and replicas' sync."""

    registry: Registry[Any]
    rules: DispatchRules
    monitor: HealthMonitor | None
    sync: ReplicaSync | None
    kv_events: bool
    on_repair: Callable[[str], None]

    async def start(self, tasks: ServiceTasks, bus: EventBus, discovery: Discovery, namespace: str) -> None:
        """Run the stack's loops as `tasks`; returns once the event subscriptions are in place."""
        await follow_workers(self.registry, bus, namespace, tasks, kv_events=self.kv_events, on_repair=self.on_repair)
        if self.monitor is not None:
            tasks.spawn(self.monitor.run())
        for loop in self.sync.loops(discovery) if self.sync is not None else ():
            tasks.spawn(loop)


def routing_stack(
    routing: Routing, registry: Registry[Any], metrics: StackMetrics, bus: EventBus, namespace: str, replica_id: int
) -> RoutingStack:
    """The stack of a process that routes as `routing` says over `registry`, counting into `metrics`."""
    max_sessions = routing.sessions.max_entries
    sync = ReplicaSync(bus, namespace, replica_id, registry, max_sessions) if routing.replica_sync else None
    watches = routing.watches_workers
    rules = DispatchRules(
        routing.migration_limit,
        routing.busy if watches else BusyThresholds(),
        upstream=routing.upstream,
        disagg=routing.disagg,
        queue=routing.queue,
        sessions=routing.sessions,
        migrates_after_output=routing.migrates_after_output,
        metrics=metrics,
        replicas=sync,
        deadline=Deadline(routing.health.stall_timeout_s, metrics) if watches else NO_DEADLINE,
    )
    monitor = HealthMonitor(registry, routing.health, metrics) if watches else None
    return RoutingStack(registry, rules, monitor, sync, routing.kv_events, metrics.count_repair)
