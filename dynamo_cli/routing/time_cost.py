"""The default KV routing cost: the time a choice costs, in seconds, so a cache hit and load trade evenly.

    cost = t_prefill + t_onboard + t_evict + t_memory                                  [seconds]
    t_prefill = (Q + U) / R,  U = max(0, isl - o * bs)
    t_onboard = sum over t in (host, disk) of o_t * B / bw_t + lat_t * [o_t > 0]
    t_evict   = max(0, (n - o_d) - max(0, C - K)) * bs / R
    t_memory  = max(0, A + k + (n - a) + 1 - C) * L / (A + k)

plus free copies of a prompt in flight (point 4), near-ties within one pass dealt in rounds (point 5) and a
pass seen starting (point 6). R and T0 are learned from first tokens, L from requests' time in flight.

Design: docs/design/router-time-cost.md (the symbols, each term's derivation, predictions and measurements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

import numpy as np

from dynamo_cli.routing.tier_costs import AS_DEVICE, TierCosts

PRIOR_PREFILL_TPS = 20_000.0
"""Prefill tokens/s per worker before any is observed (an 8B model on one H100-class GPU, roughly)."""
PRIOR_LIFETIME_S = 2.0
"""Seconds a request stays in flight before any has finished."""
PRIOR_PASS_S = 0.02
"""T0, a pass's fixed time (the TTFT of a prompt with nothing to compute), before it is observed."""
MAX_PASS_S = 0.25
"""The learned T0 is clamped to [0, this]: a fit over a few noisy first tokens must not make every worker a tie."""
ROOMY_FILL = 0.5
"""A cache is roomy for a copy that leaves it at most this full and evicts nothing."""
MIN_FIT_SPREAD_TOKENS = 256.0
"""Observed uncached prompt lengths must differ by this (standard deviation) to fit the prefill speed."""
HALF_LIFE_REQUESTS = 512
"""Observations after which an old one weighs half."""


@dataclass(frozen=True, slots=True)
class Speed:
    """What turns tokens and blocks into seconds."""

    prefill_tokens_per_s: float
    """R: prompt tokens one worker computes per second."""
    lifetime_s: float
    """L: mean seconds a request stays in flight (route to end of stream)."""
    pass_s: float = PRIOR_PASS_S
    """T0: the fixed part of a first token's time (intercept of TTFT against uncached tokens); costs
    closer than this are ties."""


Column = TypeVar("Column", float, np.ndarray)
"""One candidate's value (a number) or every candidate's (an array): `time_terms` reads the same for both."""


class TimeTerms(NamedTuple, Generic[Column]):
    """The three terms of the time cost, seconds: of one candidate, or of each (arrays aligned by candidate).
    A named tuple, not a dataclass: built once per candidate per decision, at a quarter of the cost."""

    prefill_s: Column
    onboard_s: Column
    """Copying the prefix's host and disk blocks back into the engine's cache."""
    evict_s: Column
    memory_s: Column
    queue_s: Column
    """The part of prefill_s spent behind the prefills already queued there (Q / R): the only part that
    near-ties (point 5) may disregard."""
    busy_s: Column | None = None
    """The fixed time T0 still to run of a prefill pass seen starting there (point 6); None: not known."""

    @property
    def total(self) -> Column:
        """The cost: lower wins."""
        total: Column = self.prefill_s + self.onboard_s + self.evict_s + self.memory_s
        return total


@dataclass(frozen=True, slots=True)
class Across:
    """What the cost of one candidate reads from the others (the same for every candidate of a decision)."""

    best_overlap: int
    """The longest cached prefix among the candidates, blocks (point 4: what a copy computes beyond it)."""
    prompt_in_flight: bool
    """The prompt is active on some candidate (point 4: a copy may be free)."""
    all_queued: bool
    """Every candidate has a prefill queued (point 6 applies)."""


def time_terms(
    *,
    isl: int,
    num_blocks: int,
    block_size: int,
    overlap: Column,
    queued_prefill: Column,
    active_blocks: Column,
    active_overlap: Column,
    in_flight: Column,
    cached: Column,
    capacity: Column,
    speed: Speed,
    across: Across,
    host: Column | None = None,
    disk: Column | None = None,
    tiers: TierCosts = AS_DEVICE,
    pass_elapsed: Column | None = None,
) -> TimeTerms[Column]:
    """The cost terms of one candidate (numbers) or of each (arrays aligned by candidate): written once, so
    the two cannot differ; capacity 0 = unknown; `host`, `disk`: how many of the `overlap` blocks sit on
    those tiers (None: all on device); `pass_elapsed`: seconds since a prefill pass was seen starting
    there (inf: none; None: not known)."""
    rate, at_least = speed.prefill_tokens_per_s, np.maximum if isinstance(overlap, np.ndarray) else max
    uncached = at_least(0, isl - overlap * block_size)
    onboard_s, on_device = overlap * 0.0, overlap
    if host is not None and disk is not None:
        onboard_s = (
            host * tiers.host_block_s
            + (host > 0) * tiers.host_latency_s
            + disk * tiers.disk_block_s
            + (disk > 0) * tiers.disk_latency_s
        )
        on_device = overlap - host - disk
    known = capacity > 0
    new_blocks = at_least(0, num_blocks - on_device)
    free = at_least(0, capacity - cached)  # approximate mode's guess can exceed the capacity
    if across.prompt_in_flight:  # a copy is free if roomy: its tokens beyond the best holder's are not counted
        copied = uncached - max(0, isl - across.best_overlap * block_size)
        uncached = uncached - copied * (known & (cached + new_blocks <= ROOMY_FILL * capacity))
    queue_s = queued_prefill / rate
    prefill_s = queue_s + uncached / rate
    evict_s = at_least(0, new_blocks - free) * known * (block_size / rate)
    held = active_blocks + in_flight
    overflow = at_least(0, held + at_least(0, num_blocks - active_overlap) + 1 - capacity) * known
    memory_s = overflow * speed.lifetime_s / at_least(1, held)
    busy_s = None
    if pass_elapsed is not None:  # point 6: only when every candidate has a prefill queued
        left = at_least(0.0, speed.pass_s - pass_elapsed)
        busy_s = left * ((left > speed.pass_s / 2) & across.all_queued)
    return TimeTerms(prefill_s, onboard_s, evict_s, memory_s, queue_s, busy_s)


class SpeedEstimator:
    """Learns R and L from what the router sees: first tokens and ends of streams."""

    def __init__(self, prefill_tokens_per_s: float | None = None, half_life: int = HALF_LIFE_REQUESTS) -> None:
        self._fixed = prefill_tokens_per_s
        self._decay = 0.5 ** (1 / half_life)
        self._sums = [0.0] * 5  # weight, x, y, xx, xy of (uncached tokens, time to first token)
        self._lifetime = PRIOR_LIFETIME_S
        self._lifetimes_seen = 0
        self.speed = Speed(prefill_tokens_per_s or PRIOR_PREFILL_TPS, PRIOR_LIFETIME_S, PRIOR_PASS_S)
        """The current estimate."""

    def observe_first_token(self, uncached_tokens: int, ttft_s: float) -> None:
        """A request with `uncached_tokens` to compute got its first token `ttft_s` after routing."""
        d, x, y = self._decay, float(uncached_tokens), ttft_s
        s = self._sums
        for i, value in enumerate((1.0, x, y, x * x, x * y)):
            s[i] = s[i] * d + value
        rate = self.speed.prefill_tokens_per_s
        if self._fixed is None:
            rate = self._fit() or rate
        self.speed = Speed(rate, self._lifetime, self._pass_time(rate))

    def observe_lifetime(self, seconds: float) -> None:
        """A request left its worker `seconds` after it was routed."""
        self._lifetimes_seen += 1
        weight = max(1 - self._decay, 1 / self._lifetimes_seen)
        self._lifetime += weight * (seconds - self._lifetime)
        self.speed = Speed(self.speed.prefill_tokens_per_s, self._lifetime, self.speed.pass_s)

    def _pass_time(self, rate: float) -> float:
        """T0 = mean TTFT - mean uncached tokens / R over the same observations (the fit's intercept)."""
        w, x, y = self._sums[:3]
        if w < 8:
            return self.speed.pass_s
        return min(MAX_PASS_S, max(0.0, (y - x / rate) / w))

    def _fit(self) -> float | None:
        w, x, y, xx, xy = self._sums
        if w < 8:
            return None
        var_x = xx / w - (x / w) ** 2
        if var_x < MIN_FIT_SPREAD_TOKENS**2:
            return None
        slope = (xy / w - (x / w) * (y / w)) / var_x  # seconds per uncached token
        if slope <= 0:
            return None
        return min(1e8, max(100.0, 1 / slope))
