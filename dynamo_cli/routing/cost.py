"""Worker selection: the KV router's cost per candidate and the choice among them, pure and seeded.

Two costs, lower wins (`--router-cost`):

- `time` (default): seconds of prefill wait, onboarding, evictions and KV queueing (time_cost.py has the
  derivation; a hit on host or disk costs its onboard time, tiers.py).
- `dynamo`: `logit = w * prefill_blocks + decode_blocks` (Dynamo >= 0.4, reference dynamo.md 4.5), with
  `prefill_blocks = (active_prefill_tokens + max(0, isl - overlap * block_size)) / block_size`, the prompt
  tokens this worker would still compute behind the prefills queued there, and `decode_blocks =
  active_blocks + (num_blocks - active_overlap_blocks)`, its unique active KV blocks once this request's
  join them. A hit on host or disk counts as `w_t` of a device hit in `overlap` (tiers.py).

Temperature 0 takes the argmin. With `time`, costs within one pass's fixed time (T0, learned) of the
lowest are ties, dealt in rounds (time_cost.py, point 5); with `dynamo`, ties go to the smaller cache, then
at random. Temperature T > 0 samples `softmax(-(logit / (max - min)) /
T)`. A hot-spot guard overrides both when the candidates' active blocks are badly imbalanced: it picks by load alone.

NOTE: the candidates are columns (`Candidates`, one list per quantity). Below `VECTOR_MIN` candidates the
cost is evaluated per candidate on Python numbers; from there on, on numpy arrays, once per quantity: the
same `time_terms`, written once for both, and a test holds the two to the last bit. numpy costs ~1 us per
call whatever the length, so on a handful of workers the calls cost more than the arithmetic: a 4-worker
decision spent ~80 of its ~160 us in numpy calls on 4-element arrays. The choice among the costs
(argmin, near-ties, margin) runs on lists at any size. Per-candidate objects (`CandidateCost`) are built
only for the explanation, and only for the `EXPLAIN_LIMIT` best.
"""

from __future__ import annotations

import enum
import functools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynamo_cli.config import KvRouterConfig
from dynamo_cli.routing.target import Target
from dynamo_cli.routing.tier_costs import AS_DEVICE, TierCosts
from dynamo_cli.routing.time_cost import Across, Speed, SpeedEstimator, TimeTerms, time_terms

TIE_TOLERANCE = 1e-9
"""Costs closer than this are a tie (blocks for `dynamo`, seconds for `time`)."""
EXPLAIN_LIMIT = 16
"""Candidates listed in an explanation at most (the lowest-cost ones, the chosen among them)."""
VECTOR_MIN = 12
"""From this many candidates on, the cost is evaluated on numpy arrays; below, per candidate. The two take the
same time at 12 (a cost table of 4 candidates: 35 us per candidate, 84 us on arrays; of 32: 151 and 66 us)."""
DEFAULT_SPEED = SpeedEstimator().speed


@dataclass(frozen=True, slots=True)
class CostConfig:
    """What worker selection reads: a router config's knobs (`KvRouterConfig`: the cost, its weight, the
    temperature, the hot-spot guard), its block size resolved, and what a lower tier's hit costs."""

    block_size: int
    """Tokens per KV block (the router config's, or its model card's)."""
    router: KvRouterConfig
    tiers: TierCosts = AS_DEVICE
    """What a host or disk hit costs (onboard time) or counts for (weight); default: as a device hit."""


@dataclass(frozen=True, slots=True)
class CandidateLoad:
    """What the router knows about one candidate for one request (one row of `Candidates`)."""

    target: Target
    overlap_blocks: int = 0
    """Blocks of the request's prefix the worker caches on any tier (indexer)."""
    active_prefill_tokens: int = 0
    """Prompt tokens routed to the worker whose first token has not come back."""
    active_blocks: int = 0
    """Unique KV blocks of the requests in flight on the worker."""
    active_overlap_blocks: int = 0
    """Blocks of the request's prefix already active on the worker (shared with an in-flight prompt)."""
    cached_blocks: int = 0
    """All blocks the worker caches: the tie-breaker, smaller wins."""
    num_requests: int = 0
    """Requests in flight on the worker."""
    capacity_blocks: int = 0
    """The worker's KV capacity in blocks (0 = unknown)."""
    host_blocks: int = 0
    """Of `overlap_blocks`, those held in host memory and not on device."""
    disk_blocks: int = 0
    """Of `overlap_blocks`, those held only on disk."""


_COLUMNS = (
    "overlap_blocks",
    "active_prefill_tokens",
    "active_blocks",
    "active_overlap_blocks",
    "cached_blocks",
    "num_requests",
    "capacity_blocks",
    "host_blocks",
    "disk_blocks",
)


@dataclass(frozen=True, slots=True)
class Candidates:
    """Every candidate of one decision as columns: entry i of each list is `targets[i]`'s."""

    targets: Sequence[Target]
    overlap_blocks: Sequence[int]
    active_prefill_tokens: Sequence[int]
    active_blocks: Sequence[int]
    active_overlap_blocks: Sequence[int]
    cached_blocks: Sequence[int]
    num_requests: Sequence[int]
    capacity_blocks: Sequence[int]
    host_blocks: Sequence[int]
    disk_blocks: Sequence[int]
    tiered: bool = False
    """False: every hit is on device (host and disk are zeros), so the cost skips the tier terms."""
    pass_elapsed_s: Sequence[float] | None = None
    """Seconds since a prefill pass the router saw start (KV events) on each candidate, inf: none running;
    None: not known (no KV events). The time cost charges the rest of that pass's fixed time."""
    lora_load_s: Sequence[float] | None = None
    """Seconds each candidate would spend loading the request's LoRA adapter first (0 where it is loaded);
    None: a base-model request. Charged like an onboard: as is (`time`), as prefill blocks (`dynamo`)."""

    @classmethod
    def of(
        cls,
        targets: Sequence[Target],
        *columns: Sequence[int],
        pass_elapsed_s: Sequence[float] | None = None,
        lora_load_s: Sequence[float] | None = None,
    ) -> Candidates:
        """From one list per field, in field order after `targets`; missing tier columns are zeros."""
        tiered = len(columns) == len(_COLUMNS)
        full = [*columns, *[[0] * len(targets)] * (len(_COLUMNS) - len(columns))]
        overlap, prefill, active, active_overlap, cached, requests, capacity, host, disk = full
        return cls(
            targets,
            overlap,
            prefill,
            active,
            active_overlap,
            cached,
            requests,
            capacity,
            host,
            disk,
            tiered,
            pass_elapsed_s,
            lora_load_s,
        )

    @classmethod
    def from_loads(cls, loads: Sequence[CandidateLoad]) -> Candidates:
        """From one `CandidateLoad` per candidate."""
        return cls.of([load.target for load in loads], *([getattr(x, n) for x in loads] for n in _COLUMNS))


@dataclass(frozen=True, slots=True)
class CandidateCost:
    """One candidate's terms and logit, as logged and explained."""

    target: Target
    overlap_blocks: int
    prefill_blocks: float
    decode_blocks: int
    logit: float
    active_blocks: int
    cached_blocks: int
    times: dict[str, float] = field(default_factory=dict)
    """`time` cost only: prefill_s, onboard_s, evict_s, memory_s (their sum is the logit), and queue_s, the
    part of prefill_s spent behind prefills queued there."""
    hits: dict[str, int] = field(default_factory=dict)
    """The cached prefix per tier: device, host, disk (the fastest tier holding each block)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view."""
        view = {
            "worker_id": self.target.worker,
            "dp_rank": self.target.rank,
            "overlap_blocks": self.overlap_blocks,
            "hits": self.hits,
            "prefill_blocks": self.prefill_blocks,
            "decode_blocks": self.decode_blocks,
            "logit": self.logit,
            "active_blocks": self.active_blocks,
            "cached_blocks": self.cached_blocks,
        }
        return {**view, **self.times}


@dataclass(frozen=True, slots=True)
class CostTable:
    """The candidates of one decision and their costs, as columns."""

    candidates: Candidates
    logits: Sequence[float]
    times: dict[str, Sequence[float]]
    """`time` cost only: each term's column (`CandidateCost.times`)."""
    isl: int
    num_blocks: int
    block_size: int
    prefill_blocks: Sequence[float] | None = None
    """`dynamo` cost only (its terms); None: computed per explained row, from the cached prefix."""
    decode_blocks: Sequence[int] | None = None

    def row(self, index: int) -> CandidateCost:
        """Candidate `index`'s terms."""
        return self.rows([index])[0]

    def rows(self, indices: Sequence[int]) -> list[CandidateCost]:
        """The terms of the candidates at `indices`."""
        c, bs, rows = self.candidates, self.block_size, []
        for i in indices:
            overlap, host, disk = c.overlap_blocks[i], c.host_blocks[i], c.disk_blocks[i]
            prefill = (
                _prefill_blocks(c.active_prefill_tokens[i], overlap, self.isl, bs)
                if self.prefill_blocks is None
                else self.prefill_blocks[i]
            )
            decode = (
                _decode_blocks(c.active_blocks[i], c.active_overlap_blocks[i], self.num_blocks)
                if self.decode_blocks is None
                else self.decode_blocks[i]
            )
            rows.append(
                CandidateCost(
                    c.targets[i],
                    overlap,
                    prefill,
                    decode,
                    self.logits[i],
                    c.active_blocks[i],
                    c.cached_blocks[i],
                    {name: column[i] for name, column in self.times.items()},
                    {"device": overlap - host - disk, "host": host, "disk": disk},
                )
            )
        return rows


class Reason(enum.Enum):
    """Why the chosen worker won."""

    ONLY = "only"  # a single candidate
    ARGMIN = "argmin"  # lowest logit, alone
    TIE_TURN = "tie-in-turn"  # (time) others differ from the lowest only by a queue shorter than one pass: rounds
    TIE_CACHE = "tie-smaller-cache"  # lowest logit shared; the smallest cache broke the tie
    TIE_RANDOM = "tie-random"  # lowest logit and cache size shared; chosen at random
    SOFTMAX = "softmax"  # sampled with temperature > 0
    HOT_SPOT = "hot-spot"  # load imbalance over the thresholds: least loaded, cache ignored
    PINNED = "pinned"  # the caller named the worker


@dataclass(frozen=True, slots=True)
class Selection:
    """A decision and its explanation."""

    target: Target
    reason: Reason
    table: CostTable
    index: int
    """The chosen candidate's row."""
    margin: float | None
    """The runner-up's ranking score minus the chosen one's (None with a single candidate)."""
    ranked_by: str = "logit"
    """"logit", or "load" (active_prefill_tokens / block_size + active_blocks) under the hot-spot guard."""

    @property
    def worker_id(self) -> int:
        """The chosen target's worker."""
        return self.target.worker

    @property
    def candidates(self) -> tuple[CandidateCost, ...]:
        """Every candidate's terms, in the order given."""
        return tuple(self.table.rows(range(len(self.table.candidates.targets))))

    @property
    def overlap_blocks(self) -> int:
        """The chosen candidate's cached prefix, in blocks (read from its column: no row is built)."""
        return self.table.candidates.overlap_blocks[self.index]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view for the `x-dyn-explain-route` response and logs (up to EXPLAIN_LIMIT rows)."""
        logits = self.table.logits
        rows: Sequence[int] = range(len(logits))
        if len(logits) > EXPLAIN_LIMIT:
            best = set(np.argpartition(_column(logits, np.float64), EXPLAIN_LIMIT - 1)[:EXPLAIN_LIMIT].tolist())
            if self.index not in best:  # sampled or pinned: the chosen one replaces the costliest listed
                best.remove(max(best, key=logits.__getitem__))
                best.add(self.index)
            rows = sorted(best)
        return {
            "worker_id": self.target.worker,
            "dp_rank": self.target.rank,
            "reason": self.reason.value,
            "ranked_by": self.ranked_by,
            "margin": self.margin,
            "num_candidates": len(logits),
            "candidates": [row.to_dict() for row in self.table.rows(rows)],
        }


def cost_table(c: Candidates, isl: int, num_blocks: int, config: CostConfig, speed: Speed) -> CostTable:
    """Every candidate's cost for a request of `isl` tokens and `num_blocks` full blocks."""
    bs = config.block_size
    if config.router.cost == "dynamo":
        overlap: Sequence[float] = c.overlap_blocks
        if c.tiered:  # a lower tier's hit counts as its weight of a device hit
            h, d = 1 - config.tiers.host_weight, 1 - config.tiers.disk_weight
            overlap = [o - x * h - y * d for o, x, y in zip(overlap, c.host_blocks, c.disk_blocks, strict=True)]
        prefill = [_prefill_blocks(q, o, isl, bs) for q, o in zip(c.active_prefill_tokens, overlap, strict=True)]
        decode = [
            _decode_blocks(a, x, num_blocks) for a, x in zip(c.active_blocks, c.active_overlap_blocks, strict=True)
        ]
        if c.lora_load_s is not None:  # the load's seconds as the prompt blocks computed meanwhile
            per_s = speed.prefill_tokens_per_s / bs
            prefill = [p + s * per_s for p, s in zip(prefill, c.lora_load_s, strict=True)]
        w = config.router.overlap_score_weight
        logits = [w * p + d for p, d in zip(prefill, decode, strict=True)]
        return CostTable(c, logits, {}, isl, num_blocks, bs, prefill, decode)
    across = Across(max(c.overlap_blocks), max(c.active_overlap_blocks) > 0, min(c.active_prefill_tokens) > 0)
    evaluate = _time_columns if len(c.targets) >= VECTOR_MIN else _time_rows
    logits, times = evaluate(c, isl, num_blocks, config, speed, across)
    if c.lora_load_s is not None:
        logits = [logit + s for logit, s in zip(logits, c.lora_load_s, strict=True)]
        times = {**times, "lora_load_s": list(c.lora_load_s)}
    return CostTable(c, logits, times, isl, num_blocks, bs)


def _prefill_blocks(queued: int, overlap: float, isl: int, block_size: int) -> float:
    """The prompt blocks a worker would still compute, its queue's included (`dynamo`'s prefill term)."""
    return (queued + max(0, isl - overlap * block_size)) / block_size


def _decode_blocks(active: int, active_overlap: int, num_blocks: int) -> int:
    """A worker's unique active KV blocks once the request's join them (`dynamo`'s decode term)."""
    return active + max(0, num_blocks - active_overlap)


TimeColumns = tuple[list[float], dict[str, Sequence[float]]]
"""The logits and each time term's column."""


def _time_rows(
    c: Candidates, isl: int, num_blocks: int, config: CostConfig, speed: Speed, across: Across
) -> TimeColumns:
    """The time cost evaluated per candidate, on numbers (few candidates)."""
    logits, rows = [], []
    for i in range(len(c.targets)):
        t = _time_terms(c, isl, num_blocks, config, speed, across, functools.partial(_entry, i))
        logits.append(t.total)
        rows.append(t)
    columns = zip(TimeTerms._fields, zip(*rows, strict=True), strict=True)
    known = c.pass_elapsed_s is not None
    return logits, {name: list(column) for name, column in columns if known or name != "busy_s"}


def _time_columns(
    c: Candidates, isl: int, num_blocks: int, config: CostConfig, speed: Speed, across: Across
) -> TimeColumns:
    """The time cost evaluated once per term, on numpy arrays (many candidates)."""
    t = _time_terms(c, isl, num_blocks, config, speed, across, _column)
    return t.total.tolist(), {name: v.tolist() for name, v in zip(TimeTerms._fields, t, strict=True) if v is not None}


def _time_terms(
    c: Candidates,
    isl: int,
    num_blocks: int,
    config: CostConfig,
    speed: Speed,
    across: Across,
    pick: Callable[[Sequence[float], type], Any],
) -> TimeTerms[Any]:
    """`time_terms` over the columns of `c` as `pick(column, dtype)` gives them: one candidate's numbers or
    every candidate's array."""
    elapsed, tiered = c.pass_elapsed_s, c.tiered
    return time_terms(
        isl=isl,
        num_blocks=num_blocks,
        block_size=config.block_size,
        overlap=pick(c.overlap_blocks, np.int64),
        queued_prefill=pick(c.active_prefill_tokens, np.int64),
        active_blocks=pick(c.active_blocks, np.int64),
        active_overlap=pick(c.active_overlap_blocks, np.int64),
        in_flight=pick(c.num_requests, np.int64),
        cached=pick(c.cached_blocks, np.int64),
        capacity=pick(c.capacity_blocks, np.int64),
        speed=speed,
        across=across,
        tiers=config.tiers,
        host=pick(c.host_blocks, np.int64) if tiered else None,
        disk=pick(c.disk_blocks, np.int64) if tiered else None,
        pass_elapsed=None if elapsed is None else pick(elapsed, np.float64),
    )


def _entry(index: int, values: Sequence[float], _dtype: type) -> float:
    """Candidate `index`'s number of a column (`_time_terms`' pick per candidate)."""
    return values[index]


def _column(values: Sequence[float], dtype: type) -> np.ndarray:
    """A column as an array (np.fromiter: half np.asarray's time on a list of Python numbers)."""
    return np.fromiter(values, dtype=dtype, count=len(values))


def candidate_cost(load: CandidateLoad, isl: int, num_blocks: int, config: CostConfig) -> CandidateCost:
    """The cost terms of one candidate for a request of `isl` tokens and `num_blocks` full blocks."""
    return cost_table(Candidates.from_loads([load]), isl, num_blocks, config, DEFAULT_SPEED).row(0)


def is_hot_spot(active_blocks: Sequence[int], config: CostConfig) -> bool:
    """True when max - min active blocks reaches both the absolute and the relative threshold."""
    if not config.router.hot_spot_guard or len(active_blocks) < 2:
        return False
    high, low = max(active_blocks), min(active_blocks)
    spread = high - low
    return spread >= config.router.hot_spot_min_blocks and spread >= config.router.hot_spot_ratio * high


def select(
    c: Candidates,
    isl: int,
    num_blocks: int,
    config: CostConfig,
    rng: random.Random,
    speed: Speed = DEFAULT_SPEED,
    rounds: Rounds | None = None,
) -> Selection:
    """Choose among the candidates `c` (never empty) for a request of `isl` tokens, `num_blocks` blocks;
    `rounds` is the caller's dealer of near-ties (time cost; None: a fresh one, which takes the first)."""
    table = cost_table(c, isl, num_blocks, config, speed)
    if len(c.targets) == 1:
        return Selection(c.targets[0], Reason.ONLY, table, 0, None)
    if is_hot_spot(c.active_blocks, config):
        bs = config.block_size
        scores = [a + q / bs for a, q in zip(c.active_blocks, c.active_prefill_tokens, strict=True)]
        index, _ = _argmin(scores, [c.cached_blocks], rng)
        return Selection(c.targets[index], Reason.HOT_SPOT, table, index, _margin(scores, index), "load")
    logits = table.logits
    if config.router.temperature > 0:
        index, reason = softmax_sample(logits, config.router.temperature, rng), Reason.SOFTMAX
    elif config.router.cost == "time":
        queue, busy = table.times["queue_s"], table.times.get("busy_s")
        index, reason = (rounds or Rounds()).deal(c.targets, logits, queue, speed.pass_s, busy)
    else:
        index, reason = _argmin(logits, [c.cached_blocks], rng)
    return Selection(c.targets[index], reason, table, index, _margin(logits, index))


def select_worker(
    loads: Sequence[CandidateLoad], isl: int, num_blocks: int, config: CostConfig, rng: random.Random
) -> Selection:
    """`select` over one `CandidateLoad` per candidate."""
    return select(Candidates.from_loads(loads), isl, num_blocks, config, rng)


def explain_pinned(
    worker_id: int,
    loads: Sequence[CandidateLoad] | Candidates,
    isl: int,
    num_blocks: int,
    config: CostConfig,
    speed: Speed = DEFAULT_SPEED,
) -> Selection:
    """The explanation of a pinned request: the candidates' costs, the caller's worker chosen (its cheapest rank)."""
    c = loads if isinstance(loads, Candidates) else Candidates.from_loads(loads)
    table = cost_table(c, isl, num_blocks, config, speed)
    logits = table.logits
    index = min((i for i, t in enumerate(c.targets) if t.worker == worker_id), key=logits.__getitem__)
    return Selection(c.targets[index], Reason.PINNED, table, index, _margin(logits, index))


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


_TIE_REASONS = {1: (Reason.TIE_CACHE,)}


class Rounds:
    """Deals near-ties in rounds (time_cost.py, points 5 and 6): within a round each worker is dealt at most
    one request, so arrivals at a worker stay a round apart even when point 6 changes the order."""

    __slots__ = ("_dealt",)

    def __init__(self) -> None:
        self._dealt: set[Target] = set()
        """Targets dealt a near-tie in the current round."""

    def deal(
        self,
        targets: Sequence[Target],
        scores: Sequence[float],
        queue: Sequence[float],
        band: float,
        busy: Sequence[float] | None,
    ) -> tuple[int, Reason]:
        """The lowest score; the candidates within `band` of it that differ from it only in their `queue`
        (the same score less queue: own cost) are near-ties: the first not dealt this round (in candidate
        order) wins, or, when some of those have `busy` time left of a prefill pass seen running, the least
        score plus that time. A round ends when every near-tie has been dealt."""
        low = min(scores)
        best = scores.index(low)
        mine, band = low - queue[best], max(band, TIE_TOLERANCE)
        near = [i for i, score in enumerate(scores) if score - low <= band]
        tied = [i for i in near if abs(scores[i] - queue[i] - mine) <= TIE_TOLERANCE]
        if len(tied) == 1:
            return tied[0], Reason.ARGMIN
        dealt = self._dealt
        fresh = [i for i in tied if targets[i] not in dealt]
        if not fresh:
            dealt.clear()
            fresh = tied
        index, reason = fresh[0], Reason.TIE_TURN
        if busy is not None and any(busy[i] for i in fresh):  # busy is never negative
            index, reason = min(fresh, key=lambda i: scores[i] + busy[i]), Reason.ARGMIN
        dealt.add(targets[index])
        return index, reason


def _argmin(scores: Sequence[float], tie_breaks: list[Sequence[int]], rng: random.Random) -> tuple[int, Reason]:
    """The lowest score; ties broken by each of `tie_breaks` in turn (smaller wins), then at random."""
    low = min(scores)
    tied = [i for i, score in enumerate(scores) if score - low <= TIE_TOLERANCE]
    if len(tied) == 1:
        return tied[0], Reason.ARGMIN
    for key, reason in zip(tie_breaks, _TIE_REASONS[len(tie_breaks)], strict=True):
        least = min(key[i] for i in tied)
        tied = [i for i in tied if key[i] == least]
        if len(tied) == 1:
            return tied[0], reason
    return rng.choice(tied), Reason.TIE_RANDOM


def _margin(scores: Sequence[float], index: int) -> float | None:
    """The runner-up's score minus the chosen one's (None with a single candidate)."""
    if len(scores) < 2:
        return None
    mine, lowest = scores[index], min(scores)
    if mine != lowest:
        return lowest - mine
    return min(min(scores[:index], default=math.inf), min(scores[index + 1 :], default=math.inf)) - mine
