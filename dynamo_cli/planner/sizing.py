"""Replica arithmetic: from a forecast, a profile and SLO targets to prefill and decode worker counts.

Disagg: Dynamo's classic SLA planner (reference §7.1), one pure function per step, with the prefill pool
sized at utilization ρ = 2k / (1 + 2k), k = (T − S) / S, so an M/D/1 queue keeps the mean TTFT within the
target. Agg: one pool time-shares both phases, ITL = d(usage) / (1 − φ) with φ = r·S its prefill share;
`agg_capacity` bisects for the highest rate per rank meeting both targets × `headroom`.

NOTE: a profile describes one engine, a data-parallel rank; a worker of R ranks (its card's `dp_size`) is R
independent engines, serving R times a rank's load. Every need below is in ranks, and a pool asks for
ceil(ranks / R) workers: the bounds, the budget and the decision count workers.

Design: docs/design/planner.md (the formulas, the M/D/1 bound, the agg fixed point, the ramp limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynamo_cli.planner.profile import (
    DecodePoint,
    Profile,
    best_decode_throughput,
    decode_itl_ms,
    kv_usage_of,
    prefill_throughput_per_gpu,
    prefill_ttft_ms,
)
from dynamo_cli.settings import setting

_EPS = 1e-9  # ceil(3.0000000001) must be 3: demand / capacity is computed in floating point
_FIXED_POINT_STEPS = 60
_BISECTION_STEPS = 30


@dataclass(frozen=True, slots=True)
class Targets:
    """The SLOs the planner sizes for."""

    ttft_ms: float = setting(0.0, "--ttft", env="DYN_PLANNER_TTFT")
    """TTFT target (ms; required)."""
    itl_ms: float = setting(0.0, "--itl", env="DYN_PLANNER_ITL")
    """ITL target (ms; required)."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """Limits on what the planner may ask for."""

    min_workers: int = setting(1, "--min-workers", env="DYN_PLANNER_MIN_WORKERS")
    """Fewest workers per pool (Dynamo's min_endpoint)."""
    max_workers: int = setting(8, "--max-workers", env="DYN_PLANNER_MAX_WORKERS")
    """Most workers per pool."""
    gpu_budget: int = setting(-1, "--gpu-budget", env="DYN_PLANNER_GPU_BUDGET")
    """GPUs over all pools (-1: unlimited; Dynamo's max_gpu_budget)."""


@dataclass(frozen=True, slots=True)
class RanksPerWorker:
    """The data-parallel ranks each worker of a pool serves, each an engine as the profile describes one."""

    prefill: int = 1
    """Of a prefill worker."""
    decode: int = 1
    """Of a decode worker (agg: of the one pool's)."""

    @classmethod
    def every(cls, ranks: int) -> RanksPerWorker:
        """`ranks` in both pools."""
        return cls(prefill=ranks, decode=ranks)


ONE_RANK = RanksPerWorker()
"""Rank-blind workers: one rank each, the worker is the profiled engine."""


@dataclass(frozen=True, slots=True)
class Observation:
    """What the frontends saw over the interval that just ended."""

    interval_s: float
    """Length of the interval."""
    num_requests: float
    """Requests completed."""
    isl: float
    """Mean input tokens per request."""
    osl: float
    """Mean output tokens per request."""
    ttft_ms: float
    """Mean TTFT (0: none observed)."""
    itl_ms: float
    """Mean ITL (0: none observed)."""
    request_duration_s: float
    """Mean end-to-end request time."""
    arrived: float = -1.0
    """Requests that arrived: completed plus the growth of requests in flight (-1: not known, use
    `num_requests`). Under overload completions lag arrivals, so demand is read from this."""

    def demand(self) -> float:
        """Requests the interval asked for."""
        return self.arrived if self.arrived >= 0 else self.num_requests


@dataclass(frozen=True, slots=True)
class Forecast:
    """The predictors' view of the next interval."""

    num_requests: float
    """Requests expected over the next interval."""
    isl: float
    """Mean input tokens expected."""
    osl: float
    """Mean output tokens expected."""


@dataclass(frozen=True, slots=True)
class Corrections:
    """How far live latency is from what the profile predicts (1.0: as profiled)."""

    prefill: float
    """Observed TTFT / profile TTFT at the observed ISL."""
    decode: float
    """Observed ITL / profile ITL at the observed concurrency and context."""
    why: str
    """One line: the numbers behind both factors."""


@dataclass(frozen=True, slots=True)
class Decision:
    """One planning step's outcome with everything that led to it."""

    mode: str
    """agg or disagg."""
    num_prefill: int
    """Prefill workers wanted (0 in agg mode)."""
    num_decode: int
    """Decode workers wanted (in agg mode: the one pool)."""
    forecast: Forecast
    """The predicted next interval."""
    corrections: Corrections
    """Correction factors applied."""
    why: str
    """One line: demand in ranks, capacity, workers and the clamps that produced the counts."""
    ranks: RanksPerWorker = ONE_RANK
    """Ranks per worker of each pool: the counts are workers of this many ranks."""

    @property
    def num_prefill_ranks(self) -> int:
        """Prefill ranks the counts serve."""
        return self.num_prefill * self.ranks.prefill

    @property
    def num_decode_ranks(self) -> int:
        """Decode (agg: the pool's) ranks the counts serve."""
        return self.num_decode * self.ranks.decode


NO_CORRECTION = Corrections(prefill=1.0, decode=1.0, why="no traffic observed: factors 1.0")


def correction_factors(
    profile: Profile, observed: Observation, num_decode_ranks: int, mode: str = "disagg"
) -> Corrections:
    """Dynamo's p_corr and d_corr (agg mode: against `agg_point`) with the load spread over `num_decode_ranks` (the
    decode pool's workers × their ranks); 1.0 for a phase with nothing observed."""
    if observed.num_requests <= 0:
        return NO_CORRECTION
    if mode == "agg":
        return agg_corrections(profile, observed, num_decode_ranks)
    expected_ttft = prefill_ttft_ms(profile, observed.isl)
    prefill = observed.ttft_ms / expected_ttft if observed.ttft_ms > 0 else 1.0
    concurrency = observed.num_requests / max(num_decode_ranks, 1) * observed.request_duration_s / observed.interval_s
    context = observed.isl + observed.osl / 2
    expected_itl = decode_itl_ms(profile, kv_usage_of(profile, concurrency, context), context)
    decode = observed.itl_ms / expected_itl if observed.itl_ms > 0 else 1.0
    why = (
        f"p_corr {prefill:.2f} = TTFT {observed.ttft_ms:.1f}/{expected_ttft:.1f} ms at ISL {observed.isl:.0f}; "
        f"d_corr {decode:.2f} = ITL {observed.itl_ms:.1f}/{expected_itl:.1f} ms at {concurrency:.1f} req × "
        f"{context:.0f} tok"
    )
    return Corrections(prefill=prefill, decode=decode, why=why)


def agg_corrections(profile: Profile, observed: Observation, num_ranks: int) -> Corrections:
    """Observed TTFT and ITL over what `agg_point` predicts at the observed requests per rank."""
    rate = observed.num_requests / observed.interval_s / max(num_ranks, 1)
    point = agg_point(profile, rate, observed.isl, observed.osl)
    prefill = observed.ttft_ms / point.ttft_ms if observed.ttft_ms > 0 and 0 < point.ttft_ms < math.inf else 1.0
    decode = observed.itl_ms / point.itl_ms if observed.itl_ms > 0 and 0 < point.itl_ms < math.inf else 1.0
    why = (
        f"p_corr {prefill:.2f} = TTFT {observed.ttft_ms:.1f}/{point.ttft_ms:.1f} ms, d_corr {decode:.2f} = ITL "
        f"{observed.itl_ms:.1f}/{point.itl_ms:.1f} ms at {rate:.2f} req/s per agg rank"
    )
    return Corrections(prefill=prefill, decode=decode, why=why)


def prefill_utilization(unloaded_ttft_ms: float, ttft_target_ms: float) -> float:
    """ρ: the prefill load at which M/D/1 queueing keeps mean TTFT within the target (1.0 if out of reach)."""
    if ttft_target_ms <= unloaded_ttft_ms:
        return 1.0
    k = (ttft_target_ms - unloaded_ttft_ms) / unloaded_ttft_ms
    return 2 * k / (1 + 2 * k)


def prefill_need(
    profile: Profile, forecast: Forecast, interval_s: float, p_corr: float, ttft_ms: float
) -> tuple[float, str]:
    """Fractional prefill ranks (engines as profiled) the forecast needs, with its one-line reason."""
    demand = forecast.num_requests * forecast.isl / interval_s * min(1.0, p_corr)
    per_gpu = prefill_throughput_per_gpu(profile, forecast.isl)
    unloaded = prefill_ttft_ms(profile, forecast.isl)
    rho = prefill_utilization(unloaded, ttft_ms)
    need = demand / (per_gpu * rho) / profile.num_gpus_per_engine
    reach = "" if unloaded < ttft_ms else f" (TTFT target {ttft_ms:.0f} ms < unloaded {unloaded:.0f} ms: unreachable)"
    why = (
        f"prefill {demand:.0f} tok/s = {forecast.num_requests:.0f} req × {forecast.isl:.0f} tok / "
        f"{interval_s:g} s × min(1, {p_corr:.2f}) over {per_gpu:.0f} tok/s/GPU × ρ {rho:.2f} "
        f"→ {need:.2f}{reach}"
    )
    return need, why


def decode_need(
    profile: Profile, forecast: Forecast, interval_s: float, d_corr: float, itl_ms: float
) -> tuple[float, DecodePoint, str]:
    """Fractional decode ranks the forecast needs, the operating point used, and the reason."""
    corrected_itl = itl_ms / d_corr if d_corr > 0 else itl_ms
    point = best_decode_throughput(profile, corrected_itl, forecast.isl + forecast.osl / 2)
    demand = forecast.num_requests * forecast.osl / interval_s
    need = demand / point.throughput_per_gpu / profile.num_gpus_per_engine
    reach = "" if point.meets_itl else " (ITL target unreachable even at the lowest usage)"
    why = (
        f"decode {demand:.0f} tok/s over {point.throughput_per_gpu:.0f} tok/s/GPU at ITL {corrected_itl:.1f} ms "
        f"(usage {point.kv_usage:.2f}, {point.concurrency:.0f} req) → {need:.2f}{reach}"
    )
    return need, point, why


@dataclass(frozen=True, slots=True)
class AggPoint:
    """One aggregated rank at a request rate: its passes prefill new prompts and decode every stream."""

    rate: float
    """Requests/s arriving at the rank."""
    prefill_share: float
    """φ: the fraction of its time spent prefilling, rate × unloaded prefill time."""
    ttft_ms: float
    """Unloaded prefill plus the M/D/1 wait at φ (inf at φ >= 1)."""
    itl_ms: float
    """Decode step at the resident streams' KV usage / (1 − φ) (inf when they overflow the KV cache)."""
    concurrency: float
    """Streams resident: rate × (TTFT + OSL × ITL)."""


def agg_point(profile: Profile, rate: float, isl: float, osl: float) -> AggPoint:
    """TTFT and ITL of one agg rank receiving `rate` req/s of `isl`/`osl` (module NOTE)."""
    unloaded = prefill_ttft_ms(profile, isl) / 1000.0
    share = rate * unloaded
    if share >= 1.0:
        return AggPoint(rate, share, math.inf, math.inf, math.inf)
    ttft = unloaded + share * unloaded / (2 * (1 - share))
    context = isl + osl / 2
    itl = decode_itl_ms(profile, 0.0, context) / (1 - share)
    concurrency = rate * (ttft + osl * itl / 1000.0)
    for _ in range(_FIXED_POINT_STEPS):  # rises monotonically to the least fixed point, or past the KV cache
        usage = kv_usage_of(profile, concurrency, context)
        if usage > 1.0 or concurrency > profile.max_num_seqs:
            return AggPoint(rate, share, ttft * 1000, math.inf, concurrency)
        previous, itl = itl, decode_itl_ms(profile, usage, context) / (1 - share)
        concurrency = rate * (ttft + osl * itl / 1000.0)
        if itl - previous < 1e-6:
            break
    return AggPoint(rate, share, ttft * 1000, itl, concurrency)


def agg_capacity(profile: Profile, isl: float, osl: float, targets: Targets, headroom: float) -> AggPoint:
    """The highest per-rank rate whose TTFT and ITL stay within the targets × headroom (rate 0: none does)."""
    ttft, itl = targets.ttft_ms * headroom, targets.itl_ms * headroom
    low, high = 0.0, 1000.0 / prefill_ttft_ms(profile, isl)
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        point = agg_point(profile, middle, isl, osl)
        low, high = (middle, high) if point.ttft_ms <= ttft and point.itl_ms <= itl else (low, middle)
    return agg_point(profile, low, isl, osl)


def max_ramp_slope(
    profile: Profile,
    isl: float,
    osl: float,
    targets: Targets,
    headroom: float,
    startup_s: float,
    mode: str = "agg",
    ranks: RanksPerWorker = ONE_RANK,
) -> float:
    """The steepest linear ramp of the request rate (req/s per second) a single worker's start-up can follow:
    half of one worker's capacity per `startup_s`. A ramp shows only once it has begun, so the pool meets it
    with the capacity it has spare, half a worker's on average (pools are sized by rounding up), until a worker
    started then serves, one start-up later; once the ramp's slope is known, each start-up adds the next
    worker in time. One worker's capacity at `isl`/`osl`: its `ranks` times one rank's; agg, `agg_capacity` at
    the targets × `headroom`; disagg, the smaller of one prefill and one decode worker's rate as `prefill_need`
    and `decode_need` size them. inf with no start-up."""
    if startup_s <= 0:
        return math.inf
    if mode == "agg":
        return ranks.decode * agg_capacity(profile, isl, osl, targets, headroom).rate / (2 * startup_s)
    one = Forecast(num_requests=1.0, isl=isl, osl=osl)  # 1 req/s over a 1 s interval
    prefill, _ = prefill_need(profile, one, 1.0, 1.0, targets.ttft_ms)
    decode, _, _ = decode_need(profile, one, 1.0, 1.0, targets.itl_ms)
    return 1.0 / max(prefill / ranks.prefill, decode / ranks.decode, 1e-12) / (2 * startup_s)


def agg_need(
    profile: Profile,
    forecast: Forecast,
    interval_s: float,
    targets: Targets,
    headroom: float,
    capacity: AggPoint | None = None,
) -> tuple[float, str]:
    """Fractional agg ranks the forecast needs, with its one-line reason (`capacity`: agg_capacity's answer
    for these arguments, when the caller already has it)."""
    rate = forecast.num_requests / interval_s
    point = capacity or agg_capacity(profile, forecast.isl, forecast.osl, targets, headroom)
    if point.rate <= 0:  # the targets are out of reach: size for a worker half busy prefilling
        point = agg_point(profile, 500.0 / prefill_ttft_ms(profile, forecast.isl), forecast.isl, forecast.osl)
        reach = f" (targets × {headroom:g} unreachable at any load: sized at φ 0.5)"
    else:
        reach = ""
    need = rate / point.rate
    why = (
        f"agg {rate:.2f} req/s of {forecast.isl:.0f}+{forecast.osl:.0f} tok over {point.rate:.2f} req/s per "
        f"rank (φ {point.prefill_share:.2f}, TTFT {point.ttft_ms:.0f} ms, ITL {point.itl_ms:.1f} ms, "
        f"{point.concurrency:.0f} streams; targets × {headroom:g}) → {need:.2f}{reach}"
    )
    return need, why


def clamp(count: int, bounds: Bounds) -> int:
    return max(bounds.min_workers, min(bounds.max_workers, count))


def fit_budget(
    num_prefill: int, num_decode: int, profile: Profile, bounds: Bounds, ranks: RanksPerWorker = ONE_RANK
) -> tuple[int, int]:
    """Dynamo's GPU budget rule: over budget, scale prefill proportionally and give decode the rest (a worker's
    GPUs: its ranks × the profile's GPUs per engine)."""
    gpus_p, gpus_d = profile.num_gpus_per_engine * ranks.prefill, profile.num_gpus_per_engine * ranks.decode
    total = num_prefill * gpus_p + num_decode * gpus_d
    if bounds.gpu_budget < 0 or total <= bounds.gpu_budget:
        return num_prefill, num_decode
    if num_prefill == 0:  # agg: one pool
        return 0, max(bounds.min_workers, bounds.gpu_budget // gpus_d)
    scale = bounds.gpu_budget / total
    prefill = max(bounds.min_workers, round(num_prefill * scale))
    decode = max(bounds.min_workers, round((bounds.gpu_budget - prefill * gpus_p) / gpus_d))
    return prefill, decode


_CORRECTION = (0.8, 1.25)
"""Agg mode divides the targets by the correction factors clamped to this range: the profile stays the
model, live latency only nudges it (an overloaded interval's TTFT would otherwise ask for the moon)."""


def _within(factor: float) -> float:
    return min(_CORRECTION[1], max(_CORRECTION[0], factor))


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPS))


def _workers_for(need: float, ranks_per_worker: int) -> tuple[int, str]:
    """Workers of `ranks_per_worker` ranks for `need` ranks, ceil(need / ranks), and how: `ceil 8` for one rank
    each, `ceil(13.20 ranks / 4) = 4` for more."""
    count = _ceil(need / ranks_per_worker)
    if ranks_per_worker == 1:
        return count, f"ceil {count}"
    return count, f"ceil({need:.2f} ranks / {ranks_per_worker}) = {count}"


def _counted(count: int, how: str, ranks_per_worker: int) -> str:
    """`8 (ceil 8)`, or with ranks `4 workers × 4 ranks (ceil(13.20 ranks / 4) = 4)`."""
    if ranks_per_worker == 1:
        return f"{count} ({how})"
    return f"{count} worker{'' if count == 1 else 's'} × {ranks_per_worker} ranks ({how})"


def plan_replicas(
    profile: Profile,
    forecast: Forecast,
    interval_s: float,
    corrections: Corrections,
    targets: Targets,
    bounds: Bounds,
    mode: str = "disagg",
    headroom: float = 1.0,
    capacity: AggPoint | None = None,
    ranks: RanksPerWorker = ONE_RANK,
) -> Decision:
    """Worker counts for the next interval (prefill and decode pools, or one agg pool; `capacity`: see agg_need,
    valid only with no correction): each pool's need in ranks, in workers of its `ranks` each (module NOTE)."""
    if mode == "agg":
        return _plan_agg(profile, forecast, interval_s, corrections, targets, bounds, headroom, capacity, ranks)
    p_need, p_why = prefill_need(profile, forecast, interval_s, corrections.prefill, targets.ttft_ms)
    d_need, _, d_why = decode_need(profile, forecast, interval_s, corrections.decode, targets.itl_ms)
    (raw_p, p_ceil), (raw_d, d_ceil) = _workers_for(p_need, ranks.prefill), _workers_for(d_need, ranks.decode)
    num_p, num_d = fit_budget(clamp(raw_p, bounds), clamp(raw_d, bounds), profile, bounds, ranks)
    counts = f"prefill {_counted(num_p, p_ceil, ranks.prefill)}, decode {_counted(num_d, d_ceil, ranks.decode)}"
    limits = f"[{bounds.min_workers}, {bounds.max_workers}] per pool"
    if bounds.gpu_budget >= 0:
        limits += f", {bounds.gpu_budget} GPUs"
    why = f"{counts} within {limits}: {p_why}; {d_why}"
    return Decision(
        mode="disagg",
        num_prefill=num_p,
        num_decode=num_d,
        forecast=forecast,
        corrections=corrections,
        why=why,
        ranks=ranks,
    )


def _plan_agg(
    profile: Profile,
    forecast: Forecast,
    interval_s: float,
    corrections: Corrections,
    targets: Targets,
    bounds: Bounds,
    headroom: float,
    capacity: AggPoint | None,
    ranks: RanksPerWorker,
) -> Decision:
    corrected = Targets(targets.ttft_ms / _within(corrections.prefill), targets.itl_ms / _within(corrections.decode))
    need, why = agg_need(
        profile, forecast, interval_s, corrected, headroom, capacity if corrections == NO_CORRECTION else None
    )
    raw_d, how = _workers_for(need, ranks.decode)
    num_p, num_d = fit_budget(0, clamp(raw_d, bounds), profile, bounds, ranks)
    why = (
        f"agg {_counted(num_d, how, ranks.decode)} within [{bounds.min_workers}, {bounds.max_workers}]: "
        f"{why}; targets / corrections clamped to [{_CORRECTION[0]:g}, {_CORRECTION[1]:g}]"
    )
    return Decision(
        mode="agg",
        num_prefill=num_p,
        num_decode=num_d,
        forecast=forecast,
        corrections=corrections,
        why=why,
        ranks=ranks,
    )
