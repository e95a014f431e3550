"""Load predictors: forecast the next interval's value of a series (request count, ISL, OSL).

Dynamo's planner feeds one predictor per series each interval and asks for the next value; these are
its `constant` and `kalman` predictors plus a moving average (its ARIMA and Prophet need libraries
dyn does not carry). All are deterministic and pure: `observe(x)` then `predict()`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from dynamo_cli.errors import ConfigError

PREDICTORS = ("constant", "moving-average", "kalman")


class Predictor(Protocol):
    """Forecasts the next value of one series."""

    def observe(self, value: float) -> None:
        """Add the value observed over the interval that just ended."""
        ...

    def predict(self) -> float:
        """The forecast for the next interval (0.0 before any observation)."""
        ...


class ConstantPredictor:
    """Next = last observed (Dynamo's `constant`)."""

    def __init__(self) -> None:
        self._last = 0.0

    def observe(self, value: float) -> None:
        self._last = value

    def predict(self) -> float:
        return self._last


class MovingAveragePredictor:
    """Next = mean of the last `window` observations."""

    def __init__(self, window: int = 5) -> None:
        if window < 1:
            raise ConfigError(f"moving-average window must be >= 1, got {window}")
        self._values: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self._values.append(value)

    def predict(self) -> float:
        return sum(self._values) / len(self._values) if self._values else 0.0


@dataclass(frozen=True, slots=True)
class KalmanSettings:
    """Dynamo's defaults for its local-linear-trend Kalman predictor."""

    q_level: float = 1.0
    """Process noise of the level."""
    q_trend: float = 0.1
    """Process noise of the trend (per interval)."""
    r: float = 10.0
    """Measurement noise."""
    min_points: int = 5
    """Below this many observations, predict the last value."""


class KalmanPredictor:
    """Local linear trend: state (level, trend), level' = level + trend; predicts level + trend, >= 0.

    NOTE: the state starts at the first observation with trend 0 and covariance diag(r, r); each later
    observation is one predict + update step of the standard Kalman filter (2x2, written out).
    """

    def __init__(self, settings: KalmanSettings = KalmanSettings()) -> None:
        self.settings = settings
        self._count = 0
        self._last = 0.0
        self._level = self._trend = 0.0
        self._p = [[settings.r, 0.0], [0.0, settings.r]]

    def observe(self, value: float) -> None:
        self._count += 1
        self._last = value
        if self._count == 1:
            self._level = value
            return
        s = self.settings
        (a, b), (c, d) = self._p
        # predict: x = F x, P = F P F' + Q with F = [[1, 1], [0, 1]]
        level, trend = self._level + self._trend, self._trend
        p00, p01, p10, p11 = a + b + c + d + s.q_level, b + d, c + d, d + s.q_trend
        # update with H = [1, 0]
        gain0, gain1 = p00 / (p00 + s.r), p10 / (p00 + s.r)
        innovation = value - level
        self._level, self._trend = level + gain0 * innovation, trend + gain1 * innovation
        self._p = [[(1 - gain0) * p00, (1 - gain0) * p01], [p10 - gain1 * p00, p11 - gain1 * p01]]

    def predict(self) -> float:
        if self._count < self.settings.min_points:
            return self._last
        return max(0.0, self._level + self._trend)


def make_predictor(name: str, window: int = 5) -> Predictor:
    """`--predictor NAME` → a fresh predictor."""
    if name == "constant":
        return ConstantPredictor()
    if name == "moving-average":
        return MovingAveragePredictor(window)
    if name == "kalman":
        return KalmanPredictor()
    raise ConfigError(f"--predictor '{name}' is not known; use one of {', '.join(PREDICTORS)}")
