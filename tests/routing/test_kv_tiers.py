"""The router sees the KV tiers: per-tier holdings in the indexer, lower-tier hits worth less, explained."""

from __future__ import annotations

import random

import pytest

from dynamo_cli.config import KvRouterConfig, parse_tier_weights
from dynamo_cli.errors import ConfigError
from dynamo_cli.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvDump,
    KvEvent,
    KvEventBatch,
    StoredBlock,
)
from dynamo_cli.kv.hashing import sequence_hashes
from dynamo_cli.model_card import ModelCard
from dynamo_cli.routing.base import RouteRequest
from dynamo_cli.routing.cost import CandidateLoad, Candidates, select
from dynamo_cli.routing.indexer import KvIndexer, TierHits
from dynamo_cli.routing.kv_policy import KvRoutingPolicy, config_tier_costs
from dynamo_cli.routing.target import Target, targets_of
from dynamo_cli.routing.tier_costs import tier_costs
from dynamo_cli.routing.time_cost import Speed
from tests.routing.configs import cost_config

A, B, C, D = 101, 102, 103, 104
BLOCK = 16


def stored(*hashes: int, tier: str = "device") -> BlockStored:
    return BlockStored(parent_hash=None, blocks=[StoredBlock(h, h + 1_000) for h in hashes], tier=tier)  # type: ignore[arg-type]


def removed(*hashes: int, tier: str = "device") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), tier=tier)  # type: ignore[arg-type]


def feed(indexer: KvIndexer, worker: int, *events: KvEvent) -> None:
    indexer.apply_batch(KvEventBatch(event_id=indexer.next_event_id(worker), worker_id=worker, events=list(events)))


def hits(indexer: KvIndexer, hashes: list[int]) -> dict[Target, tuple[int, int, int]]:
    matches = indexer.find_matches(hashes)
    split = indexer.tier_hits(hashes, matches)
    return {w: (lambda t: (t.device, t.host, t.disk))(split.get(w, TierHits(n, 0, 0))) for w, n in matches.items()}


##### The indexer #####


def test_a_block_moved_to_host_still_matches_and_counts_as_a_host_hit() -> None:
    indexer = KvIndexer()
    feed(indexer, 1, stored(A, B, C, D))
    feed(indexer, 1, stored(C, D, tier="host"), removed(C, D))  # the engine offloads its two last blocks

    assert hits(indexer, [A, B, C, D]) == {Target(1): (2, 2, 0)}
    assert indexer.num_blocks(Target(1)) == 2  # on device: the time cost's cached blocks K
    assert indexer.blocks_of(Target(1), "device") == {A, B} and indexer.blocks_of(Target(1), "host") == {C, D}
    assert indexer.blocks_of(Target(1)) == {A, B, C, D}

    feed(indexer, 1, stored(C))  # onboarded back: device is the fastest tier holding it
    assert hits(indexer, [A, B, C, D]) == {Target(1): (3, 1, 0)}


def test_disk_only_blocks_match_and_the_fastest_tier_counts() -> None:
    indexer = KvIndexer()
    feed(indexer, 1, stored(A, B, tier="disk"), stored(A, tier="host"))
    feed(indexer, 2, stored(A, B, C))

    assert hits(indexer, [A, B, C]) == {Target(1): (0, 1, 1), Target(2): (3, 0, 0)}
    assert indexer.block_counts(targets_of([1, 2])) == [0, 3]


def test_a_block_leaves_the_index_only_when_its_last_tier_drops_it() -> None:
    indexer = KvIndexer()
    feed(indexer, 1, stored(A, B), stored(A, B, tier="host"), stored(B, tier="disk"))
    feed(indexer, 1, removed(A, B))  # off device: still on host
    assert hits(indexer, [A, B]) == {Target(1): (0, 2, 0)}
    feed(indexer, 1, removed(A, B, tier="host"))  # A is gone, B is still on disk
    assert indexer.find_matches([A, B]) == {} and indexer.blocks_of(Target(1)) == {B}
    feed(indexer, 1, removed(B, tier="host"), removed(C, tier="disk"))  # not held there: ignored
    assert indexer.blocks_of(Target(1), "disk") == {B}
    feed(indexer, 1, removed(B, tier="disk"))
    assert indexer.blocks_of(Target(1)) == frozenset()
    assert indexer.tier_hits([B], {Target(1): 1}) == {}  # back to device-only


def test_a_clear_drops_the_device_tier_and_a_dump_restores_each() -> None:
    indexer = KvIndexer()
    feed(indexer, 1, stored(A, B, C), stored(C, tier="host"), stored(D, tier="disk"))
    feed(indexer, 1, AllBlocksCleared())  # the engine's own cache; its host and disk blocks stay
    assert indexer.blocks_of(Target(1)) == {C, D} and indexer.num_blocks(Target(1)) == 0
    assert indexer.find_matches([A, B]) == {} and hits(indexer, [C, D]) == {Target(1): (0, 1, 1)}
    indexer.clear_worker(1)  # a dump or a departure: every tier
    assert indexer.blocks_of(Target(1)) == frozenset()

    indexer.load_dump(KvDump(worker_id=1, block_hashes=[A], last_event_id=5, host_hashes=[A, B], disk_hashes=[C]))
    assert hits(indexer, [A, B, C, D]) == {Target(1): (1, 1, 1)}
    assert [indexer.blocks_of(Target(1), t) for t in ("device", "host", "disk")] == [{A}, {A, B}, {C}]
    assert indexer.next_event_id(1) == 6
    indexer.remove_worker(1)
    assert indexer.find_matches([A]) == {} and indexer.blocks_of(Target(1), "host") == frozenset()


##### The cost #####

SPEED = Speed(prefill_tokens_per_s=20_000, lifetime_s=2.0)
TIERS = tier_costs(block_size=BLOCK, bytes_per_block=2 << 20, host_gbs=20, disk_gbs=4, prefill_tps=20_000)
LOADS = [  # equal load; an 8-block prefix held on device, host, disk, or not at all
    CandidateLoad(Target(1), overlap_blocks=8, cached_blocks=8),
    CandidateLoad(Target(2), overlap_blocks=8, host_blocks=8),
    CandidateLoad(Target(3), overlap_blocks=8, disk_blocks=8),
    CandidateLoad(Target(4)),
]


@pytest.mark.parametrize("cost", ["time", "dynamo"])
def test_a_device_hit_beats_a_host_hit_beats_a_disk_hit_beats_a_miss(cost: str) -> None:
    config = cost_config(BLOCK, cost=cost, tiers=TIERS)
    selection = select(Candidates.from_loads(LOADS), 8 * BLOCK + 5, 8, config, random.Random(0), SPEED)

    logits = [c.logit for c in selection.candidates]
    assert logits == sorted(logits) and len(set(logits)) == 4
    assert selection.target == Target(1)


def test_the_time_cost_charges_the_onboard_time_instead_of_the_recompute() -> None:
    config = cost_config(BLOCK, cost="time", tiers=TIERS)
    rows = select(Candidates.from_loads(LOADS), 8 * BLOCK, 8, config, random.Random(0), SPEED).candidates

    # 8 blocks of 2 MiB: 8 * 2097152 / 20e9 + 20 us from host, / 4e9 + 200 us from disk; a miss recomputes 128 tokens
    assert [r.times["onboard_s"] for r in rows] == pytest.approx(
        [0, 8 * 2097152 / 20e9 + 20e-6, 8 * 2097152 / 4e9 + 200e-6, 0]
    )
    assert rows[3].times["prefill_s"] == pytest.approx(128 / 20_000)
    assert [r.hits for r in rows[:3]] == [
        {"device": 8, "host": 0, "disk": 0},
        {"device": 0, "host": 8, "disk": 0},
        {"device": 0, "host": 0, "disk": 8},
    ]


def test_weights_derive_from_bandwidths_and_a_flag_overrides_them() -> None:
    # 2 MiB per block: 105 us from host, 524 us from disk, against 800 us to recompute 16 tokens at 20 k/s
    assert (TIERS.host_weight, TIERS.disk_weight) == pytest.approx((1 - 104.8576e-6 / 800e-6, 1 - 524.288e-6 / 800e-6))
    slow = tier_costs(block_size=BLOCK, bytes_per_block=2 << 20, host_gbs=20, disk_gbs=0.5, prefill_tps=20_000)
    assert slow.disk_weight == 0.0  # an onboard slower than recomputing saves nothing
    weights = parse_tier_weights("host=0.5, disk=0.25")
    config = KvRouterConfig(block_size=BLOCK, tier_weights=weights, kv_bytes_per_block=1 << 20)
    assert (config_tier_costs(config).host_weight, config_tier_costs(config).disk_weight) == (0.5, 0.25)
    with pytest.raises(ConfigError, match="host=W,disk=W"):
        parse_tier_weights("gpu=1")
    with pytest.raises(ConfigError, match="tier_weights"):
        KvRouterConfig(tier_weights=(("host", 2.0),))


def test_bytes_per_block_come_from_the_card_else_a_default_per_token() -> None:
    card = ModelCard(display_name="m", tokenizer_source="", engine="mocker", kv_cache_block_size=32)
    assert KvRouterConfig().for_card(card).kv_bytes_per_block == 131_072 * 32
    published = ModelCard(display_name="m", tokenizer_source="", engine="mocker", kv_bytes_per_block=4096)
    assert KvRouterConfig().for_card(published).kv_bytes_per_block == 4096


##### The policy: events in, explained decisions out #####


def test_the_explanation_shows_each_candidates_hits_per_tier() -> None:
    kv = KvRoutingPolicy(KvRouterConfig(block_size=BLOCK, kv_bytes_per_block=2 << 20), rng=random.Random(0))
    tokens = list(range(1, 8 * BLOCK + 1))
    hashes = sequence_hashes(tokens, BLOCK)
    kv.indexer.store_blocks(Target(1), hashes[:4])
    kv.indexer.store_blocks(Target(1), hashes[4:], "host")
    kv.indexer.store_blocks(Target(2), hashes, "disk")

    decision = kv.select(RouteRequest("r", tokens + [7]), targets_of([1, 2, 3]))
    rows = {Target(c["worker_id"], c["dp_rank"]): c for c in decision.explanation["candidates"]}
    assert rows[Target(1)]["hits"] == {"device": 4, "host": 4, "disk": 0} and rows[Target(1)]["overlap_blocks"] == 8
    assert rows[Target(2)]["hits"] == {"device": 0, "host": 0, "disk": 8}
    assert rows[Target(3)]["hits"] == {"device": 0, "host": 0, "disk": 0}
    assert 0 < rows[Target(1)]["onboard_s"] < rows[Target(2)]["onboard_s"] and decision.target == Target(1)
    assert (kv.counters.num_hit_blocks, kv.counters.num_host_hit_blocks, kv.counters.num_disk_hit_blocks) == (8, 4, 0)


def test_a_restarted_worker_announcing_its_disk_tier_is_routable_at_once() -> None:
    kv = KvRoutingPolicy(KvRouterConfig(block_size=BLOCK), rng=random.Random(0))
    tokens = list(range(1, 16 * BLOCK + 1))
    hashes = sequence_hashes(tokens, BLOCK)
    kv.apply_kv_events(KvEventBatch(event_id=0, worker_id=1, events=[stored(*hashes)]))
    kv.remove_worker(1)  # the worker died; it comes back as a new instance on the same disk directory
    blocks = [StoredBlock(h, 0) for h in hashes]
    kv.apply_kv_events(
        KvEventBatch(event_id=0, worker_id=9, events=[BlockStored(parent_hash=None, blocks=blocks, tier="disk")])
    )

    decision = kv.select(RouteRequest("r", tokens), targets_of([8, 9]))  # 8: a fresh worker with an empty cache
    assert decision.target == Target(9) and decision.overlap_blocks == 16
    assert kv.take_gaps() == []


def test_a_ranked_cards_capacity_is_each_ranks_for_the_cost() -> None:
    card = ModelCard(display_name="m", tokenizer_source="-", engine="mocker", total_kv_blocks=1024, dp_size=4)
    assert KvRouterConfig().for_card(card).total_kv_blocks == 256  # a target is one rank: its cache is a quarter
    assert KvRouterConfig(total_kv_blocks=100).for_card(card).total_kv_blocks == 100  # a setting wins
