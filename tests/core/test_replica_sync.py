"""Router replicas' shared load, without sockets: one replica's routing events applied to another's policy."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from dynamo_cli.config import KvRouterConfig
from dynamo_cli.core.registry import ModelEntry, RouterRegistry
from dynamo_cli.core.replicas import (
    LINGER_S,
    ActiveSequenceEvent,
    PrefillCompleted,
    ReplicaSync,
    SequenceAdded,
    SequenceFreed,
)
from dynamo_cli.model_card import ModelCard
from dynamo_cli.routing.base import RouteRequest
from dynamo_cli.routing.kv_policy import KvRoutingPolicy
from dynamo_cli.routing.target import Target, targets_of

BLOCK = 16
PROMPT = list(range(1, 4 * BLOCK + 9))  # 4 full blocks + 8 tokens
CARD = ModelCard(display_name="m", tokenizer_source="-", engine="mocker", kv_cache_block_size=BLOCK)


class Bus:
    """Records what a replica publishes."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append(payload)


def replica(router_id: int, bus: Any = None) -> tuple[ReplicaSync, KvRoutingPolicy]:
    policy = KvRoutingPolicy(KvRouterConfig(block_size=BLOCK))
    registry = RouterRegistry(None, "ns", lambda card: policy)  # type: ignore[arg-type]
    registry.models["m"] = ModelEntry("m", CARD, policy, policy, workers={1: None, 2: None})  # type: ignore[dict-item]
    return ReplicaSync(bus or Bus(), "ns", router_id, registry), policy


def loads(policy: KvRoutingPolicy, *more: Target) -> dict[Target, tuple[int, int, int]]:
    s = policy.sequences
    return {
        t: (s.num_requests(t), s.active_blocks(t), s.active_prefill_tokens(t)) for t in [*targets_of([1, 2]), *more]
    }


async def test_a_peers_added_prefilled_and_freed_events_move_the_load_exactly() -> None:
    sync, policy = replica(router_id=0xB)

    def event(data: Any) -> ActiveSequenceEvent:
        return ActiveSequenceEvent(router_id=0xA, model="m", request_id="r1", data=data)

    sync.apply(event(SequenceAdded(worker_id=2, block_hashes=[11, 12, 13, 14], prefill_tokens=72)))
    assert loads(policy) == {Target(1): (0, 0, 0), Target(2): (1, 4, 72)}
    assert policy.sequences.target_of("a/r1") == Target(2)  # keyed by the peer, so ids never collide
    sync.apply(event(PrefillCompleted()))
    assert loads(policy) == {Target(1): (0, 0, 0), Target(2): (1, 4, 0)}
    sync.apply(event(SequenceFreed()))
    assert loads(policy) == {Target(1): (0, 0, 0), Target(2): (0, 0, 0)}
    assert sync.num_applied == 3


async def test_a_peers_request_on_a_rank_of_a_worker_is_counted_on_that_rank() -> None:
    sync, policy = replica(router_id=0xB)
    added = SequenceAdded(worker_id=2, dp_rank=1, block_hashes=[11, 12], prefill_tokens=40)
    sync.apply(ActiveSequenceEvent(router_id=0xA, model="m", request_id="r1", data=added))

    assert loads(policy, Target(2, 1)) == {Target(1): (0, 0, 0), Target(2): (0, 0, 0), Target(2, 1): (1, 2, 40)}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(added), type=SequenceAdded) == added


async def test_a_replica_ignores_its_own_echoes_and_unknown_workers() -> None:
    sync, policy = replica(router_id=0xA)
    sync.apply(
        ActiveSequenceEvent(
            router_id=0xA,
            model="m",
            request_id="r",
            data=SequenceAdded(worker_id=1, block_hashes=[1], prefill_tokens=16),
        )
    )
    sync.apply(
        ActiveSequenceEvent(
            router_id=0xC,
            model="m",
            request_id="r",
            data=SequenceAdded(worker_id=99, block_hashes=[1], prefill_tokens=16),
        )
    )
    assert loads(policy) == {Target(1): (0, 0, 0), Target(2): (0, 0, 0)} and sync.num_applied == 0


async def test_a_departed_peers_requests_are_freed() -> None:
    sync, policy = replica(router_id=0xB)
    for n, worker in enumerate((1, 2, 2)):
        sync.apply(
            ActiveSequenceEvent(
                router_id=0xA,
                model="m",
                request_id=f"r{n}",
                data=SequenceAdded(worker_id=worker, block_hashes=[100 + n], prefill_tokens=0),
            )
        )
    assert loads(policy) == {Target(1): (1, 1, 0), Target(2): (2, 2, 0)}
    sync.peer_left(0xA)
    assert loads(policy) == {Target(1): (0, 0, 0), Target(2): (0, 0, 0)}


async def test_what_one_replica_routes_the_other_counts_identically() -> None:
    bus = Bus()
    sync_a, policy_a = replica(router_id=0xA, bus=bus)
    sync_b, policy_b = replica(router_id=0xB)
    publisher = asyncio.get_running_loop().create_task(sync_a.publish_loop())
    decision = policy_a.select(RouteRequest("r", PROMPT), targets_of([1, 2]))
    sync_a.added("m", "r", policy_a)
    await asyncio.sleep(LINGER_S * 5)  # sent once the batch lingered
    decode = msgspec.msgpack.Decoder(list[ActiveSequenceEvent]).decode
    for payload in bus.sent:  # a message is a batch of events
        sync_b.apply_batch(decode(payload))
    assert loads(policy_b) == loads(policy_a)
    assert loads(policy_a)[decision.target] == (1, 4, len(PROMPT))
    publisher.cancel()


async def test_peek_explains_a_choice_without_counting_it() -> None:
    _, policy = replica(router_id=0xA)
    decision = policy.peek(RouteRequest("q", PROMPT), targets_of([1, 2]))
    assert decision.explanation["candidates"] and decision.target in targets_of([1, 2])
    assert loads(policy) == {Target(1): (0, 0, 0), Target(2): (0, 0, 0)}
