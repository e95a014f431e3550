"""Worker selection: the KV router's cost per candidate and the choice among them, pure and seeded.

`logit = w * prefill_blocks + decode_blocks`, lower wins (Dynamo >= 0.4, reference dynamo.md 4.5):

- `prefill_blocks = (active_prefill_tokens + max(0, isl - overlap * block_size)) / block_size`, a
  fraction: the prompt tokens this worker would still compute, behind the prefills already queued there.
- `decode_blocks = active_blocks + (num_blocks - active_overlap_blocks)`: the worker's unique active KV
  blocks once this request's blocks join them (blocks already active for another request count once).

Temperature 0 takes the argmin, ties going to the worker with the smaller cache, then at random;
temperature T > 0 samples `softmax(-(logit / (max - min)) / T)`. A hot-spot guard overrides both when
the candidates' active blocks are badly imbalanced: it picks by load alone, ignoring the cache.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TIE_TOLERANCE = 1e-9
"""Logits closer than this are a tie."""


@dataclass(frozen=True, slots=True)
class CostConfig:
    """The knobs of worker selection."""

    block_size: int
    """Tokens per KV block."""
    overlap_score_weight: float = 1.0
    """w: weight of prefill work against decode load (0 = pure load balancing)."""
    temperature: float = 0.0
    """0 = deterministic argmin; > 0 = softmax sampling over normalised logits."""
    hot_spot_guard: bool = True
    """Pick by load alone when active blocks are badly imbalanced (both thresholds reached)."""
    hot_spot_min_blocks: int = 512
    """Absolute threshold: max - min active blocks across the candidates."""
    hot_spot_ratio: float = 0.5
    """Relative threshold: (max - min) / max active blocks."""


@dataclass(frozen=True, slots=True)
class CandidateLoad:
    """What the router knows about one candidate for one request."""

    worker_id: int
    overlap_blocks: int = 0
    """Blocks of the request's prefix the worker caches (indexer)."""
    active_prefill_tokens: int = 0
    """Prompt tokens routed to the worker whose first token has not come back."""
    active_blocks: int = 0
    """Unique KV blocks of the requests in flight on the worker."""
    active_overlap_blocks: int = 0
    """Blocks of the request's prefix already active on the worker (shared with an in-flight prompt)."""
    cached_blocks: int = 0
    """All blocks the worker caches: the tie-breaker, smaller wins."""


@dataclass(frozen=True, slots=True)
class CandidateCost:
    """One candidate's terms and logit, as logged and explained."""

    worker_id: int
    overlap_blocks: int
    prefill_blocks: float
    decode_blocks: int
    logit: float
    active_blocks: int
    cached_blocks: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view."""
        return {
            "worker_id": self.worker_id,
            "overlap_blocks": self.overlap_blocks,
            "prefill_blocks": self.prefill_blocks,
            "decode_blocks": self.decode_blocks,
            "logit": self.logit,
            "active_blocks": self.active_blocks,
            "cached_blocks": self.cached_blocks,
        }


class Reason(enum.Enum):
    """Why the chosen worker won."""

    ONLY = "only"  # a single candidate
    ARGMIN = "argmin"  # lowest logit, alone
    TIE_CACHE = "tie-smaller-cache"  # lowest logit shared; the smallest cache broke the tie
    TIE_RANDOM = "tie-random"  # lowest logit and cache size shared; chosen at random
    SOFTMAX = "softmax"  # sampled with temperature > 0
    HOT_SPOT = "hot-spot"  # load imbalance over the thresholds: least loaded, cache ignored
    PINNED = "pinned"  # the caller named the worker


@dataclass(frozen=True, slots=True)
class Selection:
    """A decision and its explanation."""

    worker_id: int
    reason: Reason
    candidates: tuple[CandidateCost, ...]
    margin: float | None
    """The runner-up's ranking score minus the chosen one's (None with a single candidate)."""
    ranked_by: str = "logit"
    """"logit", or "load" (active_prefill_tokens / block_size + active_blocks) under the hot-spot guard."""

    @property
    def chosen(self) -> CandidateCost:
        """The chosen candidate's terms."""
        return next(c for c in self.candidates if c.worker_id == self.worker_id)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view for the `x-dyn-explain-route` response and logs."""
        return {
            "worker_id": self.worker_id,
            "reason": self.reason.value,
            "ranked_by": self.ranked_by,
            "margin": self.margin,
            "candidates": [c.to_dict() for c in self.candidates],
        }


def candidate_cost(load: CandidateLoad, isl: int, num_blocks: int, config: CostConfig) -> CandidateCost:
    """The cost terms of one candidate for a request of `isl` tokens and `num_blocks` full blocks."""
    uncached_tokens = max(0, isl - load.overlap_blocks * config.block_size)
    prefill_blocks = (load.active_prefill_tokens + uncached_tokens) / config.block_size
    new_blocks = max(0, num_blocks - load.active_overlap_blocks)
    decode_blocks = load.active_blocks + new_blocks
    return CandidateCost(
        worker_id=load.worker_id,
        overlap_blocks=load.overlap_blocks,
        prefill_blocks=prefill_blocks,
        decode_blocks=decode_blocks,
        logit=config.overlap_score_weight * prefill_blocks + decode_blocks,
        active_blocks=load.active_blocks,
        cached_blocks=load.cached_blocks,
    )


def is_hot_spot(active_blocks: Sequence[int], config: CostConfig) -> bool:
    """True when max - min active blocks reaches both the absolute and the relative threshold."""
    if not config.hot_spot_guard or len(active_blocks) < 2:
        return False
    high, low = max(active_blocks), min(active_blocks)
    spread = high - low
    return spread >= config.hot_spot_min_blocks and spread >= config.hot_spot_ratio * high


def select_worker(
    loads: Sequence[CandidateLoad],
    isl: int,
    num_blocks: int,
    config: CostConfig,
    rng: random.Random,
) -> Selection:
    """Choose among `loads` (never empty) for a request of `isl` tokens and `num_blocks` full blocks."""
    costs = tuple(candidate_cost(load, isl, num_blocks, config) for load in loads)
    if len(costs) == 1:
        return Selection(costs[0].worker_id, Reason.ONLY, costs, None)
    if is_hot_spot([c.active_blocks for c in costs], config):
        scores = [c.active_blocks + _prefill_load(load, config) for c, load in zip(costs, loads, strict=True)]
        index, _ = _argmin(scores, costs, rng)
        return Selection(costs[index].worker_id, Reason.HOT_SPOT, costs, _margin(scores, index), "load")
    logits = [c.logit for c in costs]
    if config.temperature > 0:
        index, reason = softmax_sample(logits, config.temperature, rng), Reason.SOFTMAX
    else:
        index, reason = _argmin(logits, costs, rng)
    return Selection(costs[index].worker_id, reason, costs, _margin(logits, index))


def explain_pinned(
    worker_id: int, loads: Sequence[CandidateLoad], isl: int, num_blocks: int, config: CostConfig
) -> Selection:
    """The explanation of a pinned request: the candidates' costs, the caller's worker chosen."""
    costs = tuple(candidate_cost(load, isl, num_blocks, config) for load in loads)
    logits = [c.logit for c in costs]
    index = next(i for i, c in enumerate(costs) if c.worker_id == worker_id)
    return Selection(worker_id, Reason.PINNED, costs, _margin(logits, index))


def softmax_sample(logits: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Index drawn with p_i = softmax(-(logit_i / (max - min)) / T); uniform when all logits are equal."""
    high, low = max(logits), min(logits)
    spread = high - low
    if spread <= TIE_TOLERANCE:
        return rng.randrange(len(logits))
    scaled = [-(logit / spread) / temperature for logit in logits]
    top = max(scaled)
    weights = [math.exp(s - top) for s in scaled]
    draw = rng.random() * sum(weights)
    cumulative = 0.0
    for index, weight in enumerate(weights):
        cumulative += weight
        if draw < cumulative:
            return index
    return len(weights) - 1


def _prefill_load(load: CandidateLoad, config: CostConfig) -> float:
    return load.active_prefill_tokens / config.block_size


def _argmin(
    scores: Sequence[float], costs: Sequence[CandidateCost], rng: random.Random
) -> tuple[int, Reason]:
    best = min(scores)
    tied = [i for i, s in enumerate(scores) if s - best <= TIE_TOLERANCE]
    if len(tied) == 1:
        return tied[0], Reason.ARGMIN
    smallest = min(costs[i].cached_blocks for i in tied)
    fewest = [i for i in tied if costs[i].cached_blocks == smallest]
    if len(fewest) == 1:
        return fewest[0], Reason.TIE_CACHE
    return rng.choice(fewest), Reason.TIE_RANDOM


def _margin(scores: Sequence[float], index: int) -> float | None:
    others = [s for i, s in enumerate(scores) if i != index]
    if not others:
        return None
    return min(others) - scores[index]
