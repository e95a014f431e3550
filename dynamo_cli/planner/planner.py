"""The planner loop: each interval observe the frontends, forecast, size the pools, apply.

NOTE: two cadences, as Dynamo's throughput and load intervals. Every `interval_s` the throughput step
runs the classic SLA planner (replicas.py) on the interval's traffic. Every `load_interval_s` in between,
the burst check compares requests in flight with what the current decode pool can hold at the ITL
target (the profile's concurrency per worker) and scales up at once when queues outgrow it, so a burst
is met within one short interval rather than at the next throughput step. Bursts only scale up; the
throughput step scales down. One scale action is in flight at a time (the loop awaits `apply`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from dynamo_cli.errors import PlaneUnavailable
from dynamo_cli.planner.connectors import Connector, ScaleTarget
from dynamo_cli.planner.observe import Snapshot, observation_between
from dynamo_cli.planner.predictors import make_predictor
from dynamo_cli.planner.profile import Profile, best_decode_throughput
from dynamo_cli.planner.replicas import (
    Bounds,
    Decision,
    Forecast,
    Observation,
    Targets,
    clamp,
    correction_factors,
    plan_replicas,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """`dyn plan run`."""

    targets: Targets
    """TTFT and ITL targets."""
    bounds: Bounds
    """Per-pool min/max and the GPU budget."""
    mode: str = "disagg"
    """agg (one pool) or disagg (prefill and decode pools)."""
    interval_s: float = 60.0
    """Throughput step period (Dynamo: 180 s)."""
    load_interval_s: float = 5.0
    """Burst check period (0: off; Dynamo's load interval: 5 s)."""
    predictor: str = "constant"
    """constant | moving-average | kalman."""
    default_isl: float = 3000.0
    """ISL assumed before any request is seen (Dynamo's profiling default)."""
    default_osl: float = 150.0
    """OSL assumed before any request is seen."""


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


class Snapshotter(Protocol):
    async def snapshot(self) -> Snapshot: ...


WorkerCounter = Callable[[], Awaitable[tuple[int, int]]]
Reporter = Callable[[Step], None]


class Planner:
    """Owns the predictors and the last decision; the connector and metric source are passed in."""

    def __init__(self, config: PlannerConfig, profile: Profile, source: Snapshotter, connector: Connector | None,
                 counter: WorkerCounter | None = None, report: Reporter | None = None) -> None:  # fmt: skip
        self.config, self.profile, self.source, self.connector = config, profile, source, connector
        self.counter, self.report = counter, report
        self._predictors = {name: make_predictor(config.predictor) for name in ("rate", "isl", "osl")}
        self._last: Snapshot | None = None
        self._wanted = (0 if config.mode == "agg" else config.bounds.min_workers, config.bounds.min_workers)
        self._next_id = 0
        self.steps: list[Step] = []

    async def run(self, stop: asyncio.Event) -> None:
        """Plan until `stop` is set; a tick that cannot read any frontend or discovery is skipped and logged."""
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
        """The throughput step: observe → forecast → correct → size → apply."""
        now = await self.source.snapshot()
        observation = observation_between(self._last or now, now)
        self._last = now
        self._observe(observation)
        forecast = self.forecast()
        current = await self._current()
        corrections = correction_factors(self.profile, observation, current[1])
        decision = plan_replicas(self.profile, forecast, self.config.interval_s, corrections, self.config.targets,
                                 self.config.bounds, self.config.mode)  # fmt: skip
        return await self._take("throughput", decision, observation, current)

    async def check_burst(self) -> Step | None:
        """Scale the decode pool (and prefill alike) up at once when requests in flight outgrow it."""
        snapshot = await self.source.snapshot()
        current = await self._current()
        forecast = self.forecast()
        point = best_decode_throughput(self.profile, self.config.targets.itl_ms, forecast.isl + forecast.osl / 2)
        per_worker = max(point.concurrency, 1.0)
        pool = max(current[1], 1)
        if snapshot.inflight <= pool * per_worker:
            return None
        wanted = clamp(math.ceil(snapshot.inflight / per_worker), self.config.bounds)
        if wanted <= current[1]:
            return None
        prefill = 0 if self.config.mode == "agg" else clamp(math.ceil(max(current[0], 1) * wanted / pool),
                                                            self.config.bounds)  # fmt: skip
        why = (f"burst: {snapshot.inflight:.0f} in flight > {pool} workers × {per_worker:.1f} req each at ITL "
               f"{self.config.targets.itl_ms:g} ms → decode {wanted}, prefill {prefill}")  # fmt: skip
        decision = Decision(mode=self.config.mode, num_prefill=prefill, num_decode=wanted, forecast=forecast,
                            corrections=correction_factors(self.profile, _IDLE, 1), why=why)  # fmt: skip
        return await self._take("burst", decision, None, current)

    def _observe(self, observation: Observation) -> None:
        self._predictors["rate"].observe(observation.num_requests / observation.interval_s)
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
        return await self.counter()

    async def _take(self, kind: str, decision: Decision, observation: Observation | None,
                    current: tuple[int, int]) -> Step:  # fmt: skip
        if self._next_id == 0 and self.connector is not None:
            self._next_id = await self.connector.next_decision_id()
        self._next_id = max(self._next_id, 1)
        wanted = (decision.num_prefill, decision.num_decode)
        applied: bool | None = None
        if self.connector is not None and (wanted != current or wanted != self._wanted):
            applied = await self.connector.apply(ScaleTarget(self._next_id, *wanted))
        self._wanted = wanted
        step = Step(decision_id=self._next_id, kind=kind, decision=decision, observation=observation,
                    current=current, applied=applied)  # fmt: skip
        self._next_id += 1
        self.steps.append(step)
        logger.info("decision %d (%s): prefill %d→%d, decode %d→%d; %s; observed %s; forecast %s; %s",
                    step.decision_id, kind, current[0], wanted[0], current[1], wanted[1], decision.why, observation,
                    decision.forecast, decision.corrections.why)  # fmt: skip
        if self.report is not None:
            self.report(step)
        return step


_IDLE = Observation(interval_s=1.0, num_requests=0, isl=0, osl=0, ttft_ms=0, itl_ms=0, request_duration_s=0)
