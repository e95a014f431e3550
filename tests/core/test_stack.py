"""The routing stack (core/stack.py): what a routing process declares decides its rules, its health monitor and its
replicas' sync, the same way for a frontend and a `dyn router`."""

from __future__ import annotations

from typing import Any, cast

from dynamo_cli.config import BusyThresholds, DisaggConfig, HealthChecks, QueueConfig
from dynamo_cli.core.dispatch import ToRouters
from dynamo_cli.core.registry import Registry
from dynamo_cli.core.stack import Routing, routing_stack
from dynamo_cli.core.stalls import NO_DEADLINE
from dynamo_cli.frontend.metrics import FrontendMetrics
from dynamo_cli.runtime.events import EventBus

BUSY = BusyThresholds(max_inflight=4)
REGISTRY = cast(Registry[Any], object())  # held, not read, while the stack is built
BUS = cast(EventBus, object())


def routing(**overrides: Any) -> Routing:
    fields: dict[str, Any] = {"kv_events": True, "replica_sync": False} | overrides
    return Routing(2, BUSY, DisaggConfig(), QueueConfig(), HealthChecks(stall_timeout_s=3.0), **fields)


async def test_a_process_that_watches_its_workers_has_their_deadline_busy_rule_and_monitor() -> None:
    stack = routing_stack(routing(), REGISTRY, FrontendMetrics(gc=False), BUS, "ns", 7)
    rules = stack.rules
    assert (rules.migration_limit, rules.busy, rules.deadline.stall_s) == (2, BUSY, 3.0)
    assert stack.monitor is not None and stack.sync is None and rules.replicas is None and stack.kv_events


async def test_behind_routers_the_routers_watch_the_backends_and_apply_the_busy_rule() -> None:
    stack = routing_stack(
        routing(upstream=ToRouters(), watches_workers=False), REGISTRY, FrontendMetrics(gc=False), BUS, "ns", 7
    )
    assert stack.monitor is None and stack.rules.deadline is NO_DEADLINE and stack.rules.busy == BusyThresholds()
    assert isinstance(stack.rules.upstream, ToRouters)


async def test_replica_sync_shares_the_stacks_decisions_through_its_rules() -> None:
    stack = routing_stack(
        routing(replica_sync=True, migrates_after_output=False), REGISTRY, FrontendMetrics(gc=False), BUS, "ns", 7
    )
    assert stack.sync is not None and stack.rules.replicas is stack.sync and stack.sync.router_id == 7
    assert not stack.rules.migrates_after_output
