"""The oracle: the pools a planner that knows the future load would keep, set beside the planner's in
`dyn plan simulate` so the gap a forecast leaves is visible on every run.

NOTE: the oracle knows the load ahead of time: a rate curve's own rate, or a trace's arrival rate centred
at each time over one throughput interval (15 s: arrivals in [t − 7.5, t + 7.5) / 15, which is the rate
itself on a linear ramp) with that window's mean ISL and OSL. Every load interval (2 s) it sizes the pools
for that load as the planner sizes them (its profile, targets, headroom and bounds, no correction). A worker
takes `startup_s` to serve, so at time τ the oracle keeps what the most demanding point in [τ, τ + startup_s]
needs: each worker starts exactly `startup_s` before the rate needs it, and goes as soon as no point within a
startup needs it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from dynamo_cli.planner.planner import PlannerConfig
from dynamo_cli.planner.profile import Profile
from dynamo_cli.planner.sizing import (
    NO_CORRECTION,
    ONE_RANK,
    AggPoint,
    Forecast,
    RanksPerWorker,
    agg_capacity,
    plan_replicas,
)

RateAt = Callable[[float], tuple[float, float, float]]
"""The load at a time: (requests/s, mean ISL, mean OSL)."""


@dataclass(frozen=True, slots=True)
class OracleStep:
    """The pools the oracle keeps from `at` on, until the next step (one per load interval)."""

    at: float
    """Seconds from the start of the trace."""
    num_prefill: int
    """Prefill workers (0 in agg mode)."""
    num_decode: int
    """Decode workers (agg: the one pool)."""


def trace_rates(arrivals: Sequence[tuple[float, int, int]], window_s: float) -> RateAt:
    """The load of a trace, from (arrival, ISL, OSL) sorted by arrival: at t, the arrivals in
    [t − window_s / 2, t + window_s / 2) per second and their mean ISL and OSL (0 when none arrived)."""
    times = [a for a, _, _ in arrivals]
    isls = list(accumulate((i for _, i, _ in arrivals), initial=0))
    osls = list(accumulate((o for _, _, o in arrivals), initial=0))

    def rate_at(t: float) -> tuple[float, float, float]:
        low, high = bisect.bisect_left(times, t - window_s / 2), bisect.bisect_left(times, t + window_s / 2)
        count = high - low
        if count == 0:
            return 0.0, 0.0, 0.0
        return count / window_s, (isls[high] - isls[low]) / count, (osls[high] - osls[low]) / count

    return rate_at


def oracle_needs(
    rate_at: RateAt, end_s: float, profile: Profile, config: PlannerConfig, ranks: RanksPerWorker = ONE_RANK
) -> list[tuple[float, int, int]]:
    """(time, prefill, decode) workers of `ranks` the load needs at the start of each load interval up to `end_s`,
    sized as the planner sizes (no correction)."""
    step = config.load_interval_s if config.load_interval_s > 0 else config.interval_s
    capacities: dict[tuple[int, int], AggPoint] = {}
    needs, k = [], 0
    while k * step <= end_s:
        rate, isl, osl = rate_at(k * step)
        key = (round(isl or config.default_isl), round(osl or config.default_osl))
        if config.mode == "agg" and key not in capacities:  # a bisection: once per (ISL, OSL)
            capacities[key] = agg_capacity(profile, *key, config.targets, config.headroom)
        forecast = Forecast(num_requests=rate * config.interval_s, isl=key[0], osl=key[1])
        decision = plan_replicas(
            profile,
            forecast,
            config.interval_s,
            NO_CORRECTION,
            config.targets,
            config.bounds,
            config.mode,
            config.headroom,
            capacities.get(key),
            ranks,
        )
        needs.append((k * step, decision.num_prefill, decision.num_decode))
        k += 1
    return needs


def oracle_schedule(needs: Sequence[tuple[float, int, int]], startup_s: float) -> list[OracleStep]:
    """The oracle's pools at each point of `needs`: the most that any need within `startup_s` ahead asks for,
    per pool."""
    steps: list[OracleStep] = []
    for i, (t, _, _) in enumerate(needs):
        prefill = decode = 0
        j = i
        while j < len(needs) and needs[j][0] <= t + startup_s + 1e-9:
            prefill, decode = max(prefill, needs[j][1]), max(decode, needs[j][2])
            j += 1
        steps.append(OracleStep(t, prefill, decode))
    return steps
