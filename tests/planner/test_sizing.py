"""Replica arithmetic against worked examples computed by hand from Dynamo's classic planner formulas.

The profile used throughout (easy numbers):
    prefill: ISL 1000 → 100 ms, ISL 2000 → 200 ms: 10,000 prompt tok/s per GPU at any ISL in between.
    decode, max_kv_tokens 100,000: ITL = 10 + 40·usage ms at context 1000, 20 + 40·usage ms at context 3000,
    so at context 2100 (ISL 2000 + OSL 200/2), 0.55 of the way: ITL = 15.5 + 40·usage ms.
"""

from __future__ import annotations

import math

import pytest

from dynamo_cli.errors import ConfigError
from dynamo_cli.planner.profile import (
    DecodeSample,
    PrefillSample,
    Profile,
    best_decode_throughput,
    decode_itl_ms,
    load_profile,
    prefill_ttft_ms,
    save_profile,
)
from dynamo_cli.planner.sizing import (
    NO_CORRECTION,
    Bounds,
    Corrections,
    Forecast,
    Observation,
    RanksPerWorker,
    Targets,
    agg_point,
    correction_factors,
    max_ramp_slope,
    plan_replicas,
    prefill_utilization,
)

PROFILE = Profile(
    engine="test",
    model="m",
    max_kv_tokens=100_000,
    max_num_seqs=1000,
    prefill=[PrefillSample(isl=1000, ttft_ms=100.0), PrefillSample(isl=2000, ttft_ms=200.0)],
    decode=[
        DecodeSample(kv_usage=0.0, context_length=1000, itl_ms=10.0),
        DecodeSample(kv_usage=1.0, context_length=1000, itl_ms=50.0),
        DecodeSample(kv_usage=0.0, context_length=3000, itl_ms=20.0),
        DecodeSample(kv_usage=1.0, context_length=3000, itl_ms=60.0),
    ],
)
TARGETS = Targets(ttft_ms=1000.0, itl_ms=30.0)
WIDE = Bounds(min_workers=1, max_workers=100)


def corr(prefill: float = 1.0, decode: float = 1.0) -> Corrections:
    return Corrections(prefill=prefill, decode=decode, why="test")


def test_interpolation_is_linear_inside_and_clamped_outside_the_profile() -> None:
    assert prefill_ttft_ms(PROFILE, 1500) == pytest.approx(150.0)
    assert prefill_ttft_ms(PROFILE, 100) == 100.0 and prefill_ttft_ms(PROFILE, 9000) == 200.0
    assert decode_itl_ms(PROFILE, 0.5, 2100) == pytest.approx(15.5 + 20.0)
    assert decode_itl_ms(PROFILE, 2.0, 500) == 50.0


def test_the_best_decode_point_is_the_highest_usage_meeting_the_itl() -> None:
    # 15.5 + 40u <= 30 → u <= 0.3625; on the 0.01 grid u = 0.36, ITL 29.9 ms,
    # concurrency 0.36 × 100000 / 2100 = 17.142857, throughput 17.142857 / 0.0299 = 573.34 tok/s.
    point = best_decode_throughput(PROFILE, 30.0, 2100)
    assert point.kv_usage == pytest.approx(0.36) and point.meets_itl
    assert point.itl_ms == pytest.approx(29.9)
    assert point.throughput_per_gpu == pytest.approx(573.34, abs=0.01)


def test_prefill_utilization_is_the_md1_load_that_meets_the_ttft() -> None:
    # S = 200, T = 1000: k = 4, ρ = 8/9; a target under S cannot be met by scaling: ρ = 1.
    assert prefill_utilization(200.0, 1000.0) == pytest.approx(8 / 9)
    assert prefill_utilization(200.0, 150.0) == 1.0


@pytest.mark.parametrize(
    ("num_requests", "p_corr", "expected"),
    [
        # 60 req × 2000 / 60 s = 2000 tok/s over 10000 × 8/9 = 8888.9 → 0.225 → 1
        pytest.param(60, 1.0, 1, id="light load needs one prefill worker"),
        # 600 req: 20000 tok/s / 8888.9 = 2.25 → 3
        pytest.param(600, 1.0, 3, id="ten times the load needs three"),
        # p_corr 0.5 halves the demand: 10000 / 8888.9 = 1.125 → 2
        pytest.param(600, 0.5, 2, id="a faster-than-profiled prefill lowers the count"),
        # min(1, 2.0) = 1: a slow prefill never raises the demand (Dynamo's rule)
        pytest.param(600, 2.0, 3, id="a slower-than-profiled prefill does not raise it"),
    ],
)
def test_prefill_replicas(num_requests: int, p_corr: float, expected: int) -> None:
    forecast = Forecast(num_requests=num_requests, isl=2000, osl=200)
    decision = plan_replicas(PROFILE, forecast, 60.0, corr(prefill=p_corr), TARGETS, WIDE)
    assert decision.num_prefill == expected
    assert f"prefill {expected} (ceil {expected})" in decision.why


@pytest.mark.parametrize(
    ("d_corr", "expected"),
    [
        # 600 × 200 / 60 = 2000 tok/s over 573.34 tok/s → 3.488 → 4
        pytest.param(1.0, 4, id="as profiled"),
        # ITL 30/1.5 = 20 ms: u = 0.11, ITL 19.9, conc 5.238, 263.2 tok/s → 7.598 → 8
        pytest.param(1.5, 8, id="a slower-than-profiled decode asks for more workers"),
    ],
)
def test_decode_replicas(d_corr: float, expected: int) -> None:
    forecast = Forecast(num_requests=600, isl=2000, osl=200)
    assert plan_replicas(PROFILE, forecast, 60.0, corr(decode=d_corr), TARGETS, WIDE).num_decode == expected


def test_counts_are_clamped_to_min_and_max_workers() -> None:
    light = plan_replicas(
        PROFILE,
        Forecast(num_requests=60, isl=2000, osl=200),
        60.0,
        NO_CORRECTION,
        TARGETS,
        Bounds(min_workers=2, max_workers=6),
    )
    heavy = plan_replicas(
        PROFILE,
        Forecast(num_requests=600, isl=2000, osl=200),
        60.0,
        corr(decode=1.5),
        TARGETS,
        Bounds(min_workers=2, max_workers=6),
    )
    assert (light.num_prefill, light.num_decode) == (2, 2)  # raw 1 and 1
    assert (heavy.num_prefill, heavy.num_decode) == (3, 6)  # raw 3 and 8


def test_the_gpu_budget_scales_prefill_and_gives_decode_the_rest() -> None:
    # raw 3 + 4 = 7 GPUs over a budget of 5: scale 5/7; prefill round(3 × 0.714) = 2, decode 5 − 2 = 3
    decision = plan_replicas(
        PROFILE,
        Forecast(num_requests=600, isl=2000, osl=200),
        60.0,
        NO_CORRECTION,
        TARGETS,
        Bounds(min_workers=1, max_workers=100, gpu_budget=5),
    )
    assert (decision.num_prefill, decision.num_decode) == (2, 3)
    assert "5 GPUs" in decision.why


def test_an_agg_worker_decodes_slower_for_the_prefills_it_runs() -> None:
    # 2 req/s of ISL 2000 (S = 200 ms): φ = 0.4, TTFT = 200 + 0.4·200 / (2·0.6) = 266.667 ms.
    # ITL t (ms) = (15.5 + 40u) / 0.6 with n = 2·(0.266667 + 200·t/1000) = 0.533333 + 0.4t streams of 2100 tok,
    # u = 0.021n = 0.0112 + 0.0084t: 0.6t = 15.948 + 0.336t → t = 15.948 / 0.264 = 60.409 ms, n = 24.697
    # (the decode step alone at that usage would be 36.2 ms: prefill interference costs 40 % of every step).
    point = agg_point(PROFILE, 2.0, 2000, 200)
    assert point.prefill_share == pytest.approx(0.4)
    assert point.ttft_ms == pytest.approx(266.667, abs=1e-3)
    assert point.itl_ms == pytest.approx(60.409, abs=1e-3) and point.concurrency == pytest.approx(24.697, abs=1e-3)
    assert agg_point(PROFILE, 5.0, 2000, 200).ttft_ms == math.inf  # φ = 1: prefill alone fills the worker


def test_agg_mode_sizes_one_pool_for_the_rate_a_worker_holds_at_both_targets() -> None:
    # The highest rate meeting ITL 30 ms (TTFT 1000 ms is slack): r = 1.2904 req/s; check by hand:
    # φ = 0.25807, TTFT = 0.2 + 0.25807·0.2 / (2·0.74193) = 0.234784 s, n = 1.2904·(0.234784 + 200·0.030) =
    # 8.0451, u = 0.021·8.0451 = 0.16895, ITL = (15.5 + 40·0.16895) / 0.74193 = 30.00 ms.
    # 600 req / 60 s = 10 req/s → 10 / 1.2904 = 7.75 → 8 workers (summing the disagg fractions gave 6).
    decision = plan_replicas(
        PROFILE, Forecast(num_requests=600, isl=2000, osl=200), 60.0, NO_CORRECTION, TARGETS, WIDE, mode="agg"
    )
    assert (decision.num_prefill, decision.num_decode) == (0, 8)
    assert "1.29 req/s per rank" in decision.why and "→ 7.75" in decision.why
    # headroom 0.8 sizes for ITL 24 ms: 0.9424 req/s per worker → 10.61 → 11
    assert (
        plan_replicas(
            PROFILE,
            Forecast(num_requests=600, isl=2000, osl=200),
            60.0,
            NO_CORRECTION,
            TARGETS,
            WIDE,
            mode="agg",
            headroom=0.8,
        ).num_decode
        == 11
    )
    # d_corr 2 is clamped to 1.25: sized for ITL 30 / 1.25 = 24 ms, the same 11
    assert (
        plan_replicas(
            PROFILE, Forecast(num_requests=600, isl=2000, osl=200), 60.0, corr(decode=2.0), TARGETS, WIDE, mode="agg"
        ).num_decode
        == 11
    )


def test_the_steepest_ramp_a_startup_can_follow_is_half_a_workers_rate_per_startup() -> None:
    # agg: one worker holds 1.2904 req/s (above) → 1.2904 / (2·30 s) = 0.021507 req/s². disagg: one prefill
    # worker holds 10000 tok/s × ρ 0.8889 / 2000 tok = 4.444 req/s, one decode worker 573.34 tok/s / 200 tok =
    # 2.8667 req/s (the decode example above): the smaller, 2.8667 / 60 = 0.047778 req/s²
    assert max_ramp_slope(PROFILE, 2000, 200, TARGETS, 1.0, 30.0) == pytest.approx(0.021507, abs=1e-5)
    assert max_ramp_slope(PROFILE, 2000, 200, TARGETS, 1.0, 30.0, mode="disagg") == pytest.approx(0.047778, abs=1e-5)
    assert max_ramp_slope(PROFILE, 2000, 200, TARGETS, 1.0, 0.0) == math.inf  # no startup: any ramp


@pytest.mark.parametrize(
    ("ranks", "expected", "said"),
    [
        pytest.param(RanksPerWorker(), (0, 8), "agg 8 (ceil 8)", id="one rank a worker"),
        pytest.param(RanksPerWorker(decode=4), (0, 2), "agg 2 workers × 4 ranks (ceil(7.75 ranks / 4) = 2)", id="4"),
        pytest.param(RanksPerWorker(decode=8), (0, 1), "agg 1 worker × 8 ranks (ceil(7.75 ranks / 8) = 1)", id="8"),
    ],
)
def test_an_agg_pool_is_sized_in_ranks_and_asked_for_in_workers_of_r_ranks(
    ranks: RanksPerWorker, expected: tuple[int, int], said: str
) -> None:
    # the agg example below: 10 req/s over 1.2904 req/s per rank = 7.75 ranks; a worker of R ranks serves R times
    # a rank's load, so ceil(7.75 / R) workers
    forecast = Forecast(num_requests=600, isl=2000, osl=200)
    decision = plan_replicas(PROFILE, forecast, 60.0, NO_CORRECTION, TARGETS, WIDE, mode="agg", ranks=ranks)
    assert (decision.num_prefill, decision.num_decode) == expected
    assert decision.ranks == ranks and decision.num_decode_ranks == expected[1] * ranks.decode
    assert said in decision.why and "1.29 req/s per rank" in decision.why


def test_disagg_pools_are_sized_in_ranks_each_in_workers_of_its_own_ranks() -> None:
    # the worked example: prefill 2.25 ranks, decode 3.488 ranks. Prefill workers of 2 ranks: ceil(2.25 / 2) = 2
    # (4 ranks); decode workers of 4: ceil(3.488 / 4) = 1 (4 ranks). The bounds count workers: at most 1 a pool.
    forecast = Forecast(num_requests=600, isl=2000, osl=200)
    ranks = RanksPerWorker(prefill=2, decode=4)
    decision = plan_replicas(PROFILE, forecast, 60.0, NO_CORRECTION, TARGETS, WIDE, ranks=ranks)
    assert (decision.num_prefill, decision.num_decode) == (2, 1)
    assert (decision.num_prefill_ranks, decision.num_decode_ranks) == (4, 4)
    assert "prefill 2 workers × 2 ranks (ceil(2.25 ranks / 2) = 2)" in decision.why
    assert "decode 1 worker × 4 ranks (ceil(3.49 ranks / 4) = 1)" in decision.why
    capped = plan_replicas(PROFILE, forecast, 60.0, NO_CORRECTION, TARGETS, Bounds(1, 1), ranks=ranks)
    assert (capped.num_prefill, capped.num_decode) == (1, 1)


def test_the_gpu_budget_counts_a_workers_gpus_as_its_ranks() -> None:
    # workers of 2 ranks (1 GPU each): prefill ceil(2.25 / 2) = 2, decode ceil(3.488 / 2) = 2: 8 GPUs over a budget
    # of 6: scale 0.75, prefill round(1.5) = 2 (4 GPUs), decode (6 − 4) / 2 = 1. Agg, 4 ranks a worker: 2 workers
    # (8 GPUs) over 5: 5 // 4 = 1 worker.
    forecast = Forecast(num_requests=600, isl=2000, osl=200)
    two = RanksPerWorker.every(2)
    decision = plan_replicas(PROFILE, forecast, 60.0, NO_CORRECTION, TARGETS, Bounds(1, 100, gpu_budget=6), ranks=two)
    assert (decision.num_prefill, decision.num_decode) == (2, 1)
    agg = plan_replicas(
        PROFILE, forecast, 60.0, NO_CORRECTION, TARGETS, Bounds(1, 100, 5), mode="agg", ranks=RanksPerWorker(decode=4)
    )
    assert agg.num_decode == 1


def test_a_worker_of_r_ranks_follows_a_ramp_r_times_as_steep() -> None:
    # agg: 4 × 0.021507. disagg with decode workers of 4 ranks: one prefill worker holds 4.444 req/s, one decode
    # worker 4 × 2.8667 = 11.47: the smaller, 4.444 / 60 = 0.074074 req/s²
    four = RanksPerWorker.every(4)
    assert max_ramp_slope(PROFILE, 2000, 200, TARGETS, 1.0, 30.0, ranks=four) == pytest.approx(4 * 0.021507, abs=4e-5)
    slope = max_ramp_slope(PROFILE, 2000, 200, TARGETS, 1.0, 30.0, "disagg", RanksPerWorker(decode=4))
    assert slope == pytest.approx(0.074074, abs=1e-5)


def test_agg_corrections_compare_with_the_interference_model() -> None:
    # 240 req / 60 s over 2 workers = 2 req/s each: agg_point says TTFT 266.667 ms, ITL 60.409 ms.
    observed = Observation(
        interval_s=60.0, num_requests=240, isl=2000, osl=200, ttft_ms=400.0, itl_ms=60.409, request_duration_s=12.0
    )
    factors = correction_factors(PROFILE, observed, 2, mode="agg")
    assert factors.prefill == pytest.approx(1.5) and factors.decode == pytest.approx(1.0, abs=1e-4)


def test_an_unreachable_ttft_target_is_said_in_the_decision() -> None:
    decision = plan_replicas(
        PROFILE,
        Forecast(num_requests=600, isl=2000, osl=200),
        60.0,
        NO_CORRECTION,
        Targets(ttft_ms=150.0, itl_ms=30.0),
        WIDE,
    )
    assert decision.num_prefill == 2  # ρ = 1: 20000 / 10000
    assert "unreachable" in decision.why


def test_correction_factors_compare_observed_latency_with_the_profile() -> None:
    # TTFT 300 vs 200 ms at ISL 2000: 1.5. Concurrency 600/4 × 6 s/60 s = 15 req of 2100 tok:
    # usage 0.315, profile ITL 15.5 + 12.6 = 28.1 ms; observed 31 → 31/28.1 = 1.1032
    observed = Observation(
        interval_s=60.0, num_requests=600, isl=2000, osl=200, ttft_ms=300.0, itl_ms=31.0, request_duration_s=6.0
    )
    factors = correction_factors(PROFILE, observed, num_decode_ranks=4)
    assert factors.prefill == pytest.approx(1.5)
    assert factors.decode == pytest.approx(31 / 28.1)


def test_no_traffic_means_no_correction() -> None:
    idle = Observation(interval_s=60.0, num_requests=0, isl=0, osl=0, ttft_ms=0, itl_ms=0, request_duration_s=0)
    assert correction_factors(PROFILE, idle, 1) == NO_CORRECTION


def test_a_profile_round_trips_through_its_json_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "p.json"
    save_profile(PROFILE, path)
    assert load_profile(path) == PROFILE
    (tmp_path / "bad.json").write_text('{"version": 1}')
    with pytest.raises(ConfigError, match="cannot be read"):
        load_profile(tmp_path / "bad.json")
