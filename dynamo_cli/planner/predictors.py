"""Load predictors: forecast the next interval's value of a series (request count, ISL, OSL).

Dynamo's planner feeds one predictor per series each interval and asks for the next value; these are
its `constant` and `kalman` predictors plus a moving average (its ARIMA and Prophet need libraries
dyn does not carry). All are deterministic and pure: `observe(x)` then `predict()`. `RateTrend` is the
burst check's: lines through the latest load windows' arrival rates, projected a worker's startup ahead (the
whole span's, the one that starts a ramp surest, and the lowest ceiling a hold can rest on).
"""

from __future__ import annotations

import math
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


class RateTrend:
    """A least-squares line through the arrival rates of the load windows of the latest `span_s` seconds,
    projected ahead: the rate a worker started now will meet when it serves.

    NOTE: window i has rate y_i = n_i / dt_i at its midpoint t_i. Arrivals are Poisson, so each y_i has
    variance r / dt_i (r: the pooled rate); the projection at T, y + slope (T − t), then has variance
    (r / dt)(1/k + (T − t)² / Σ(t_i − t)²) over k windows (ordinary least squares, windows of about equal
    length). Fewer than three windows: no slope, the pooled rate and its variance r / (Σ dt_i).
    """

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self._windows: deque[tuple[float, float, float]] = deque()
        """(midpoint, arrivals, seconds) of each window, oldest first."""

    def observe(self, end: float, arrived: float, seconds: float) -> None:
        """Add a window of `seconds` ending at `end` in which `arrived` requests arrived."""
        self._windows.append((end - seconds / 2, arrived, seconds))
        while end - (self._windows[0][0] - self._windows[0][2] / 2) > self.span_s + 1e-9:
            self._windows.popleft()

    def clear(self) -> None:
        self._windows.clear()

    def project(self, ahead: float) -> tuple[float, float]:
        """(rate, standard deviation) `ahead` seconds past the latest window's end, the line through every window
        held; (0, 0) before any window."""
        return _fit(list(self._windows), ahead)

    def knee(self, ahead: float, sigmas: float) -> tuple[float, float]:
        """The projection `ahead` whose lower bound (rate − `sigmas` deviations) is the highest over the lines
        through the latest k windows, for every k from MIN_KNEE_WINDOWS up: a ramp that began within the span
        shows in a short run's slope well before it tilts the whole span's line."""
        windows, best, best_low = list(self._windows), (0.0, 0.0), -math.inf
        for k in range(max(1, min(MIN_KNEE_WINDOWS, len(windows))), len(windows) + 1):
            rate, deviation = _fit(windows[-k:], ahead)
            if rate - sigmas * deviation > best_low:
                best, best_low = (rate, deviation), rate - sigmas * deviation
        return best

    def ceiling(self, ahead: float, sigmas: float) -> float:
        """The lowest, over the lines through the latest k windows (k from CEILING_WINDOWS up), of the higher of
        the line's rate now and `ahead`, plus `sigmas` deviations: the most the rate will need within `ahead`.
        A line through a ramp's peak still rises; the run since the peak already falls."""
        windows, best = list(self._windows), math.inf
        for k in range(max(1, min(CEILING_WINDOWS, len(windows))), len(windows) + 1):
            (now, now_sd), (then, then_sd) = _fit(windows[-k:], 0.0), _fit(windows[-k:], ahead)
            best = min(best, max(now + sigmas * now_sd, then + sigmas * then_sd))
        return best if best < math.inf else 0.0


MIN_KNEE_WINDOWS = 5
"""The shortest run of latest windows `RateTrend.knee` draws a line through."""
CEILING_WINDOWS = 8
"""... and `RateTrend.ceiling`: a hold rests on more windows than a start does, since a release too early costs a
ramp a start-up of its requests."""


def _fit(windows: list[tuple[float, float, float]], ahead: float) -> tuple[float, float]:
    """The least-squares line through (midpoint, arrivals, seconds) `windows` (RateTrend's NOTE), projected
    `ahead` past the last one's end: (rate, standard deviation); (0, 0) for no window."""
    if not windows:
        return 0.0, 0.0
    k = len(windows)
    total, seconds = sum(n for _, n, _ in windows), sum(dt for _, _, dt in windows)
    pooled = total / seconds
    if k < 3:
        return pooled, math.sqrt(pooled / seconds)
    t_mean = sum(t for t, _, _ in windows) / k
    y_mean = sum(n / dt for _, n, dt in windows) / k
    sxx = sum((t - t_mean) ** 2 for t, _, _ in windows)
    slope = sum((t - t_mean) * (n / dt - y_mean) for t, n, dt in windows) / sxx
    last = windows[-1]
    target = last[0] + last[2] / 2 + ahead
    variance = pooled / (seconds / k) * (1 / k + (target - t_mean) ** 2 / sxx)
    return max(0.0, y_mean + slope * (target - t_mean)), math.sqrt(variance)
