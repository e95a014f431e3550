"""The time cost (routing/time_cost.py): worked examples computed by hand from the docstring's formula."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from dynamo_cli.routing import cost
from dynamo_cli.routing.cost import CandidateLoad, Candidates, Reason, Rounds, cost_table, select
from dynamo_cli.routing.target import Target
from dynamo_cli.routing.tier_costs import tier_costs
from dynamo_cli.routing.time_cost import MAX_PASS_S, PRIOR_PREFILL_TPS, Speed, SpeedEstimator
from tests.routing.configs import cost_config

TIME = cost_config(64, cost="time")
SPEED = Speed(prefill_tokens_per_s=20_000, lifetime_s=2.0, pass_s=0.0)
"""No tie band: the worked examples compare exact costs."""
ISL, BLOCKS = 2100, 32  # a 2,000-token system prompt (31 full blocks) + 100 unique tokens


def holder(queued: int = 0, **fields: int) -> CandidateLoad:
    """Caches the prompt's 31 blocks (active there too); a full cache of 512 blocks; 300 + 10 held."""
    base = dict(
        overlap_blocks=31,
        active_prefill_tokens=queued,
        active_blocks=300,
        active_overlap_blocks=31,
        cached_blocks=512,
        num_requests=10,
        capacity_blocks=512,
    )
    return CandidateLoad(Target(1), **{**base, **fields})


COLD = CandidateLoad(Target(2), active_blocks=200, num_requests=6, cached_blocks=512, capacity_blocks=512)
FULL = CandidateLoad(
    Target(3), overlap_blocks=31, active_blocks=500, num_requests=12, cached_blocks=512, capacity_blocks=512
)


def choose(*loads: CandidateLoad) -> tuple[int, list[dict[str, float]]]:
    selection = select(Candidates.from_loads(loads), ISL, BLOCKS, TIME, random.Random(0), SPEED)
    return selection.worker_id, [c.times | {"cost": c.logit} for c in selection.candidates]


def test_the_holder_costs_its_suffix_and_one_evicted_block() -> None:
    # U = 2100 - 31*64 = 116 -> 116/20000 = 0.0058 s; 1 new block, 0 free -> 1 evicted: 64/20000 = 0.0032 s;
    # held 310 + 1 needed + 1 <= 512 -> no KV wait
    _, (costs, _) = choose(holder(), COLD)

    expected = {
        "prefill_s": 0.0058,
        "onboard_s": 0.0,
        "evict_s": 0.0032,
        "memory_s": 0.0,
        "queue_s": 0.0,
        "cost": 0.009,
    }
    assert costs == pytest.approx(expected)


def test_a_cold_worker_pays_the_prompt_twice_under_cache_pressure() -> None:
    # U = 2100 -> 0.105 s; 32 new blocks, none free -> 32*64/20000 = 0.1024 s; 206 + 32 + 1 <= 512 -> 0
    chosen, (_, cold) = choose(holder(), COLD)

    expected = {
        "prefill_s": 0.105,
        "onboard_s": 0.0,
        "evict_s": 0.1024,
        "memory_s": 0.0,
        "queue_s": 0.0,
        "cost": 0.2074,
    }
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


ROOMY = dict(cached_blocks=4000, capacity_blocks=16_384)
"""A default-sized cache a quarter full: a copy evicts nothing and leaves it under half full."""


def test_without_pressure_a_copy_is_free_and_equal_costs_are_dealt_in_rounds() -> None:
    # nothing evicted, nothing waits; equal hits and queues tie -> one each per round, whatever the load
    loads = [
        CandidateLoad(Target(1), active_blocks=90, overlap_blocks=31, **ROOMY),
        CandidateLoad(Target(2), active_blocks=40, overlap_blocks=31, **ROOMY),
    ]
    candidates, rounds = Candidates.from_loads(loads), Rounds()
    picks = [select(candidates, ISL, BLOCKS, TIME, random.Random(0), SPEED, rounds) for _ in range(4)]

    assert [c.times["evict_s"] + c.times["memory_s"] for c in picks[0].candidates] == [0.0, 0.0]
    assert [(p.worker_id, p.reason) for p in picks] == [(1, Reason.TIE_TURN), (2, Reason.TIE_TURN)] * 2


def test_costs_within_one_pass_are_ties_and_costs_beyond_are_not() -> None:
    # T0 = 0.02 s: the holder with 300 tokens queued costs (300 + 116)/20000 = 0.0208, one with none 0.0058:
    # 15 ms apart -> a tie; with 500 queued 0.0308: 25 ms apart -> the idle holder, alone
    band = Speed(prefill_tokens_per_s=20_000, lifetime_s=2.0, pass_s=0.02)

    def pick(queued: int, rounds: Rounds) -> tuple[int, Reason]:
        loads = [
            CandidateLoad(Target(1), overlap_blocks=31, active_prefill_tokens=queued, **ROOMY),
            CandidateLoad(Target(2), overlap_blocks=31, **ROOMY),
        ]
        chosen = select(Candidates.from_loads(loads), ISL, BLOCKS, TIME, random.Random(0), band, rounds)
        return chosen.worker_id, chosen.reason

    ties, apart = Rounds(), Rounds()
    assert [pick(300, ties) for _ in range(2)] == [(1, Reason.TIE_TURN), (2, Reason.TIE_TURN)]
    assert [pick(500, apart) for _ in range(2)] == [(2, Reason.ARGMIN)] * 2


def test_a_worker_seen_mid_pass_is_dealt_later_in_the_round_and_no_other_twice() -> None:
    # Three near-ties, each with a prefill queued; worker 1's pass was seen starting 2 ms ago (busy 18 ms of
    # T0 = 20 ms), for two decisions: point 6 passes it over, and the round still deals 2, 3, then 1.
    # Taking near-ties by a turn counter instead sent both of those decisions to 2 (least queue plus busy):
    # two arrivals at one worker a few milliseconds apart, the second missing the first one's pass.
    band = Speed(prefill_tokens_per_s=20_000, lifetime_s=2.0, pass_s=0.02)
    rounds, picks = Rounds(), []
    loads = [CandidateLoad(Target(w), overlap_blocks=31, active_prefill_tokens=116, **ROOMY) for w in (1, 2, 3)]
    c = replace(Candidates.from_loads(loads), pass_elapsed_s=[0.002, float("inf"), float("inf")])
    for _ in range(4):
        picks.append(select(c, ISL, BLOCKS, TIME, random.Random(0), band, rounds).worker_id)

    assert picks == [2, 3, 1, 2]


def test_in_a_roomy_cache_a_copy_of_a_prompt_in_flight_is_free_and_of_one_idle_is_not() -> None:
    # a non-holder's U = 2,100, of which 1,984 beyond the holder's 116: free while the prompt is active
    # on some worker (a collision can happen), counted in full when it is not (a finished conversation)
    def cold_prefill(active_overlap: int) -> float:
        loads = [
            CandidateLoad(Target(1), overlap_blocks=31, active_overlap_blocks=active_overlap, **ROOMY),
            CandidateLoad(Target(2), **ROOMY),
        ]
        selection = select(Candidates.from_loads(loads), ISL, BLOCKS, TIME, random.Random(0), SPEED)
        return selection.candidates[1].times["prefill_s"]

    assert (cold_prefill(31), cold_prefill(0)) == pytest.approx((116 / 20_000, 2100 / 20_000))


def test_a_copy_that_would_fill_the_cache_past_half_costs_its_whole_prompt() -> None:
    # 8,170 cached + 32 new > 8,192 = half of 16,384: not roomy, the copy's 2,100 tokens count in full
    loads = [
        CandidateLoad(
            Target(1), overlap_blocks=31, active_overlap_blocks=31, cached_blocks=8170, capacity_blocks=16_384
        ),
        CandidateLoad(Target(2), cached_blocks=8170, capacity_blocks=16_384),
    ]
    selection = select(Candidates.from_loads(loads), ISL, BLOCKS, TIME, random.Random(0), SPEED)

    assert selection.candidates[1].times["prefill_s"] == pytest.approx(2100 / 20_000)


def test_a_hit_is_never_a_near_tie_however_wide_the_band() -> None:
    # a 200 ms band holds both (holder 0.0058 s, cold 0.105 s) but they differ in their own work: argmin
    wide = Speed(prefill_tokens_per_s=20_000, lifetime_s=2.0, pass_s=0.2)
    loads = [CandidateLoad(Target(1), overlap_blocks=31, **ROOMY), CandidateLoad(Target(2), **ROOMY)]
    rounds = Rounds()
    picks = [select(Candidates.from_loads(loads), ISL, BLOCKS, TIME, random.Random(0), wide, rounds) for _ in (0, 1)]

    assert [(p.worker_id, p.reason) for p in picks] == [(1, Reason.ARGMIN)] * 2


def test_a_cache_guessed_over_capacity_evicts_at_most_the_new_blocks() -> None:
    # approximate mode never sees evictions: 900 blocks guessed on a 512-block worker; 32 new -> 32 evicted
    _, (costs,) = choose(CandidateLoad(Target(1), cached_blocks=900, capacity_blocks=512))

    assert costs["evict_s"] == pytest.approx(32 * 64 / 20_000)


def test_an_unknown_capacity_leaves_only_the_prefill_term() -> None:
    _, (costs,) = choose(CandidateLoad(Target(1), active_prefill_tokens=900, active_blocks=10_000))

    expected = {
        "prefill_s": 0.15,
        "onboard_s": 0.0,
        "evict_s": 0.0,
        "memory_s": 0.0,
        "queue_s": 900 / 20_000,
        "cost": 0.15,
    }
    assert costs == pytest.approx(expected)


def random_candidates(rng: random.Random, n: int) -> Candidates:
    """n candidates drawn over the cost's branches: hits, host and disk hits, queues, full and unknown caches,
    prompts in flight, passes seen running."""
    loads, idle = [], rng.choice([0, 1])  # idle 0: every candidate has a prefill queued (point 6 applies)
    for w in range(n):
        overlap, capacity = rng.choice([0, 31, rng.randrange(32)]), rng.choice([0, 512, 16_384])
        host = rng.randrange(overlap + 1)
        loads.append(
            CandidateLoad(
                w,
                overlap,
                rng.choice([idle, 116, rng.randrange(1, 9000)]),
                rng.randrange(600),
                rng.choice([0, 31, rng.randrange(32)]),
                rng.choice([capacity, rng.randrange(900)]),
                rng.randrange(20),
                capacity,
                host,
                rng.randrange(overlap - host + 1),
            )
        )
    elapsed = [rng.choice([float("inf"), rng.random() * 0.03]) for _ in range(n)]
    return replace(Candidates.from_loads(loads), pass_elapsed_s=rng.choice([None, elapsed]))


@pytest.mark.parametrize("n", [1, 4, 40])
def test_the_cost_per_candidate_and_per_column_agree_to_the_last_bit(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    # the same time_terms on numbers (few candidates) and on numpy arrays (many): identical floats
    seeds = range(n * 1000, n * 1000 + 200)
    tiers = tier_costs(block_size=64, bytes_per_block=1 << 20, host_gbs=10, disk_gbs=2, prefill_tps=20_000, weights={})
    config, speed = replace(TIME, tiers=tiers), Speed(prefill_tokens_per_s=30_000, lifetime_s=2.0, pass_s=0.02)
    tables = {}
    for vector_min in (1, 10**9):
        monkeypatch.setattr(cost, "VECTOR_MIN", vector_min)
        tables[vector_min] = [
            cost_table(random_candidates(random.Random(seed), n), ISL, BLOCKS, config, speed) for seed in seeds
        ]
    columns, rows = tables[1], tables[10**9]

    assert [(t.logits, t.times) for t in columns] == [(t.logits, t.times) for t in rows]
    assert any("busy_s" in t.times and any(t.times["busy_s"]) for t in rows)  # every branch was reached
    assert any(any(t.times["onboard_s"]) and any(t.times["evict_s"]) and any(t.times["memory_s"]) for t in rows)


def test_the_prefill_speed_is_learned_from_time_to_first_token() -> None:
    estimator = SpeedEstimator()
    assert estimator.speed.prefill_tokens_per_s == PRIOR_PREFILL_TPS
    for n in range(200):  # a 20 ms floor plus 1 s per 50,000 uncached tokens
        uncached = 116 if n % 3 else 2100
        estimator.observe_first_token(uncached, 0.020 + uncached / 50_000)

    assert estimator.speed.prefill_tokens_per_s == pytest.approx(50_000)
    assert estimator.speed.pass_s == pytest.approx(0.020)  # the floor is the fit's intercept, T0


def test_same_length_prompts_keep_the_prior_and_a_set_speed_is_kept() -> None:
    learner, fixed = SpeedEstimator(), SpeedEstimator(prefill_tokens_per_s=9_000)
    for _ in range(100):
        learner.observe_first_token(116, 0.05)
        fixed.observe_first_token(116 if _ % 2 else 4000, 0.05 + _ % 2)

    assert learner.speed.prefill_tokens_per_s == PRIOR_PREFILL_TPS
    assert fixed.speed.prefill_tokens_per_s == 9_000
    # T0 = mean TTFT - mean uncached / R still follows: 0.05 - 116 / 20,000 for the learner
    assert learner.speed.pass_s == pytest.approx(0.05 - 116 / PRIOR_PREFILL_TPS)


def test_a_noisy_intercept_is_clamped_so_it_cannot_make_every_worker_a_tie() -> None:
    estimator = SpeedEstimator(prefill_tokens_per_s=1000)
    for _ in range(50):
        estimator.observe_first_token(100, 5.0)  # 5 s queues behind a few uncached tokens

    assert estimator.speed.pass_s == MAX_PASS_S


def test_the_lifetime_is_a_running_mean_of_time_in_flight() -> None:
    estimator = SpeedEstimator()
    for seconds in (1.0, 3.0):
        estimator.observe_lifetime(seconds)

    assert estimator.speed.lifetime_s == pytest.approx(2.0)
