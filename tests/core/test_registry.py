"""The model registry on a real (embedded) discovery: what it routes to, and what it advertises."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from dynamo_cli.core.registry import RouterRegistry
from dynamo_cli.engine import Role
from dynamo_cli.errors import ModelNotFound
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.model_card import ModelCard
from dynamo_cli.routing.base import RoundRobinPolicy
from dynamo_cli.runtime.discovery import Discovery
from dynamo_cli.runtime.endpoint import Endpoint
from dynamo_cli.runtime.names import EndpointName
from dynamo_cli.runtime.planes import open_discovery
from dynamo_cli.runtime.supervisor import ServiceTasks
from dynamo_cli.runtime.transport import RequestServer
from dynamo_cli.wire import LoadMetrics
from tests.request_plane import raw

WAIT_S = 5.0


@pytest.fixture
async def discoveries(tmp_path: Path) -> AsyncIterator[list[Discovery]]:
    """Three processes on one embedded store: the registry's and two workers'."""
    opened = [open_discovery(f"file://{tmp_path / 'discovery'}", ttl=2.0) for _ in range(3)]
    for discovery in opened:
        await discovery.start()
    yield opened
    for discovery in opened:
        await discovery.close()


def card(role: Role) -> ModelCard:
    return ModelCard(display_name="m", tokenizer_source="-", engine="mocker", role=role.value)


async def register(discovery: Discovery, component: str, role: Role) -> None:
    """Write a worker's card and record as serve_endpoint does, without serving (nothing dials it)."""
    name = EndpointName("ns", component, "generate")
    server = RequestServer()
    await server.start()
    serving = Endpoint(name, discovery).serve_endpoint(
        server, raw("generate"), _never, card(role), role=role.value, grace_s=0
    )
    await serving.__aenter__()  # left registered: the lease takes the keys at the end of the test
    await server.close()


async def _never(body: msgspec.Raw) -> AsyncIterator[bytes]:
    raise AssertionError("not dialled")
    yield b""


async def wait_until(registry: RouterRegistry, num_workers: int) -> None:
    async with asyncio.timeout(WAIT_S):
        while registry.num_workers() != num_workers:
            registry.changed.clear()
            await registry.changed.wait()


async def test_a_model_served_only_by_prefill_workers_is_known_but_not_advertised(
    discoveries: list[Discovery],
) -> None:
    mine, prefill, decode = discoveries
    registry = RouterRegistry(mine, "ns", lambda card: RoundRobinPolicy())
    async with ServiceTasks() as tasks:
        for loop in registry.loops():
            tasks.spawn(loop)
        await register(prefill, "prefill", Role.PREFILL)
        await wait_until(registry, 1)
        assert list(registry.models["m"].prefill_workers) == [prefill.lease_id]
        assert registry.servable() == []
        with pytest.raises(ModelNotFound):
            registry.get("m")

        await register(decode, "backend", Role.DECODE)
        await wait_until(registry, 2)
        assert [e.name for e in registry.servable()] == ["m"]
        assert list(registry.get("m").workers) == [decode.lease_id]
    await registry.close()


class Recording(RoundRobinPolicy):
    """A round-robin policy that records the loads and KV events it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[int] = []
        self.kv: list[int] = []

    def apply_load(self, metrics: LoadMetrics) -> None:
        self.loads.append(metrics.worker_id)

    def apply_kv_events(self, batch: KvEventBatch) -> None:
        self.kv.append(batch.worker_id)


async def test_each_workers_load_and_kv_events_reach_the_policy_of_its_own_pool(
    discoveries: list[Discovery],
) -> None:
    mine, prefill, decode = discoveries
    decode_policy, prefill_policy = Recording(), Recording()
    registry = RouterRegistry(
        mine, "ns", lambda card: decode_policy, prefill_policy_factory=lambda card: prefill_policy
    )
    async with ServiceTasks() as tasks:
        for loop in registry.loops():
            tasks.spawn(loop)
        await register(prefill, "prefill", Role.PREFILL)
        await register(decode, "backend", Role.DECODE)
        await wait_until(registry, 2)
        for worker in (prefill.lease_id, decode.lease_id):
            registry.apply_load(LoadMetrics(worker_id=worker, num_running=1))
            registry.apply_kv_events(KvEventBatch(worker_id=worker, event_id=0, events=[]))
        assert (prefill_policy.loads, prefill_policy.kv) == ([prefill.lease_id], [prefill.lease_id])
        assert (decode_policy.loads, decode_policy.kv) == ([decode.lease_id], [decode.lease_id])
        assert registry.get("m").prefill_workers[prefill.lease_id].load == LoadMetrics(
            worker_id=prefill.lease_id, num_running=1
        )
    await registry.close()


async def test_an_adapter_is_a_model_of_its_base_and_a_new_card_adds_or_takes_it_away(
    discoveries: list[Discovery],
) -> None:
    mine, first, second = discoveries
    registry = RouterRegistry(mine, "ns", lambda card: RoundRobinPolicy())
    endpoints = [Endpoint(EndpointName("ns", "backend", "generate"), d) for d in (first, second)]
    lora_card = msgspec.structs.replace(card(Role.BOTH), loras=["a"], max_loras=2)
    async with ServiceTasks() as tasks:
        for loop in registry.loops():
            tasks.spawn(loop)
        for discovery in (first, second):
            server = RequestServer()
            await server.start()
            serving = Endpoint(EndpointName("ns", "backend", "generate"), discovery).serve_endpoint(
                server,
                raw("generate"),
                _never,
                lora_card if discovery is first else card(Role.BOTH),
                role="both",
                grace_s=0,
            )
            await serving.__aenter__()
            await server.close()
        await wait_until(registry, 2)
        entry, lora = registry.resolve("a")
        assert (entry.name, lora) == ("m", "a") and registry.resolve("m") == (entry, "")
        assert entry.adapters == {"a": 1}
        assert entry.workers[first.lease_id].adapters.serves("a")
        assert not entry.workers[second.lease_id].adapters.serves("a")
        await endpoints[1].update_card(msgspec.structs.replace(lora_card, loras=["a", "b"]))  # a run-time load
        async with asyncio.timeout(WAIT_S):
            while "b" not in registry.adapters:
                registry.changed.clear()
                await registry.changed.wait()
        assert entry.adapters == {"a": 2, "b": 1}
        await endpoints[0].update_card(card(Role.BOTH))  # first unloads a
        await endpoints[1].update_card(msgspec.structs.replace(lora_card, loras=["b"]))
        async with asyncio.timeout(WAIT_S):
            while "a" in registry.adapters:
                registry.changed.clear()
                await registry.changed.wait()
        with pytest.raises(ModelNotFound, match="served here: b, m"):
            registry.resolve("a")
        assert registry.num_workers() == 2  # a new card is no leave and join
