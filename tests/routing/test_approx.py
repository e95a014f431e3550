"""Approximate mode: routed prefixes count as cached for a TTL, within a size cap."""

from __future__ import annotations

from dynamo_cli.routing.approx import ApproxConfig, ApproxIndexer
from dynamo_cli.routing.target import Target

A, B, C, D = 1, 2, 3, 4


def test_a_routed_prefix_counts_as_cached_until_its_ttl_runs_out() -> None:
    approx = ApproxIndexer(ApproxConfig(ttl_s=120.0))
    approx.record(Target(1), [A, B, C], now=10.0)

    assert approx.find_matches([A, B, C, D], now=10.0) == {Target(1): 3}
    assert approx.find_matches([A, B, C, D], now=129.999) == {Target(1): 3}
    assert approx.find_matches([A, B, C, D], now=130.0) == {}
    assert (len(approx), approx.num_blocks(Target(1)), approx.num_expired) == (0, 0, 3)


def test_routing_the_same_blocks_again_refreshes_them() -> None:
    approx = ApproxIndexer(ApproxConfig(ttl_s=120.0))
    approx.record(Target(1), [A, B, C], now=0.0)
    approx.record(Target(1), [A, B], now=100.0)

    assert approx.find_matches([A, B, C], now=120.0) == {Target(1): 2}  # C expired at 120, A and B live to 220
    assert approx.find_matches([A, B, C], now=219.0) == {Target(1): 2}
    assert approx.find_matches([A, B, C], now=220.0) == {}


def test_the_default_ttl_is_120_seconds() -> None:
    assert ApproxIndexer().config.ttl_s == 120.0
    assert ApproxIndexer().config.prune_fraction == 0.8


def test_past_the_cap_the_earliest_expiring_entries_are_pruned_to_80_percent() -> None:
    approx = ApproxIndexer(ApproxConfig(ttl_s=120.0, max_blocks=10))
    approx.record(Target(1), [A, B, C, D], now=0.0)
    approx.record(Target(2), [A, B, C, D], now=1.0)
    assert len(approx) == 8
    approx.record(Target(3), [A, B, C, D], now=2.0)  # 12 entries > 10: prune to 8

    assert len(approx) == 8
    assert approx.num_pruned == 4
    assert approx.find_matches([A, B, C, D], now=2.0) == {Target(2): 4, Target(3): 4}


def test_pruning_skips_entries_refreshed_since() -> None:
    approx = ApproxIndexer(ApproxConfig(ttl_s=120.0, max_blocks=4))
    approx.record(Target(1), [A, B], now=0.0)
    approx.record(Target(2), [A, B], now=1.0)
    approx.record(Target(1), [A, B], now=2.0)  # worker 1 refreshed: worker 2 now expires first
    approx.record(Target(3), [C], now=3.0)  # 5 entries > 4: prune to 3

    assert approx.find_matches([A, B], now=3.0) == {Target(1): 2}
    assert approx.num_blocks(Target(2)) == 0
    assert len(approx) == 3


def test_removing_a_worker_forgets_its_entries() -> None:
    approx = ApproxIndexer()
    approx.record(Target(1), [A, B], now=0.0)
    approx.record(Target(2), [A], now=0.0)
    approx.remove_worker(1)

    assert approx.find_matches([A, B], now=1.0) == {Target(2): 1}
    assert len(approx) == 1
    assert approx.expire(now=500.0) == 1
