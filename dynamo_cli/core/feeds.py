"""What a routing process follows on the event plane: the workers' load and KV events, into the registry.

The frontend and `dyn router` both run this: every worker's published load (`…kv-metrics`) and, for KV-aware
routing, every KV event batch (`…kv-events`, replayed from the stream where the plane keeps one) reach the
policy of the worker's pool (`ModelEntry.policy_of`); gaps in a worker's event ids are repaired from the
worker, and a worker that joins is caught up on what it announced before this process saw it register.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dynamo_cli.core.kv_repair import repair_gap, repair_loop
from dynamo_cli.core.registry import ModelEntry, Registry, Worker
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.routing.base import RepairsKvGaps
from dynamo_cli.runtime.events import EventBus, pump, subscribe_kv_events
from dynamo_cli.runtime.names import component_subject, kv_events_subject
from dynamo_cli.runtime.supervisor import ServiceTasks
from dynamo_cli.wire import LoadMetrics


async def follow_workers(
    registry: Registry[Any],
    bus: EventBus,
    namespace: str,
    tasks: ServiceTasks,
    *,
    kv_events: bool,
    on_repair: Callable[[str], None] | None = None,
) -> None:
    """Start the registry's discovery watches and the event pumps as `tasks`; with `kv_events`, the KV event
    pump, its gap repair and the catch-up of each worker that joins. Returns once subscribed."""
    if kv_events:  # before the discovery watch runs: no join is missed
        registry.on_join = lambda entry, worker: catch_up(tasks, entry, worker)
    for loop in registry.loops():
        tasks.spawn(loop)
    load = await bus.subscribe(component_subject(namespace, "*", "kv-metrics"))
    tasks.spawn(pump(load, registry.apply_load, LoadMetrics))
    if kv_events:
        kv = await subscribe_kv_events(bus, namespace, kv_events_subject(namespace))
        tasks.spawn(pump(kv, registry.apply_kv_events, KvEventBatch))
        tasks.spawn(repair_loop(registry, on_repair))


def catch_up(tasks: ServiceTasks, entry: ModelEntry, worker: Worker) -> None:
    """A worker joined: replay its kept KV events from 0 (or load its dump), so what it announced before this
    process saw it register (a restarted worker's disk tier: warm restart) is routable at once."""
    policy = entry.policy_of(worker.instance_id)
    if isinstance(policy, RepairsKvGaps):
        tasks.spawn(repair_gap(policy, worker, 0))
