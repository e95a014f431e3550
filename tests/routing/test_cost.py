"""Worker selection: the cost formula, tie-breaks, softmax sampling and the hot-spot guard."""

from __future__ import annotations

import math
import random

import pytest

from dynamo_cli.routing.cost import (
    CandidateLoad,
    Reason,
    candidate_cost,
    explain_pinned,
    is_hot_spot,
    select_worker,
    softmax_sample,
)
from dynamo_cli.routing.target import Target
from tests.routing.configs import cost_config

CONFIG = cost_config(16, cost="dynamo")

# Reference dynamo.md 4.5: weight 1, W1 = 8 + 10 = 18, W2 = 5 + 5 = 10 (chosen), W3 = 2 + 9 = 11.
# A 4-block request (isl 64, block size 16):
WORKED_EXAMPLE = [
    # no cached prefix: 64 uncached + 64 queued = 8 prefill blocks; 6 active + 4 new = 10 decode blocks
    CandidateLoad(target=Target(1), overlap_blocks=0, active_prefill_tokens=64, active_blocks=6, cached_blocks=50),
    # 3 cached: 16 uncached + 64 queued = 5 blocks; 4 active (3 of them this prefix) + 1 new = 5
    CandidateLoad(Target(2), overlap_blocks=3, active_prefill_tokens=64, active_blocks=4, active_overlap_blocks=3),
    # all 4 cached: 0 uncached + 32 queued = 2 blocks; 9 active (the 4 of this prefix among them) + 0 new = 9
    CandidateLoad(Target(3), overlap_blocks=4, active_prefill_tokens=32, active_blocks=9, active_overlap_blocks=4),
]


def test_the_worked_example_costs_18_10_11_and_chooses_the_second_worker() -> None:
    selection = select_worker(WORKED_EXAMPLE, isl=64, num_blocks=4, config=CONFIG, rng=random.Random(0))

    terms = [(c.prefill_blocks, c.decode_blocks, c.logit) for c in selection.candidates]
    assert terms == [(8.0, 10, 18.0), (5.0, 5, 10.0), (2.0, 9, 11.0)]
    assert selection.worker_id == 2
    assert selection.reason is Reason.ARGMIN
    assert selection.margin == 1.0


def test_the_explanation_lists_every_candidates_terms_and_the_margin() -> None:
    selection = select_worker(WORKED_EXAMPLE, isl=64, num_blocks=4, config=CONFIG, rng=random.Random(0))

    explanation = selection.to_dict()
    assert explanation["worker_id"] == 2
    assert explanation["reason"] == "argmin"
    assert explanation["margin"] == 1.0
    assert explanation["candidates"][1] == {
        "worker_id": 2,
        "dp_rank": 0,
        "overlap_blocks": 3,
        "hits": {"device": 3, "host": 0, "disk": 0},
        "prefill_blocks": 5.0,
        "decode_blocks": 5,
        "logit": 10.0,
        "active_blocks": 4,
        "cached_blocks": 0,
    }


def test_prefill_blocks_are_fractional_and_never_negative() -> None:
    partial = candidate_cost(CandidateLoad(Target(1), overlap_blocks=4), isl=70, num_blocks=4, config=CONFIG)
    over = candidate_cost(CandidateLoad(Target(1), overlap_blocks=9), isl=70, num_blocks=4, config=CONFIG)

    assert partial.prefill_blocks == 6 / 16
    assert over.prefill_blocks == 0.0


def test_the_weight_scales_only_the_prefill_term() -> None:
    config = cost_config(16, cost="dynamo", overlap_score_weight=2.5)
    cost = candidate_cost(WORKED_EXAMPLE[0], isl=64, num_blocks=4, config=config)

    assert cost.logit == 2.5 * 8 + 10


def test_weight_zero_balances_load_alone() -> None:
    config = cost_config(16, cost="dynamo", overlap_score_weight=0.0)
    selection = select_worker(WORKED_EXAMPLE, isl=64, num_blocks=4, config=config, rng=random.Random(0))

    assert [c.logit for c in selection.candidates] == [10.0, 5.0, 9.0]
    assert selection.worker_id == 2


def test_a_tie_goes_to_the_worker_with_the_smaller_cache() -> None:
    loads = [
        CandidateLoad(Target(1), cached_blocks=30),
        CandidateLoad(Target(2), cached_blocks=10),
        CandidateLoad(Target(3), cached_blocks=20),
    ]
    for seed in range(20):
        selection = select_worker(loads, isl=32, num_blocks=2, config=CONFIG, rng=random.Random(seed))
        assert (selection.worker_id, selection.reason, selection.margin) == (2, Reason.TIE_CACHE, 0.0)


def test_a_full_tie_is_broken_at_random_reproducibly_from_the_seed() -> None:
    loads = [CandidateLoad(Target(worker)) for worker in (1, 2, 3)]

    def choices(seed: int) -> list[int]:
        rng = random.Random(seed)
        return [select_worker(loads, 32, 2, CONFIG, rng).worker_id for _ in range(30)]

    assert choices(7) == choices(7)
    assert set(choices(7)) == {1, 2, 3}
    assert select_worker(loads, 32, 2, CONFIG, random.Random(7)).reason is Reason.TIE_RANDOM


def test_temperature_zero_is_deterministic_whatever_the_seed() -> None:
    chosen = {select_worker(WORKED_EXAMPLE, 64, 4, CONFIG, random.Random(seed)).worker_id for seed in range(50)}

    assert chosen == {2}


def test_a_single_candidate_has_no_margin() -> None:
    selection = select_worker([CandidateLoad(Target(9))], isl=16, num_blocks=1, config=CONFIG, rng=random.Random(0))

    assert (selection.worker_id, selection.reason, selection.margin) == (9, Reason.ONLY, None)


class FixedDraw(random.Random):
    """An rng whose `random()` returns a chosen value."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def test_softmax_probabilities_follow_the_normalised_logits() -> None:
    # logits 10 and 11, range 1, T = 1: weights exp(0) and exp(-1); p(first) = 1 / (1 + e^-1) ~ 0.7311
    p_first = 1 / (1 + math.exp(-1))

    assert softmax_sample([10.0, 11.0], 1.0, FixedDraw(p_first - 1e-6)) == 0
    assert softmax_sample([10.0, 11.0], 1.0, FixedDraw(p_first + 1e-6)) == 1


def test_softmax_with_equal_logits_is_uniform() -> None:
    rng = random.Random(3)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[softmax_sample([4.0, 4.0, 4.0], 0.5, rng)] += 1

    assert all(900 < count < 1100 for count in counts)


def test_temperature_above_zero_samples_reproducibly_and_marks_the_reason() -> None:
    config = cost_config(16, cost="dynamo", temperature=1.0)

    def choices(seed: int) -> list[int]:
        rng = random.Random(seed)
        return [select_worker(WORKED_EXAMPLE, 64, 4, config, rng).worker_id for _ in range(200)]

    assert choices(1) == choices(1)
    assert set(choices(1)) == {1, 2, 3}
    assert select_worker(WORKED_EXAMPLE, 64, 4, config, random.Random(1)).reason is Reason.SOFTMAX


GUARD = cost_config(16, cost="dynamo", hot_spot_min_blocks=100, hot_spot_ratio=0.5)


@pytest.mark.parametrize(
    ("active_blocks", "expected"),
    [
        pytest.param([0, 100], True, id="absolute-exactly-at-100"),
        pytest.param([1, 100], False, id="absolute-one-below-100"),
        pytest.param([500, 1000], True, id="relative-exactly-at-half-of-max"),
        pytest.param([501, 1000], False, id="relative-just-below-half-of-max"),
        pytest.param([0, 99], False, id="idle-pool-below-absolute"),
        pytest.param([0, 500, 100], True, id="max-minus-min-over-three"),
        pytest.param([5000], False, id="single-candidate"),
    ],
)
def test_the_hot_spot_guard_triggers_exactly_at_its_thresholds(active_blocks: list[int], expected: bool) -> None:
    assert is_hot_spot(active_blocks, GUARD) is expected


def test_the_hot_spot_guard_can_be_switched_off() -> None:
    off = cost_config(16, cost="dynamo", hot_spot_guard=False, hot_spot_min_blocks=100, hot_spot_ratio=0.5)

    assert is_hot_spot([0, 100_000], off) is False


HOT = [
    # holds the whole 64-block prompt, already active there: no new work, but 130 blocks in flight
    CandidateLoad(Target(1), overlap_blocks=64, active_blocks=130, active_overlap_blocks=64, cached_blocks=5000),
    # idle but cold: the whole prompt to prefill behind 160 queued tokens
    CandidateLoad(Target(2), active_prefill_tokens=160),
]


def test_over_the_thresholds_the_least_loaded_worker_wins_despite_the_cache() -> None:
    selection = select_worker(HOT, isl=1024, num_blocks=64, config=GUARD, rng=random.Random(0))

    assert selection.worker_id == 2
    assert selection.reason is Reason.HOT_SPOT
    assert selection.ranked_by == "load"
    assert selection.margin == 130 - 10.0  # loads: 130 active blocks vs 160 / 16 queued prefill blocks
    assert [c.logit for c in selection.candidates] == [0.0 + 130, 74.0 + 64]


def test_without_the_guard_the_cache_wins_the_same_case() -> None:
    off = cost_config(16, cost="dynamo", hot_spot_guard=False)
    selection = select_worker(HOT, isl=1024, num_blocks=64, config=off, rng=random.Random(0))

    assert selection.worker_id == 1
    assert selection.reason is Reason.ARGMIN


def test_a_pinned_explanation_keeps_every_candidate_and_the_margin() -> None:
    selection = explain_pinned(1, WORKED_EXAMPLE, isl=64, num_blocks=4, config=CONFIG)

    assert selection.worker_id == 1
    assert selection.reason is Reason.PINNED
    assert selection.margin == 10.0 - 18.0


def test_an_explanation_of_many_candidates_lists_the_cheapest_sixteen_and_the_chosen() -> None:
    loads = [CandidateLoad(Target(w), active_blocks=w) for w in range(40)]  # logit = 2 (prefill) + w active + 2 new
    selection = select_worker(loads, isl=32, num_blocks=2, config=CONFIG, rng=random.Random(0))

    explanation = selection.to_dict()
    assert explanation["num_candidates"] == 40
    assert [c["worker_id"] for c in explanation["candidates"]] == list(range(16))
    assert explanation["worker_id"] == 0
    assert len(selection.candidates) == 40


def test_a_pinned_worker_outside_the_cheapest_sixteen_is_still_explained() -> None:
    loads = [CandidateLoad(Target(w), active_blocks=w) for w in range(40)]
    selection = explain_pinned(39, loads, isl=32, num_blocks=2, config=CONFIG)

    listed = [c["worker_id"] for c in selection.to_dict()["candidates"]]
    assert listed == [*range(15), 39]
