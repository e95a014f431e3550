"""A worker's KV event memory keeps each tier, and a router repairs a gap from it per tier.

A restarted worker on the same disk directory announces its disk blocks as its first events (warm
restart); a router that missed them asks the worker's `kv_dump` over the real request plane and can
route to those blocks. The engine is a fake at the narrow seam (`Engine.kv_events`).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from types import SimpleNamespace

from dynamo_cli.config import KvRouterConfig, WorkerConfig
from dynamo_cli.core.kv_repair import repair_gap
from dynamo_cli.kv.events import BlockRemoved, BlockStored, KvEventBatch, StoredBlock
from dynamo_cli.kv.hashing import sequence_hashes
from dynamo_cli.routing.base import RouteRequest
from dynamo_cli.routing.kv_policy import KvRoutingPolicy
from dynamo_cli.routing.target import Target, targets_of
from dynamo_cli.runtime.request_client import RequestClient
from dynamo_cli.runtime.transport import RequestServer
from dynamo_cli.wire import KV_DUMP, KV_EVENTS_SINCE, KvDumpQuery
from dynamo_cli.worker import KV_HISTORY, WorkerService

BLOCK = 16
TOKENS = list(range(1, 12 * BLOCK + 1))
HASHES = sequence_hashes(TOKENS, BLOCK)


def blocks(hashes: list[int]) -> list[StoredBlock]:
    return [StoredBlock(h, 0) for h in hashes]


class RestartedEngine:
    """Stands for an engine restarted on its old disk directory: it announces the disk tier, loads a few
    blocks back to device and then serves (and evicts) more than a router's replay window."""

    async def kv_events(self) -> AsyncIterator[KvEventBatch]:
        yield KvEventBatch(event_id=0, events=[BlockStored(parent_hash=None, blocks=blocks(HASHES), tier="disk")])
        yield KvEventBatch(
            event_id=1,
            events=[
                BlockStored(parent_hash=None, blocks=blocks(HASHES[:4])),
                BlockStored(parent_hash=None, blocks=blocks(HASHES[:2]), tier="host"),
            ],
        )
        for event_id in range(2, KV_HISTORY + 3):  # unrelated churn: the first batches leave the ring
            yield KvEventBatch(event_id=event_id, events=[BlockRemoved(block_hashes=[event_id])])


class Bus:
    async def publish(self, subject: str, payload: bytes) -> None:
        del subject, payload


async def test_a_router_that_missed_a_restarted_workers_disk_tier_repairs_it_from_the_dump() -> None:
    worker = WorkerService(
        WorkerConfig(engine="mocker", model="m"), RestartedEngine(), SimpleNamespace(lease_id=0x9), Bus()
    )  # type: ignore[arg-type]
    await worker.pump_kv_events()
    server = RequestServer()
    server.add_endpoint(KV_EVENTS_SINCE, worker.kv_events_since)
    server.add_endpoint(KV_DUMP, worker.kv_dump)
    client = RequestClient(await server.start())
    try:
        dump = await client.call(KV_DUMP, KvDumpQuery())
        assert (dump.block_hashes, dump.host_hashes) == (sorted(HASHES[:4]), sorted(HASHES[:2]))
        assert dump.disk_hashes == sorted(HASHES) and dump.last_event_id == KV_HISTORY + 2

        router = KvRoutingPolicy(KvRouterConfig(block_size=BLOCK), rng=random.Random(0))
        kind = await repair_gap(router, SimpleNamespace(client=client, instance_id=0x9), 0)  # type: ignore[arg-type]
        assert kind == "dump"  # event 0 left the worker's ring: the dump restores every tier
        decision = router.select(RouteRequest("r", TOKENS), targets_of([0x8, 0x9]))
        assert decision.target == Target(0x9) and decision.overlap_blocks == 12
        chosen = next(c for c in decision.explanation["candidates"] if (c["worker_id"], c["dp_rank"]) == (0x9, 0))
        assert chosen["hits"] == {"device": 4, "host": 0, "disk": 8}
    finally:
        await client.close()
        await server.close()
