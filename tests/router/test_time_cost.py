"""The time cost (router/time_cost.py): worked examples computed by hand from the docstring's formula."""

from __future__ import annotations

import random

import pytest

from dynamo_cli.router.cost import CandidateLoad, Candidates, CostConfig, Reason, select
from dynamo_cli.router.time_cost import PRIOR_PREFILL_TPS, Speed, SpeedEstimator

TIME = CostConfig(block_size=64, cost="time")
SPEED = Speed(prefill_tokens_per_s=20_000, lifetime_s=2.0)
ISL, BLOCKS = 2100, 32  # a 2,000-token system prompt (31 full blocks) + 100 unique tokens


def holder(queued: int = 0, **fields: int) -> CandidateLoad:
    """Caches the prompt's 31 blocks (active there too); a full cache of 512 blocks; 300 + 10 held."""
    base = dict(overlap_blocks=31, active_prefill_tokens=queued, active_blocks=300, active_overlap_blocks=31,
                cached_blocks=512, num_requests=10, capacity_blocks=512)  # fmt: skip
    return CandidateLoad(1, **{**base, **fields})


COLD = CandidateLoad(2, active_blocks=200, num_requests=6, cached_blocks=512, capacity_blocks=512)
FULL = CandidateLoad(3, overlap_blocks=31, active_blocks=500, num_requests=12, cached_blocks=512, capacity_blocks=512)


def choose(*loads: CandidateLoad) -> tuple[int, list[dict[str, float]]]:
    selection = select(Candidates.from_loads(loads), ISL, BLOCKS, TIME, random.Random(0), SPEED)
    return selection.worker_id, [c.times | {"cost": c.logit} for c in selection.candidates]


def test_the_holder_costs_its_suffix_and_one_evicted_block() -> None:
    # U = 2100 - 31*64 = 116 -> 116/20000 = 0.0058 s; 1 new block, 0 free -> 1 evicted: 64/20000 = 0.0032 s;
    # held 310 + 1 needed + 1 <= 512 -> no KV wait
    _, (costs, _) = choose(holder(), COLD)

    expected = {"prefill_s": 0.0058, "onboard_s": 0.0, "evict_s": 0.0032, "memory_s": 0.0, "cost": 0.009}
    assert costs == pytest.approx(expected)


def test_a_cold_worker_pays_the_prompt_twice_under_cache_pressure() -> None:
    # U = 2100 -> 0.105 s; 32 new blocks, none free -> 32*64/20000 = 0.1024 s; 206 + 32 + 1 <= 512 -> 0
    chosen, (_, cold) = choose(holder(), COLD)

    expected = {"prefill_s": 0.105, "onboard_s": 0.0, "evict_s": 0.1024, "memory_s": 0.0, "cost": 0.2074}
    assert cold == pytest.approx(expected)
    assert chosen == 1


def test_a_holder_out_of_kv_waits_for_blocks_to_be_freed() -> None:
    # needs 32 blocks (none active there) + 1: 512 + 33 - 512 = 33 over; freed at 512/2 s -> 33*2/512 s
    _, (_, _, full) = choose(holder(), COLD, FULL)

    assert full["memory_s"] == pytest.approx(33 * 2 / 512)
    assert full["cost"] == pytest.approx(0.0058 + 0.0032 + 0.12890625)


@pytest.mark.parametrize(("queued", "winner"), [(3967, 1), (3969, 2)])
def test_the_holder_loses_only_with_two_prompts_queued(queued: int, winner: int) -> None:
    # holder: (Q + 116)/20000 + 0.0032 < 0.2074 exactly when Q < 3968 = 2 * 1984 tokens
    assert choose(holder(queued), COLD)[0] == winner


def test_without_pressure_a_copy_is_free_and_load_breaks_the_tie() -> None:
    # default-sized caches: nothing evicted, nothing waits; equal hits and queues tie -> fewer active blocks
    roomy = dict(overlap_blocks=31, cached_blocks=4000, capacity_blocks=16_384)
    loads = [CandidateLoad(1, active_blocks=90, **roomy), CandidateLoad(2, active_blocks=40, **roomy)]
    selection = select(Candidates.from_loads(loads), ISL, BLOCKS, TIME, random.Random(0), SPEED)

    assert [c.times["evict_s"] + c.times["memory_s"] for c in selection.candidates] == [0.0, 0.0]
    assert (selection.worker_id, selection.reason, selection.margin) == (2, Reason.TIE_LOAD, 0.0)


def test_a_tie_goes_to_fewer_requests_before_fewer_active_blocks() -> None:
    # 10 requests sharing one prompt hold 60 unique blocks; 6 requests of 6 prompts hold 200: each request
    # still costs a decode slot, so the worker with 6 wins the tie
    roomy = dict(overlap_blocks=31, cached_blocks=4000, capacity_blocks=16_384)
    loads = [CandidateLoad(1, active_blocks=60, num_requests=10, **roomy),
             CandidateLoad(2, active_blocks=200, num_requests=6, **roomy)]  # fmt: skip
    selection = select(Candidates.from_loads(loads), ISL, BLOCKS, TIME, random.Random(0), SPEED)
    assert (selection.worker_id, selection.reason) == (2, Reason.TIE_LOAD)


def test_a_cache_guessed_over_capacity_evicts_at_most_the_new_blocks() -> None:
    # approximate mode never sees evictions: 900 blocks guessed on a 512-block worker; 32 new -> 32 evicted
    _, (costs,) = choose(CandidateLoad(1, cached_blocks=900, capacity_blocks=512))

    assert costs["evict_s"] == pytest.approx(32 * 64 / 20_000)


def test_an_unknown_capacity_leaves_only_the_prefill_term() -> None:
    _, (costs,) = choose(CandidateLoad(1, active_prefill_tokens=900, active_blocks=10_000))

    assert costs == pytest.approx({"prefill_s": 0.15, "onboard_s": 0.0, "evict_s": 0.0, "memory_s": 0.0, "cost": 0.15})


def test_the_prefill_speed_is_learned_from_time_to_first_token() -> None:
    estimator = SpeedEstimator()
    assert estimator.speed.prefill_tokens_per_s == PRIOR_PREFILL_TPS
    for n in range(200):  # a 20 ms floor plus 1 s per 50,000 uncached tokens
        uncached = 116 if n % 3 else 2100
        estimator.observe_first_token(uncached, 0.020 + uncached / 50_000)

    assert estimator.speed.prefill_tokens_per_s == pytest.approx(50_000)


def test_same_length_prompts_keep_the_prior_and_a_set_speed_is_kept() -> None:
    learner, fixed = SpeedEstimator(), SpeedEstimator(prefill_tokens_per_s=9_000)
    for _ in range(100):
        learner.observe_first_token(116, 0.05)
        fixed.observe_first_token(116 if _ % 2 else 4000, 0.05 + _ % 2)

    assert learner.speed.prefill_tokens_per_s == PRIOR_PREFILL_TPS
    assert fixed.speed.prefill_tokens_per_s == 9_000


def test_the_lifetime_is_a_running_mean_of_time_in_flight() -> None:
    estimator = SpeedEstimator()
    for seconds in (1.0, 3.0):
        estimator.observe_lifetime(seconds)

    assert estimator.speed.lifetime_s == pytest.approx(2.0)
