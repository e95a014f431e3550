"""Replica arithmetic: from a forecast, a profile and SLO targets to prefill and decode worker counts.

Dynamo's classic SLA planner (reference §7.1), one pure function per step:

    p_corr = observed TTFT / profile TTFT(observed ISL)
    d_corr = observed ITL / profile ITL(usage of (num_req / num_decode × duration / interval) requests, isl + osl/2)
    prefill demand = next_req × next_isl / interval × min(1, p_corr)                  [tokens/s]
    num_prefill    = ceil(demand / (prefill tokens/s/GPU(next_isl) × ρ) / GPUs per engine)
    num_decode     = ceil(next_req × next_osl / interval / best decode tokens/s/GPU(itl / d_corr,
                          next_isl + next_osl/2) / GPUs per engine)

then each pool is clamped to [min_workers, max_workers] and, over the GPU budget, scaled as Dynamo's
budget.py does (prefill proportionally, the remainder to decode).

NOTE: ρ is what dyn adds so that the TTFT target counts: the prefill utilization at which an M/D/1 queue
of unloaded prefill time S keeps the mean TTFT S + ρS / (2(1 − ρ)) within the target T, that is
ρ = 2k / (1 + 2k) with k = (T − S) / S (1.0 when T <= S: the target is out of reach at any load; the
decision says so). In agg mode one pool time-shares both phases: workers = ceil(prefill fraction +
decode fraction), each fraction being the pool size that phase alone would need.
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

_EPS = 1e-9  # ceil(3.0000000001) must be 3: demand / capacity is computed in floating point


@dataclass(frozen=True, slots=True)
class Targets:
    """The SLOs the planner sizes for."""

    ttft_ms: float
    """Time-to-first-token target."""
    itl_ms: float
    """Inter-token latency target."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """Limits on what the planner may ask for."""

    min_workers: int = 1
    """Per pool (Dynamo's min_endpoint)."""
    max_workers: int = 8
    """Per pool."""
    gpu_budget: int = -1
    """GPUs over all pools (-1: unlimited; Dynamo's max_gpu_budget)."""


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
    """One line: demand, capacity and the clamps that produced the counts."""


NO_CORRECTION = Corrections(prefill=1.0, decode=1.0, why="no traffic observed: factors 1.0")


def correction_factors(profile: Profile, observed: Observation, num_decode_workers: int) -> Corrections:
    """Dynamo's p_corr and d_corr; 1.0 for a phase with nothing observed."""
    if observed.num_requests <= 0:
        return NO_CORRECTION
    expected_ttft = prefill_ttft_ms(profile, observed.isl)
    prefill = observed.ttft_ms / expected_ttft if observed.ttft_ms > 0 else 1.0
    concurrency = observed.num_requests / max(num_decode_workers, 1) * observed.request_duration_s / observed.interval_s
    context = observed.isl + observed.osl / 2
    expected_itl = decode_itl_ms(profile, kv_usage_of(profile, concurrency, context), context)
    decode = observed.itl_ms / expected_itl if observed.itl_ms > 0 else 1.0
    why = (f"p_corr {prefill:.2f} = TTFT {observed.ttft_ms:.1f}/{expected_ttft:.1f} ms at ISL {observed.isl:.0f}; "
           f"d_corr {decode:.2f} = ITL {observed.itl_ms:.1f}/{expected_itl:.1f} ms at {concurrency:.1f} req × "
           f"{context:.0f} tok")  # fmt: skip
    return Corrections(prefill=prefill, decode=decode, why=why)


def prefill_utilization(unloaded_ttft_ms: float, ttft_target_ms: float) -> float:
    """ρ: the prefill load at which M/D/1 queueing keeps mean TTFT within the target (1.0 if out of reach)."""
    if ttft_target_ms <= unloaded_ttft_ms:
        return 1.0
    k = (ttft_target_ms - unloaded_ttft_ms) / unloaded_ttft_ms
    return 2 * k / (1 + 2 * k)


def prefill_need(profile: Profile, forecast: Forecast, interval_s: float, p_corr: float,
                 ttft_ms: float) -> tuple[float, str]:  # fmt: skip
    """Fractional prefill workers the forecast needs, with its one-line reason."""
    demand = forecast.num_requests * forecast.isl / interval_s * min(1.0, p_corr)
    per_gpu = prefill_throughput_per_gpu(profile, forecast.isl)
    unloaded = prefill_ttft_ms(profile, forecast.isl)
    rho = prefill_utilization(unloaded, ttft_ms)
    need = demand / (per_gpu * rho) / profile.num_gpus_per_engine
    reach = "" if unloaded < ttft_ms else f" (TTFT target {ttft_ms:.0f} ms < unloaded {unloaded:.0f} ms: unreachable)"
    why = (f"prefill {demand:.0f} tok/s = {forecast.num_requests:.0f} req × {forecast.isl:.0f} tok / "
           f"{interval_s:g} s × min(1, {p_corr:.2f}) over {per_gpu:.0f} tok/s/GPU × ρ {rho:.2f} "
           f"→ {need:.2f}{reach}")  # fmt: skip
    return need, why


def decode_need(profile: Profile, forecast: Forecast, interval_s: float, d_corr: float,
                itl_ms: float) -> tuple[float, DecodePoint, str]:  # fmt: skip
    """Fractional decode workers the forecast needs, the operating point used, and the reason."""
    corrected_itl = itl_ms / d_corr if d_corr > 0 else itl_ms
    point = best_decode_throughput(profile, corrected_itl, forecast.isl + forecast.osl / 2)
    demand = forecast.num_requests * forecast.osl / interval_s
    need = demand / point.throughput_per_gpu / profile.num_gpus_per_engine
    reach = "" if point.meets_itl else " (ITL target unreachable even at the lowest usage)"
    why = (f"decode {demand:.0f} tok/s over {point.throughput_per_gpu:.0f} tok/s/GPU at ITL {corrected_itl:.1f} ms "
           f"(usage {point.kv_usage:.2f}, {point.concurrency:.0f} req) → {need:.2f}{reach}")  # fmt: skip
    return need, point, why


def clamp(count: int, bounds: Bounds) -> int:
    return max(bounds.min_workers, min(bounds.max_workers, count))


def fit_budget(num_prefill: int, num_decode: int, profile: Profile, bounds: Bounds) -> tuple[int, int]:
    """Dynamo's GPU budget rule: over budget, scale prefill proportionally and give decode the rest."""
    gpus = profile.num_gpus_per_engine
    total = (num_prefill + num_decode) * gpus
    if bounds.gpu_budget < 0 or total <= bounds.gpu_budget:
        return num_prefill, num_decode
    if num_prefill == 0:  # agg: one pool
        return 0, max(bounds.min_workers, bounds.gpu_budget // gpus)
    scale = bounds.gpu_budget / total
    prefill = max(bounds.min_workers, round(num_prefill * scale))
    decode = max(bounds.min_workers, round((bounds.gpu_budget - prefill * gpus) / gpus))
    return prefill, decode


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPS))


def plan_replicas(profile: Profile, forecast: Forecast, interval_s: float, corrections: Corrections,
                  targets: Targets, bounds: Bounds, mode: str = "disagg") -> Decision:  # fmt: skip
    """Worker counts for the next interval (prefill and decode pools, or one agg pool)."""
    p_need, p_why = prefill_need(profile, forecast, interval_s, corrections.prefill, targets.ttft_ms)
    d_need, _, d_why = decode_need(profile, forecast, interval_s, corrections.decode, targets.itl_ms)
    if mode == "agg":
        raw_p, raw_d = 0, _ceil(p_need + d_need)
        num_p, num_d = fit_budget(0, clamp(raw_d, bounds), profile, bounds)
        counts = f"agg {num_d} = ceil({p_need:.2f} + {d_need:.2f}) = {raw_d}"
    else:
        raw_p, raw_d = _ceil(p_need), _ceil(d_need)
        num_p, num_d = fit_budget(clamp(raw_p, bounds), clamp(raw_d, bounds), profile, bounds)
        counts = f"prefill {num_p} (ceil {raw_p}), decode {num_d} (ceil {raw_d})"
    limits = f"[{bounds.min_workers}, {bounds.max_workers}] per pool"
    if bounds.gpu_budget >= 0:
        limits += f", {bounds.gpu_budget} GPUs"
    why = f"{counts} within {limits}: {p_why}; {d_why}"
    return Decision(mode=mode, num_prefill=num_p, num_decode=num_d, forecast=forecast,
                    corrections=corrections, why=why)  # fmt: skip
