"""Load predictors on fixed series."""

from __future__ import annotations

import math

import pytest

from dynamo_cli.errors import ConfigError
from dynamo_cli.planner.predictors import KalmanPredictor, Predictor, RateTrend, make_predictor


def fed(predictor: Predictor, series: list[float]) -> float:
    for value in series:
        predictor.observe(value)
    return predictor.predict()


def test_constant_predicts_the_last_value() -> None:
    assert fed(make_predictor("constant"), [3, 5, 7]) == 7


def test_moving_average_predicts_the_mean_of_its_window() -> None:
    assert fed(make_predictor("moving-average", window=3), [1, 2, 3, 4]) == 3.0


def test_every_predictor_says_zero_before_any_observation() -> None:
    assert [make_predictor(name).predict() for name in ("constant", "moving-average", "kalman")] == [0, 0, 0]


def test_kalman_predicts_the_last_value_until_it_has_enough_points() -> None:
    assert fed(KalmanPredictor(), [5, 9, 2, 8]) == 8


def test_kalman_holds_a_constant_series_exactly() -> None:
    assert fed(KalmanPredictor(), [10.0] * 8) == 10.0


def test_kalman_follows_a_ramp_to_its_next_value() -> None:
    # 0, 1, ..., 19: the next value is 20; the constant predictor would say 19
    assert fed(KalmanPredictor(), [float(i) for i in range(20)]) == pytest.approx(20.0, abs=0.01)


def test_kalman_rises_after_a_step_and_never_predicts_below_zero() -> None:
    assert fed(KalmanPredictor(), [10.0] * 6 + [40.0] * 4) > 40.0
    assert fed(KalmanPredictor(), [50.0, 40.0, 30.0, 20.0, 10.0, 0.0, 0.0]) == 0.0


def test_an_unknown_predictor_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="arima"):
        make_predictor("arima")


def test_a_rate_trend_projects_the_least_squares_line_with_its_poisson_deviation() -> None:
    # rates 5, 10, 15 req/s at midpoints 1, 3, 5: slope 2.5; at 6 + 4 = 10: 10 + 2.5·7 = 27.5 req/s; pooled 10 req/s,
    # variance 10/2·(1/3 + 7²/8) = 32.2917
    trend = RateTrend(span_s=60.0)
    assert trend.project(4.0) == (0.0, 0.0)
    for end, arrived in ((2.0, 10), (4.0, 20), (6.0, 30)):
        trend.observe(end, arrived, 2.0)
    rate, deviation = trend.project(4.0)
    assert rate == pytest.approx(27.5) and deviation == pytest.approx(math.sqrt(32.2917), rel=1e-5)
    # windows that began over 60 s before the last end fall out: (4, 6] and (62, 64] remain, too few for a slope
    trend.observe(64.0, 2, 2.0)
    assert trend.project(4.0) == pytest.approx((8.0, math.sqrt(8.0 / 4.0)))


def trend_of(rates: list[float], seconds: float = 2.0) -> RateTrend:
    trend = RateTrend(span_s=seconds * len(rates))
    for i, rate in enumerate(rates):
        trend.observe(seconds * (i + 1), rate * seconds, seconds)
    return trend


def test_on_a_straight_line_the_surest_run_is_the_whole_span() -> None:
    # every run of latest windows has the same line; the longest has the smallest deviation
    trend = trend_of([5.0 + 0.5 * i for i in range(16)])
    assert trend.knee(32.0, 2.0) == pytest.approx(trend.project(32.0))


def test_a_ramp_begun_within_the_span_shows_in_the_surest_latest_run_first() -> None:
    # 40 s at 5 req/s, then 10 s rising 0.7 req/s per s: the whole span's line is still nearly flat
    trend = trend_of([5.0] * 20 + [5.0 + 1.4 * (i + 1) for i in range(5)])
    whole, whole_sd = trend.project(32.0)
    knee, knee_sd = trend.knee(32.0, 2.0)
    assert knee - 2 * knee_sd > whole - 2 * whole_sd and knee > whole + 10


def test_past_a_peak_the_ceiling_follows_the_fall_not_the_whole_spans_rise() -> None:
    rates = [5.0 + 1.0 * i for i in range(24)] + [28.0 - 1.0 * i for i in range(8)]
    trend = trend_of(rates)
    whole, whole_sd = trend.project(32.0)
    assert trend.ceiling(32.0, 0.5) < 30.0 < whole + 0.5 * whole_sd
    assert RateTrend(span_s=60.0).ceiling(32.0, 0.5) == 0.0 and RateTrend(span_s=60.0).knee(32.0, 2.0) == (0.0, 0.0)
