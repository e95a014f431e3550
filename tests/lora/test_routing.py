"""Adapter-aware routing without sockets: the routers' view of each worker's adapters, the load term in both
costs, and the KV index kept apart per adapter."""

from __future__ import annotations

import random

import pytest

from dynamo_cli.config import KvRouterConfig
from dynamo_cli.kv.events import BlockStored, KvEventBatch, StoredBlock
from dynamo_cli.kv.hashing import hash_blocks, lora_seed
from dynamo_cli.lora.routing import DEFAULT_LOAD_S, AdapterView
from dynamo_cli.routing.base import RouteRequest
from dynamo_cli.routing.kv_policy import KvRoutingPolicy
from dynamo_cli.routing.target import Target, targets_of
from dynamo_cli.wire import LoadMetrics

BLOCK = 16
PROMPT = list(range(1, 129))  # 8 blocks


def policy(cost: str) -> KvRoutingPolicy:
    config = KvRouterConfig(block_size=BLOCK, cost=cost, prefill_tokens_per_s=1000.0)
    return KvRoutingPolicy(config, rng=random.Random(0))


def stored(worker: int, event_id: int, tokens: list[int], lora: str) -> KvEventBatch:
    blocks = [StoredBlock(s, t) for s, t in hash_blocks(tokens, BLOCK, seed=lora_seed(lora))]
    return KvEventBatch(event_id=event_id, worker_id=worker, events=[BlockStored(parent_hash=None, blocks=blocks)])


def test_the_view_follows_reports_and_guesses_from_routing_in_between() -> None:
    view = AdapterView.of(["a", "b", "c"], max_loras=2)
    assert view.serves("a") and not view.serves("z") and view.cost_s("a") == DEFAULT_LOAD_S
    view.routed("a")
    view.routed("b")
    view.routed("c")  # past max_loras: the least recent (a) is out
    assert list(view.resident) == ["b", "c"] and view.cost_s("a") > 0 and view.cost_s("c") == 0
    view.reported(LoadMetrics(loras=["a"], lora_loads=7, lora_load_s=0.25))
    assert list(view.resident) == ["a"] and view.loads == 7 and view.cost_s("b") == 0.25
    after = view.updated(["b"], 2)  # a run-time unload of a and c
    assert after.served == {"b"} and list(after.resident) == [] and after.load_s == 0.25


@pytest.mark.parametrize("cost", ["time", "dynamo"])
def test_a_worker_with_the_adapter_loaded_wins_until_its_queue_costs_more_than_a_load(cost: str) -> None:
    kv = policy(cost)
    load = {1: DEFAULT_LOAD_S, 2: 0.0}  # loaded on 2 only
    chosen = kv.select(RouteRequest("r0", PROMPT, lora="a", lora_load_s=load), targets_of([1, 2]))
    assert chosen.target == Target(2)
    explained = {Target(c["worker_id"], c["dp_rank"]): c for c in chosen.explanation["candidates"]}
    if cost == "time":
        assert explained[Target(1)]["lora_load_s"] == DEFAULT_LOAD_S and explained[Target(2)]["lora_load_s"] == 0.0
    # worker 2 fills up with prompts (1 s of prefill queued at 1,000 tokens/s): the load elsewhere is cheaper
    for i in range(1, 9):
        kv.select(RouteRequest(f"q{i}", [10_000 * i + t for t in range(128)]), [Target(2)])
    assert kv.select(RouteRequest("r1", PROMPT, lora="a", lora_load_s=load), targets_of([1, 2])).target == Target(1)


def test_the_index_keeps_adapters_apart_and_the_base_model_sees_none_of_them() -> None:
    kv = policy("time")
    kv.apply_kv_events(stored(1, 0, PROMPT, "a"))
    kv.apply_kv_events(stored(2, 0, PROMPT, "b"))
    for lora, holder in [("a", 1), ("b", 2)]:
        decision = kv.select(
            RouteRequest(f"r-{lora}", PROMPT, lora=lora, lora_load_s={1: 0.0, 2: 0.0}), targets_of([1, 2])
        )
        assert (decision.target, decision.overlap_blocks) == (Target(holder), 8)
    base = kv.select(RouteRequest("r-base", PROMPT), targets_of([1, 2]))
    assert base.overlap_blocks == 0
    other = kv.select(RouteRequest("r-c", PROMPT, lora="c", lora_load_s={1: 0.0, 2: 0.0}), targets_of([1, 2]))
    assert other.overlap_blocks == 0
