"""The planner loop: each interval observe the frontends, forecast, size the pools, apply.

NOTE: two cadences, as Dynamo's throughput and load intervals. Every `interval_s` the throughput step runs
the SLA planner (sizing.py) on the interval's traffic and is the only step that scales down. Every
`load_interval_s` the burst check scales up at once when a rate that needs more workers is surely reached:
the window's arrivals less two Poisson deviations, the trend of the latest two leads (a worker's startup
plus one window; predictors.RateTrend) projected one lead ahead less one deviation, the surest line through
the latest windows less two (a ramp's start), or the workers' queue growth (`_queue_rates`). Demand is read
from arrivals, not completions. One scale action is in flight at a time (the loop awaits `apply`).

Design: docs/design/planner.md (the burst check's statistics, its caps, and why scale-down is bounded).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol

from dynamo_cli.errors import PlaneUnavailable
from dynamo_cli.planner.connectors import Connector, ScaleTarget
from dynamo_cli.planner.observe import PoolLoad, Snapshot, WorkerCount, WorkerRanks, observation_between
from dynamo_cli.planner.predictors import RateTrend, make_predictor
from dynamo_cli.planner.profile import Profile
from dynamo_cli.planner.sizing import (
    NO_CORRECTION,
    AggPoint,
    Bounds,
    Corrections,
    Decision,
    Forecast,
    Observation,
    RanksPerWorker,
    Targets,
    agg_capacity,
    correction_factors,
    max_ramp_slope,
    plan_replicas,
)
from dynamo_cli.settings import setting

logger = logging.getLogger(__name__)

INTERVAL_S = 15.0
"""The throughput step's default period (`--interval`; Dynamo: 180 s). It mostly paces scale-down (bursts
scale up): a long one holds a falling rate's workers for half of it."""
LOAD_INTERVAL_S = 2.0
"""The burst check's default period (`--load-interval`; Dynamo's load interval: 5 s): a step in the rate waits
this long, plus a worker's startup, for capacity."""
STARTUP_S = 30.0
"""A new worker's default time to serve (`--startup`)."""
TREND_SPAN_S = 60.0
"""The burst check fits the arrival rate's trend over the load windows of at least this many latest seconds."""
TREND_LEADS = 2.0
"""... and of at least this many leads (a worker's startup plus one load interval): the projection's deviation
grows with (lead / span)², so a long startup needs a long fit."""
SLOPE_CAP = 4.0
"""The projection rises at most this many times the steepest ramp one worker's startup can follow: a fit
across a step reads it as a steep ramp, and extrapolating that over a startup asks for workers by the dozen."""
HOLD_SIGMAS = 0.5
"""Standard deviations above the trend's projection that the throughput step holds workers for: releasing
one a ramp needs again within a startup costs the ramp a startup's worth of its requests."""
SIGMAS = 2.0
"""Poisson standard deviations below a window's rate that make it sure, and above it that a burst sizes for."""
TREND_SIGMAS = 1.0
"""Standard deviations below the trend's projection that make it sure: fewer than a window's, since a false
start costs one worker for a while (held until the projection falls) while a late one costs a ramp's requests."""
KNEE_SIGMAS = 2.0
"""... and below the surest line through the latest windows (predictors.RateTrend.knee): more than the whole
span's, since the surest of many lines is picked for being high."""
RECENT_WINDOWS = 3
"""The throughput step holds the pools the rate over this many latest load windows needs."""


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """`dyn plan run`."""

    targets: Targets
    """TTFT and ITL targets."""
    bounds: Bounds
    """Per-pool min/max and the GPU budget."""
    mode: str = setting("agg", "--mode", env="DYN_PLANNER_MODE")
    """agg (one pool) | disagg (prefill + decode pools)."""
    interval_s: float = setting(INTERVAL_S, "--interval", env="DYN_PLANNER_INTERVAL")
    """Throughput step period (s; Dynamo: 180 s)."""
    load_interval_s: float = setting(LOAD_INTERVAL_S, "--load-interval", env="DYN_PLANNER_LOAD_INTERVAL")
    """Burst check period (s; 0: off; Dynamo's load interval: 5 s)."""
    predictor: str = setting("constant", "--predictor", env="DYN_PLANNER_PREDICTOR")
    """The load forecast: constant | moving-average | kalman."""
    default_isl: float = 3000.0
    """ISL assumed before any request is seen (Dynamo's profiling default)."""
    default_osl: float = 150.0
    """OSL assumed before any request is seen."""
    headroom: float = setting(0.8, "--headroom", env="DYN_PLANNER_HEADROOM")
    """agg: size so the predicted mean TTFT and ITL stay within this fraction of each target."""
    startup_s: float = setting(STARTUP_S, "--startup", env="DYN_PLANNER_STARTUP")
    """Seconds a new worker takes to serve, until measured on the first scale-up: bursts project the load's
    trend this far ahead (0: off).

    The burst check projects the arrival rate's trend this far plus one load interval ahead; the planner
    replaces it with the startup it measures (Planner.startup_s)."""
    ranks_per_worker: int = setting(0, "--ranks-per-worker", env="DYN_PLANNER_RANKS_PER_WORKER")
    """Data-parallel ranks each worker serves, each an engine as the profile describes one (0: as the workers'
    model cards say, each pool's most common `dp_size`; `dyn plan simulate`: 1).

    The pools are sized in ranks and asked for in workers of this many: ceil(ranks / R) (sizing.py NOTE)."""


@dataclass(frozen=True, slots=True)
class Step:
    """One decision as taken: what was seen, what was asked, whether it was applied."""

    decision_id: int
    """Rises by one per decision."""
    kind: str
    """throughput | burst."""
    decision: Decision
    """Counts and why."""
    observation: Observation | None
    """The interval's traffic (None for a burst step)."""
    current: tuple[int, int]
    """(prefill, decode) workers before the decision."""
    applied: bool | None
    """True/False: the connector's answer; None: dry run, or counts unchanged."""

    def __str__(self) -> str:
        """The decision, its outcome and its reason, as `dyn plan run` prints it and `dyn serve --planner` logs it."""
        state = {True: "applied", False: "NOT acknowledged", None: "not applied"}[self.applied]
        d, (prefill, decode) = self.decision, self.current
        return (
            f"decision {self.decision_id} ({self.kind}): prefill {prefill}→{d.num_prefill}{_of(d.ranks.prefill)}, "
            f"decode {decode}→{d.num_decode}{_of(d.ranks.decode)} [{state}]: {d.why}"
        )


def _of(ranks_per_worker: int) -> str:
    return "" if ranks_per_worker == 1 else f" (× {ranks_per_worker} ranks)"


class Snapshotter(Protocol):
    async def snapshot(self) -> Snapshot: ...


WorkerCounter = Callable[[], Awaitable[WorkerCount]]
LoadReader = Callable[[], PoolLoad]
Reporter = Callable[[Step], None]


class Planner:
    """Owns the predictors and the last decision; the connector and metric source are passed in."""

    def __init__(
        self,
        config: PlannerConfig,
        profile: Profile,
        source: Snapshotter,
        connector: Connector | None,
        counter: WorkerCounter | None = None,
        report: Reporter | None = None,
        loads: LoadReader | None = None,
    ) -> None:
        self.config, self.profile, self.source, self.connector = config, profile, source, connector
        self.counter, self.report, self.loads = counter, report, loads
        self.ranks = WorkerRanks(config.ranks_per_worker)  # each pool's ranks per worker, as sized with
        self._waiting = 0
        """Requests queued at the workers at the last burst check."""
        self.startup_s = config.startup_s
        """A new worker's time to serve: the configured one until a scale-up is seen through (the counter
        shows what it asked for), then the latest one measured so, to within one load interval."""
        self._rising: tuple[float, tuple[int, int]] | None = None
        """When the scale-up being timed was applied, and what it asked for."""
        self._now = 0.0
        """The latest snapshot's time."""
        self._predictors = {name: make_predictor(config.predictor) for name in ("rate", "isl", "osl")}
        self._last: Snapshot | None = None
        self._last_load: Snapshot | None = None
        self._window_need: Decision | None = None
        """What the latest load windows needed; the throughput step does not scale below it."""
        self._trend = RateTrend(TREND_SPAN_S)
        self._steepest_at: tuple[tuple[float, float, float, RanksPerWorker], float] | None = None
        """(ISL, OSL, startup, ranks) and the steepest ramp one worker's startup can follow there."""
        self._windows: deque[tuple[float, float]] = deque(maxlen=RECENT_WINDOWS)
        """(arrived, seconds) of the latest load windows."""
        self._capacity: tuple[tuple[float, float], AggPoint] | None = None
        """The last (ISL, OSL) and the rate one agg worker holds there, uncorrected."""
        self._wanted = (0 if config.mode == "agg" else config.bounds.min_workers, config.bounds.min_workers)
        self._next_id = 0
        self.num_steps = 0
        """Decisions taken (`/metrics`); the planner keeps only the latest one."""
        self.last_step: Step | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Plan until `stop` is set; a tick that cannot read any frontend or discovery is skipped and logged."""
        if self._last is None:  # unless the owner read it first (`dyn plan run` waits for a frontend)
            await self.baseline()
        next_plan = time.monotonic() + self.config.interval_s
        while not stop.is_set():
            now = time.monotonic()
            due = next_plan if self.config.load_interval_s <= 0 else min(next_plan, now + self.config.load_interval_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, due - now)):
                    await stop.wait()
            if stop.is_set():
                return
            try:
                if time.monotonic() >= next_plan:
                    next_plan += self.config.interval_s
                    await self.plan_once()
                else:
                    await self.check_burst()
            except (PlaneUnavailable, TimeoutError) as exc:  # a frontend or discovery did not answer in time
                logger.warning("planner step skipped: %s", exc or type(exc).__name__)

    async def baseline(self) -> None:
        """Read the counters the first interval is measured from."""
        self._last = await self.source.snapshot()

    async def plan_once(self) -> Step:
        """The throughput step: observe → forecast → correct → size → hold for the last burst window → apply."""
        now = await self.source.snapshot()
        self._now = now.at
        observation = observation_between(self._last or now, now)
        self._last = now
        self._observe(observation)
        forecast = self.forecast()
        current = await self._current()
        num_ranks = current[1] * self.ranks.now.decode
        corrections = correction_factors(self.profile, observation, num_ranks, self.config.mode)
        decision = self._hold(self._size(forecast, corrections))
        self._window_need = None
        self._windows.clear()
        return await self._take("throughput", decision, observation, current)

    async def check_burst(self) -> Step | None:
        """Scale up at once when the last load window's arrivals (queue growth included) need more workers."""
        snapshot = await self.source.snapshot()
        self._now = snapshot.at
        window = observation_between(self._last_load or self._last or snapshot, snapshot)
        self._last_load = snapshot
        current = await self._current()
        # workers still starting are not in discovery yet: a burst never asks for fewer than the last decision
        base = (max(current[0], self._wanted[0]), max(current[1], self._wanted[1]))
        arrived = window.demand()
        self._windows.append((arrived, window.interval_s))
        recent = sum(a for a, _ in self._windows) / sum(dt for _, dt in self._windows)
        self._trend.span_s = max(TREND_SPAN_S, TREND_LEADS * (self.startup_s + self.config.load_interval_s))
        self._trend.observe(snapshot.at, arrived, window.interval_s)
        sure, sized, held, rates = self._burst_rates(arrived, window.interval_s)
        queue_sure, queue_sized, queue_why = self._queue_rates(window)
        sure, sized, rates = max(sure, queue_sure), max(sized, queue_sized), rates + queue_why
        # the next throughput step holds the projection too: releasing a worker a burst just started (it is
        # still starting) would only have the next burst start another
        self._window_need = self._at_rate(max(recent, held))
        if not self._grows(self._at_rate(sure), base):
            return None
        need = self._at_rate(sized)
        wanted = (max(base[0], need.num_prefill), max(base[1], need.num_decode))
        why = (
            f"burst: {arrived:.0f} arrived in {window.interval_s:.1f} s ({window.num_requests:.0f} completed, "
            f"{snapshot.inflight:.0f} in flight); {rates}: >= {sure:.2f} req/s needs more than prefill "
            f"{base[0]}, decode {base[1]}; sized for {sized:.2f} req/s → prefill {wanted[0]}, "
            f"decode {wanted[1]}: {need.why}"
        )
        decision = replace(need, num_prefill=wanted[0], num_decode=wanted[1], why=why)
        return await self._take("burst", decision, None, current)

    def _burst_rates(self, arrived: float, seconds: float) -> tuple[float, float, float, str]:
        """(sure, sized, held, why). From the latest window: the rate surely reached, SIGMAS below its count
        (noise alone rarely lifts it above the true rate, so a quiet spell never starts workers), and the rate
        to size for, SIGMAS above. From the trend a worker's startup plus one load interval ahead (`_trend_rates`):
        a sure rate that raises the window's (a ramp is met by workers started before it arrives, not after), a
        projection that raises the rate to size for, and the rate the throughput step holds."""
        spread = SIGMAS * math.sqrt(arrived)
        sure, sized = max(0.0, arrived - spread) / seconds, (arrived + spread) / seconds
        why = f"window {sure:.2f}..{sized:.2f} req/s"
        if self.startup_s <= 0:
            return sure, sized, 0.0, why
        low, projected, held, trend_why = self._trend_rates(self.startup_s + self.config.load_interval_s)
        return max(sure, low), max(sized, projected), held, f"{why}, {trend_why}"

    def _trend_rates(self, ahead: float) -> tuple[float, float, float, str]:
        """(sure, projected, held, why) `ahead` seconds on, each rising at most SLOPE_CAP times the steepest ramp
        one worker's startup can follow. Sure: the higher of the whole span's line TREND_SIGMAS below its
        projection and the surest line through the latest windows KNEE_SIGMAS below its own (RateTrend.knee: a
        ramp's first seconds show there first), with that line's projection. Held: the lowest line's ceiling
        HOLD_SIGMAS above (RateTrend.ceiling: past a peak the latest windows already fall), never below sure:
        the throughput step releasing what the next burst check asks for again costs the ramp a startup."""
        level, _ = self._trend.project(0.0)
        cap = level + SLOPE_CAP * self._steepest() * ahead
        projected, deviation = self._trend.project(ahead)
        projected = min(projected, cap)
        low = max(0.0, projected - TREND_SIGMAS * deviation)
        held = projected + HOLD_SIGMAS * deviation
        knee, knee_deviation = self._trend.knee(ahead, KNEE_SIGMAS)
        knee = min(knee, cap)
        if knee - KNEE_SIGMAS * knee_deviation > low:
            low, projected = knee - KNEE_SIGMAS * knee_deviation, max(projected, knee)
        held = max(low, min(held, self._trend.ceiling(ahead, HOLD_SIGMAS)))
        return low, projected, held, f"trend in {ahead:g} s {projected:.2f} ± {deviation:.2f} req/s"

    def _steepest(self) -> float:
        """The steepest ramp one worker's startup can follow at the forecast's ISL and OSL (req/s per second)."""
        forecast = self.forecast()
        key = (forecast.isl, forecast.osl, self.startup_s, self.ranks.now)
        if self._steepest_at is None or self._steepest_at[0] != key:
            profile, config, ranks = self.profile, self.config, self.ranks.now
            slope = max_ramp_slope(
                profile, forecast.isl, forecast.osl, config.targets, config.headroom, self.startup_s, config.mode, ranks
            )
            self._steepest_at = (key, slope)
        return self._steepest_at[1]

    def _queue_rates(self, window: Observation) -> tuple[float, float, str]:
        """(sure, sized, why) from the workers' queues: requests wait there when the pool is saturated, so queue
        growth G over the window, once past what the window's Poisson noise alone queues (SIGMAS √(C + G)), is
        no estimate but a fact: the pool served its completions C and fell G behind, (C + G) / window is surely
        reached, and the backlog Q needs Q / (startup + one load interval) more to drain by the time new
        workers serve. (0, 0) with no load signal, or no such growth."""
        if self.loads is None:
            return 0.0, 0.0, ""
        load = self.loads()
        growth, self._waiting = load.num_waiting - self._waiting, load.num_waiting
        if growth <= SIGMAS * math.sqrt(max(0.0, window.num_requests + growth)):  # within the arrivals' noise
            return 0.0, 0.0, f", {load.num_waiting} queued at {load.num_workers} workers"
        sure = (window.num_requests + growth) / window.interval_s
        drain = load.num_waiting / (self.startup_s + self.config.load_interval_s)
        return (
            sure,
            sure + drain,
            (
                f", queues grew by {growth} to {load.num_waiting} at {load.num_workers} "
                f"workers: >= {sure:.2f} req/s, + {drain:.2f} to drain"
            ),
        )

    def _at_rate(self, rate: float) -> Decision:
        """The pools `rate` req/s of the forecast's ISL and OSL need, as profiled."""
        return self._size(replace(self.forecast(), num_requests=rate * self.config.interval_s), NO_CORRECTION)

    @staticmethod
    def _grows(decision: Decision, current: tuple[int, int]) -> bool:
        return decision.num_prefill > current[0] or decision.num_decode > current[1]

    @staticmethod
    def _grows_tuple(wanted: tuple[int, int], current: tuple[int, int]) -> bool:
        return wanted[0] > current[0] or wanted[1] > current[1]

    def _size(self, forecast: Forecast, corrections: Corrections) -> Decision:
        capacity = None
        if self.config.mode == "agg" and corrections == NO_CORRECTION:  # every burst check: bisect once per ISL/OSL
            key = (forecast.isl, forecast.osl)
            if self._capacity is None or self._capacity[0] != key:
                self._capacity = (key, agg_capacity(self.profile, *key, self.config.targets, self.config.headroom))
            capacity = self._capacity[1]
        return plan_replicas(
            self.profile,
            forecast,
            self.config.interval_s,
            corrections,
            self.config.targets,
            self.config.bounds,
            self.config.mode,
            self.config.headroom,
            capacity,
            self.ranks.now,
        )

    def _hold(self, decision: Decision) -> Decision:
        """Scale down no lower than the latest windows and the trend need (an interval's mean lags a step up)."""
        window = self._window_need
        if window is None or not self._grows(window, (decision.num_prefill, decision.num_decode)):
            return decision
        prefill, decode = max(decision.num_prefill, window.num_prefill), max(decision.num_decode, window.num_decode)
        why = f"{decision.why}; held at prefill {prefill}, decode {decode}: the latest load windows need them"
        return replace(decision, num_prefill=prefill, num_decode=decode, why=why)

    def _observe(self, observation: Observation) -> None:
        self._predictors["rate"].observe(observation.demand() / observation.interval_s)
        if observation.num_requests > 0:  # an idle interval says nothing about prompt lengths
            self._predictors["isl"].observe(observation.isl)
            self._predictors["osl"].observe(observation.osl)

    def forecast(self) -> Forecast:
        """The next throughput interval as the predictors see it."""
        isl = self._predictors["isl"].predict() or self.config.default_isl
        osl = self._predictors["osl"].predict() or self.config.default_osl
        return Forecast(num_requests=self._predictors["rate"].predict() * self.config.interval_s, isl=isl, osl=osl)

    async def _current(self) -> tuple[int, int]:
        if self.counter is None:
            return self._wanted
        count = await self.counter()
        self.ranks.read(count)
        current = count.counts
        if self._rising is not None and current[0] >= self._rising[1][0] and current[1] >= self._rising[1][1]:
            self.startup_s = self._now - self._rising[0]
            self._rising = None
            logger.info(
                "new workers served %.1f s after the scale-up: bursts project %.1f s ahead from now on",
                self.startup_s,
                self.startup_s + self.config.load_interval_s,
            )
        return current

    def _time_startup(self, previous: tuple[int, int], current: tuple[int, int], wanted: tuple[int, int]) -> None:
        """Time a decision that starts workers (beyond both those serving and those asked for before), unless one
        is being timed; a decision below the one being timed cancels it (its newest workers were released)."""
        if self.counter is None or self.config.startup_s <= 0:
            return
        if self._rising is not None and (wanted[0] < self._rising[1][0] or wanted[1] < self._rising[1][1]):
            self._rising = None
        floor = (max(previous[0], current[0]), max(previous[1], current[1]))
        if self._rising is None and self._grows_tuple(wanted, floor):
            self._rising = (self._now, wanted)

    async def _take(
        self, kind: str, decision: Decision, observation: Observation | None, current: tuple[int, int]
    ) -> Step:
        if self._next_id == 0 and self.connector is not None:
            self._next_id = await self.connector.next_decision_id()
        self._next_id = max(self._next_id, 1)
        wanted = (decision.num_prefill, decision.num_decode)
        applied: bool | None = None
        if self.connector is not None and (wanted != current or wanted != self._wanted):
            applied = await self.connector.apply(ScaleTarget(self._next_id, *wanted))
            self._time_startup(self._wanted, current, wanted)
        self._wanted = wanted
        step = Step(
            decision_id=self._next_id,
            kind=kind,
            decision=decision,
            observation=observation,
            current=current,
            applied=applied,
        )
        self._next_id += 1
        self.num_steps += 1
        self.last_step = step
        logger.info("%s; observed %s; forecast %s; %s", step, observation, decision.forecast, decision.corrections.why)
        if self.report is not None:
            self.report(step)
        return step


def log_decisions() -> None:
    """Log each decision (and each worker started or drained) at INFO even where the process logs only warnings:
    a deployment that scales itself says why."""
    planner = logging.getLogger("dynamo_cli.planner")
    if planner.getEffectiveLevel() > logging.INFO:
        planner.setLevel(logging.INFO)
