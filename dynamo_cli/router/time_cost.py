"""The default KV routing cost: the time a choice costs, in seconds, so a cache hit and load trade evenly.

NOTE: Dynamo's `w * prefill_blocks + decode_blocks` adds prompt blocks to compute and KV blocks held,
two quantities whose exchange rate (w) depends on prompt length, cache size and load; with w = 1 the
holder of a 31-block prompt loses to a worker with one request fewer in flight (benchmarks/RESULTS.md).
Here every term is a time, so no weight is needed. For a request of `isl` tokens, `n` full blocks,
block size `bs`, and a candidate worker w with

    o  cached prefix blocks (indexer)          Q  prompt tokens queued for prefill there (in flight)
    a  prefix blocks already active there      A  unique active KV blocks of its requests in flight
    k  requests in flight there                K  blocks cached on device       C  KV capacity, blocks
    R  prefill speed, tokens/s                 L  mean time a request stays in flight, s

the cost of sending the request to w is

    cost = t_prefill + t_onboard + t_evict + t_memory                                  [seconds]
    t_prefill = (Q + U) / R,  U = max(0, isl - o * bs)
    t_onboard = sum over t in (host, disk) of o_t * B / bw_t + lat_t * [o_t > 0]
    t_evict   = max(0, (n - o_d) - max(0, C - K)) * bs / R
    t_memory  = max(0, A + k + (n - a) + 1 - C) * L / (A + k)

1. **t_prefill**: passes serve prefills first come, so the first token comes once w has computed the
   tokens queued before it and the request's own uncached ones. A hit of o blocks saves o * bs / R; a
   queue Q costs Q / R: the same unit, so the holder of a prompt keeps it until its queue is longer than
   the prompt, whatever the prompt's length.
   **t_onboard**: of the o cached blocks, o_t sit on a lower tier t (host memory, disk) and o_d on
   device; the engine copies the o_t blocks of B bytes back at bw_t instead of computing them (tiers.py
   has the bandwidths and latencies). Onboarded blocks take device blocks, hence n - o_d in t_evict.
2. **t_evict** (a second copy under cache pressure): the n - o new blocks go into the C - K free blocks;
   past those, the engine evicts as many least-recently-used blocks. Under pressure those belong to other
   prompts whose traffic this worker holds, so a later request recomputes them: bs / R each. Without
   pressure (K + n - o <= C) the term is 0, so a copy is free when the cache has room.
3. **t_memory** (queueing for KV): the request needs (n - a) blocks not active there, plus about one
   partial or output block per request (the `+ k` and `+ 1`). Past the capacity C the engine cannot
   admit it until enough blocks are freed; requests leave at k / L per second, each freeing (A + k) / k
   blocks on average, so v blocks take v * L / (A + k) seconds. This is the load term: it is 0 while
   the worker has KV to spare (the extra request only shares its passes) and grows fast beyond.

4. **Free copies** of a prompt in flight: a collision (a request finding every holder of its prompt busy)
   needs another request of that prompt in flight, i.e. the prompt active on some worker (a > 0 there).
   Then, if the copy evicts nothing and leaves the cache at most half full (roomy), its extra prefill is
   paid once per worker, while collisions recur for as long as the prompt is hot, so the tokens it
   computes beyond the best holder's are not counted: the copy costs what a hit costs. A prompt not in
   flight (a finished conversation's history) and any copy under cache pressure pay in full.
5. **Near-ties within one pass**: the router cannot see where in its current pass a worker is, which
   moves a first token by up to one pass. So candidates whose cost differs from the lowest only by their
   queue (equal own terms U / R, t_evict, t_memory), and by less than T0, a pass's fixed time (the
   intercept of the same TTFT fit that gives R; PRIOR_PASS_S until fitted), are dealt in rounds
   (`cost.Rounds`): one request to each per round, in candidate order. Rounds spread equal work evenly
   and keep a worker's arrivals a round apart, so passes batch several prefills; a difference in own
   work (a hit) is never a tie, however wide T0.
6. **A pass seen starting**: engines send a pass's KV events when it starts, so the KV event that stores
   the last prompt block of a request routed there says its prefill pass is running. A request sent to
   that worker now waits for the rest of that pass before its own: up to T0 more. So when every
   candidate has a prefill queued (no idle one to turn to), the near-ties of point 5 whose pass started
   less than T0 / 2 ago are charged the part of T0 still to run (`busy_s`), and of those not yet dealt
   this round the least queue plus that wins, instead of the next in order; a worker whose queued
   prefill has not started yet (its pass not begun, so the request can still join it) costs only its
   queue. The round still deals each worker once: a busy worker is dealt later in it, never another
   one twice. (A turn counter, as before, often fell next on the worker point 6 had just chosen: two
   arrivals there a few ms apart, the second missing the first's pass. With the KV events 2 ms late,
   rounds replay at rr / kv TTFT p90 1.01 where the counter gave 0.97; RESULTS.md.)

R is `--router-prefill-tps` or, unset, learned: the slope of time-to-first-token against uncached
prompt tokens (exponentially weighted least squares) over recent requests that were routed to a worker
with nothing queued for prefill (others' TTFT includes a queue that grows with their length: fitted
over every request, the mocker's speed came out at 15 k tokens/s, over these 38-40 k, against ~59 k
from its timing model at these lengths), `PRIOR_PREFILL_TPS` until the prompts seen differ enough in
length to fit it. L is the exponentially weighted mean time in
flight. C is each worker's published `total_blocks`, else the card's `total_kv_blocks` (0: unknown,
then t_evict and t_memory are 0).

**Prediction for the issue's cache-pressure regime** (40 prompts of 2,000 tokens + 100 unique, bs 64,
C = 512, 4 workers): isl = 2,100, n = 32, a hit has o = 31 (U = 116), a miss o = 0 (U = 2,100). Caches
are full (K ~ C), so a miss also evicts 32 - (C - K) ~ 31 blocks: a copy costs 2 * 1,984 = 3,968 tokens
of time against the holder, i.e. the holder loses only with two more full prompts queued, or when
it would run out of KV (each worker holds ~10 prompts = 310 blocks; with ~12 requests in flight,
A + k ~ 350 < 512). So requests stay with their prompt's holder: predicted hit rate ~ the reachable
one (block ceiling 31/32 = 96.9 %, token ceiling 1,984/2,100 = 94.5 %), >= 90 % of reachable, as
Dynamo's formula reached only with w = 4 (92.3 %, RESULTS.md). TTFT: near round-robin's capacity its
workers run out of KV and queue (p50 ratio rr/kv ~ 7 measured with w = 4 at 94 %); below ~80 % the
ratio is bounded by the mocker's pass floor (a hit still waits ~1.5 passes): ~1.4-1.7. In the default
cache (C = 16,384) neither t_evict nor t_memory ever fires and every worker holds every prompt after
warm-up, so the cost is (Q + 116) / R: predicted hit rate = round-robin's and TTFT ratio ~ 1.0. Open
loop measured so; closed loop did not, which points 4 and 5 fix:

**Prediction for the default cache, closed loop** (20 prompts, 16,384 blocks, 32 clients; the only cell
where points 1-3 lost to round-robin, measured TTFT p90 0.78 and p99 0.66). benchmarks/kv_routing_sim.py
replays this router over the mocker's own scheduler in virtual time. With points 1-3 it reproduced the
loss (rr / kv p50/p90/p99 1.02/0.75/0.63): 29 % of requests found every holder of their prompt mid-pass,
and most prompts had one or two holders, since a copy cost 1,984 tokens against a few hundred queued.
With 4 and 5 every prompt is copied to every worker early, as round-robin's caches are, and the cell
is level: 1.00/1.00/1.00, hit rate 94.5 % on both. Its other predictions (2 seeds, 30 s measured): default
cache open loop at 0.7 and 0.95 of capacity 1.00-1.01; cache pressure hit 94.1-94.5 %, rr / kv
1.13-1.53 closed, 1.38-3.95 at 0.7, 2.8-34.5 at 0.95 (18.4 p50 at p20). With the deployment's
delays (the replay's defaults: events at pass start, 0.2-0.3 ms per hop, 0.3 ms jitter) every cell
stays >= 1.00. In this cell T0 (~28 ms) exceeds any queue gap, so every decision is a 4-way tie
dealt in order: kv routes exactly as round-robin does (in the replay and in the explanations of a real
run: 1,343 of 1,343 steps), so kv's measured p99 there (0.57-0.68 of round-robin's) is not a choice this
cost makes that round-robin would not. The slow requests of that run were routed while every worker had
a prefill queued; those that joined one whose prefill had started (its KV event, sent at pass start)
waited that pass too: point 6 steers near-ties away from them (the replay: p99 at 12 clients per
worker 43 -> 34 ms, open loop 0.98-0.99; the real cell 0.93 -> 0.97). Part of the rest was the
frontend's garbage collector stalling dispatch, not this cost: benchmarks/RESULTS.md ("Default cache,
closed loop: the last gap").

**Measured** (one short cell on a shared machine, benchmarks/RESULTS.md; the full matrix is
benchmarks/kv_routing_matrix.py): 40 prompts, 512 blocks, 32 clients closed loop: hit rate 94.1-94.5 %
(token ceiling 94.5 %; Dynamo's w = 1 had 63-67 %), 1 of 487 decisions left the best cache, TTFT
round-robin / kv = 1.49 (p50), 1.40 (p90), 1.16 (p99), within the predicted pass-floor band. The whole
matrix on 2026-11-27 (RESULTS.md, "the closing measurements"): hit 94.4-94.5 % in every cache-pressure
cell (Dynamo's w = 1: 65.7 %); rr / kv p50 closed and at 0.7 x: 40 prompts 1.46-1.62, in the predicted
1.4-1.7, 20 prompts 1.14-1.30, below it (round-robin itself hits 68-71 % there); 9.2 and 13.5 at 0.95 x
(above: ~7 with w = 4 at 94 %); default cache p50 1.00-1.09, p90 0.98-1.00, and p99 0.80-1.13 against
1.05-1.34 for round-robin against itself (an A/A pair: this machine's noise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

import numpy as np

from dynamo_cli.router.tiers import AS_DEVICE, TierCosts

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
