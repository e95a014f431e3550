"""Load predictors on fixed series."""

from __future__ import annotations

import pytest

from dynamo_cli.errors import ConfigError
from dynamo_cli.planner.predictors import KalmanPredictor, Predictor, make_predictor


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
