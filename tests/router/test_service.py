"""`dyn router` in this process on embedded planes: what it registers for the frontends to find."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dynamo_cli.config import KvRouterConfig, RouterConfig
from dynamo_cli.core.registry import ROUTER_COMPONENT, RouterRegistry
from dynamo_cli.engine import Role
from dynamo_cli.router.service import RouterService
from dynamo_cli.routing.base import RoundRobinPolicy
from dynamo_cli.runtime import process
from dynamo_cli.runtime.planes import open_discovery, open_event_bus
from dynamo_cli.runtime.supervisor import ServiceTasks
from tests.core.test_registry import WAIT_S, register, wait_until


async def test_a_router_is_a_decode_worker_to_the_frontend_even_when_the_prefill_pool_registered_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(process, "freeze_heap", lambda: None)  # the GC settings of a service, not of pytest
    mine, prefill, decode, frontend = [open_discovery(f"file://{tmp_path / 'discovery'}", ttl=2.0) for _ in range(4)]
    for discovery in (mine, prefill, decode, frontend):
        await discovery.start()
    bus = open_event_bus("embedded", mine)
    await bus.start()
    # no KV events: the router would dial the workers registered here to catch up, and nothing serves them
    router = RouterService(RouterConfig(namespace="ns", kv_router=KvRouterConfig(use_kv_events=False)), mine, bus)
    seen_by_frontend = RouterRegistry(
        frontend, "ns", lambda card: RoundRobinPolicy(), accept=lambda name: name.component == ROUTER_COMPONENT
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    try:
        async with ServiceTasks() as tasks:
            run = tasks.spawn(router.run(stop, lambda line: ready.set()))
            for loop in seen_by_frontend.loops():
                tasks.spawn(loop)
            await register(prefill, "prefill", Role.PREFILL)
            await wait_until(router.registry, 1)  # the model's entry is made from the prefill worker's card
            await register(decode, "backend", Role.DECODE)
            async with asyncio.timeout(WAIT_S):
                await ready.wait()
            await wait_until(seen_by_frontend, 1)

            assert list(seen_by_frontend.get("m").workers) == [mine.lease_id]
            assert seen_by_frontend.models["m"].prefill_workers == {}
            stop.set()
            async with asyncio.timeout(WAIT_S):
                await run
    finally:
        await seen_by_frontend.close()
        await bus.close()
        for discovery in (mine, prefill, decode, frontend):
            await discovery.close()
