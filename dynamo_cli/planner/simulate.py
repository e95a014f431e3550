"""`dyn plan simulate`: a trace through N simulated workers in virtual time, static or planner-driven.

NOTE: each worker is R data-parallel ranks (`--ranks-per-worker`, default 1), each the mocker's scheduler reduced
to its events (simworker.py). Requests are routed round-robin to the live workers (dyn serve's default) and, within
a worker, to its ranks in turn: round-robin over every (worker, rank) target. A worker is advanced only when it
receives a request or at a planner tick, and a worker the planner removes stops receiving requests and counts its
worker-seconds until its last stream ends. The planner is the real one (`Planner.plan_once` and `check_burst`) fed
with the frontend counters the simulated requests produce and the workers' ranks as their cards would say them; the
oracle (oracle.py) applies the pools it scheduled ahead, one step per load interval.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from dynamo_cli.errors import ConfigError
from dynamo_cli.planner.connectors import ScaleTarget
from dynamo_cli.planner.observe import PoolLoad, Snapshot, WorkerCount
from dynamo_cli.planner.oracle import OracleStep, RateAt, oracle_needs, oracle_schedule, trace_rates
from dynamo_cli.planner.planner import Planner, PlannerConfig, Reporter
from dynamo_cli.planner.profile import Profile
from dynamo_cli.planner.simworker import SimRank, SimRequest, SimWorker, Stats
from dynamo_cli.planner.sizing import RanksPerWorker


@dataclass(frozen=True, slots=True)
class SimResult:
    """One policy's outcome on a trace."""

    policy: str
    """`static N` or `planner`."""
    num_requests: int
    """Requests finished."""
    attainment: float
    """Fraction meeting both the TTFT and the ITL target."""
    worker_seconds: float
    """Sum over workers of the time each was up."""
    max_workers: int
    """Most workers up at once."""
    ranks_per_worker: int = 1
    """Data-parallel ranks of each worker."""


class _Trace(msgspec.Struct):
    timestamp: float = 0.0
    input_length: int = 0
    output_length: int = 0


def load_trace(path: str | Path) -> list[SimRequest]:
    """A Mooncake JSONL trace (timestamp in ms, input_length, output_length), as `dyn bench --trace` reads."""
    try:
        entries = [msgspec.json.decode(line, type=_Trace) for line in Path(path).read_bytes().splitlines() if line]
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"trace '{path}' cannot be read: {exc}") from exc
    origin = min((e.timestamp for e in entries), default=0.0)
    return sorted(
        (SimRequest((e.timestamp - origin) / 1000, max(e.input_length, 1), max(e.output_length, 1)) for e in entries),
        key=lambda r: r.arrival_s,
    )


def _curve_points(spec: str) -> list[tuple[float, float]]:
    try:
        return [(float(t), float(r)) for t, r in (part.split(":") for part in spec.split(","))]
    except ValueError:
        raise ConfigError(f"--rate-curve '{spec}' must look like 0:1,300:6,600:1,900:0") from None


def rate_curve(spec: str, isl: int, osl: int, seed: int = 0, linear: bool = False) -> list[SimRequest]:
    """Poisson arrivals from `T:RATE,T:RATE,...,T_END:0` (seconds: requests/s from T until the next T), or with
    `linear` from a rate moving in a straight line from each point to the next (a ramp; the last point's rate
    is the curve's end). A linear segment is drawn at its higher end's rate and thinned to the line."""
    points, rng, requests = _curve_points(spec), random.Random(seed), []
    for (start, rate), (end, next_rate) in zip(points, points[1:], strict=False):
        top, t = max(rate, next_rate) if linear else rate, start
        while top > 0:
            t += rng.expovariate(top)
            if t >= end:
                break
            if not linear or rng.random() * top < rate + (next_rate - rate) * (t - start) / (end - start):
                requests.append(SimRequest(t, isl, osl))
    return requests


def curve_rates(spec: str, isl: int, osl: int, linear: bool = False) -> RateAt:
    """The load `rate_curve` draws its arrivals from, as the oracle reads it."""
    points = _curve_points(spec)
    starts = [t for t, _ in points]

    def rate_at(t: float) -> tuple[float, float, float]:
        i = bisect.bisect_right(starts, t) - 1  # the segment [points[i], points[i + 1]) holding t
        if i < 0 or i + 1 >= len(points):
            return 0.0, isl, osl
        (start, rate), (end, next_rate) = points[i], points[i + 1]
        return (rate + (next_rate - rate) * (t - start) / (end - start) if linear else rate), isl, osl

    return rate_at


@dataclass(slots=True)
class SimCluster:
    """Workers up, starting and draining; round-robin routing over the live ones, and over each one's ranks."""

    kv_tokens: int
    """Of each rank."""
    stats: Stats
    startup_s: float = 0.0
    role: str = "both"
    """Of its workers (SimRank.role)."""
    ranks_per_worker: int = 1
    """Data-parallel ranks of each worker, each a scheduler with a KV cache of `kv_tokens`."""
    handoffs: list[tuple[float, SimRequest]] = field(default_factory=list)
    """prefill: every worker's prompts done, (first token time, request), shared so a retired worker's count."""
    live: list[SimWorker] = field(default_factory=list)
    starting: list[SimWorker] = field(default_factory=list)
    draining: list[SimWorker] = field(default_factory=list)
    done: list[tuple[float, float]] = field(default_factory=list)
    """(allocated, stopped) of every worker gone."""
    allocated: dict[int, float] = field(default_factory=dict)
    peak: int = 0
    _next: int = 0

    def size(self) -> int:
        return len(self.live) + len(self.starting)

    def pools(self) -> list[SimCluster]:
        return [self]

    def counts(self, serving: bool = False) -> tuple[int, int]:
        """(prefill, decode) workers up or starting (`serving`: up only, as discovery shows them)."""
        return 0, self.serving() if serving else self.size()

    def serving(self) -> int:
        """Workers that serve by now (`_promote`d at every arrival and tick)."""
        return len(self.live)

    def apply(self, num_prefill: int, num_decode: int, now: float) -> None:
        self.scale(num_decode, now)

    def scale(self, wanted: int, now: float) -> None:
        wanted = max(wanted, 1)
        while self.size() < wanted:
            worker = SimWorker.of(self.ranks_per_worker, self.kv_tokens, now + self.startup_s, self.role, self.handoffs)
            self.allocated[id(worker)] = now
            self.starting.append(worker)
        while self.size() > wanted:  # the newest go first; one still starting is simply released
            if self.starting:
                worker = self.starting.pop()
                self.done.append((self.allocated.pop(id(worker)), now))
            else:
                self.draining.append(self.live.pop())
        self.peak = max(self.peak, self.size() + len(self.draining))

    def route(self, request: SimRequest) -> None:
        self._next_rank(request.arrival_s).waiting.append([request, request.isl])
        self.stats.arrived += 1

    def deliver(self, request: SimRequest, first_token_s: float) -> None:
        """Decode pool: a prompt prefilled elsewhere starts decoding on the next worker's next rank (round-robin)."""
        self._next_rank(first_token_s).join(request, first_token_s, self.stats)

    def _next_rank(self, now: float) -> SimRank:
        """The rank of the next worker in turn that takes the next request, advanced to `now`."""
        self._promote(now)
        pool = self.live or self.starting
        worker = pool[self._next % len(pool)]
        self._next += 1
        return worker.next_rank(now, self.stats)

    def tick(self, now: float) -> None:
        """Advance every worker to `now`; retire drained ones."""
        self._promote(now)
        for worker in [*self.live, *self.draining]:
            worker.advance(now, self.stats)
        for worker in [w for w in self.draining if not w.busy()]:
            self.draining.remove(worker)
            self.done.append((self.allocated.pop(id(worker)), worker.now))

    def finish(self, end: float) -> float:
        """Run every stream to its end; total worker-seconds, each live worker counted up to `end`."""
        for worker in [*self.live, *self.draining]:
            worker.advance(math.inf, self.stats)
        spans = list(self.done)
        spans += [(self.allocated[id(w)], max(end, w.now)) for w in [*self.live, *self.starting, *self.draining]]
        return sum(stop - start for start, stop in spans)

    def _promote(self, now: float) -> None:
        for worker in [w for w in self.starting if w.started_s <= now]:
            self.starting.remove(worker)
            worker.serve_from(worker.started_s)
            self.live.append(worker)


@dataclass(slots=True)
class DisaggCluster:
    """A prefill pool and a decode pool. Each prompt is prefilled by a prefill worker (round-robin; its TTFT
    includes that worker's queue), then decoded by a decode worker (round-robin) in decode-only steps, so the
    decode pool's ITL never waits behind a prefill; the KV transfer between them is taken as free.

    NOTE: handoffs are delivered in time order: before each arrival or tick at time T every prefill worker is
    advanced to T, and the prompts it finished by T start decoding at their first token's time.
    """

    prefill: SimCluster
    decode: SimCluster
    peak: int = 0
    _pending: list[tuple[float, int, SimRequest]] = field(default_factory=list)
    _seq: int = 0

    def pools(self) -> list[SimCluster]:
        return [self.prefill, self.decode]

    def counts(self, serving: bool = False) -> tuple[int, int]:
        if serving:
            return self.prefill.serving(), self.decode.serving()
        return self.prefill.size(), self.decode.size()

    def apply(self, num_prefill: int, num_decode: int, now: float) -> None:
        self.prefill.scale(num_prefill, now)
        self.decode.scale(num_decode, now)
        self.peak = max(self.peak, sum(pool.size() + len(pool.draining) for pool in self.pools()))

    def route(self, request: SimRequest) -> None:
        self._hand_over(request.arrival_s)
        self.prefill.route(request)

    def tick(self, now: float) -> None:
        self._hand_over(now)
        self.decode.tick(now)

    def finish(self, end: float) -> float:
        spent = self.prefill.finish(end)
        self._hand_over(math.inf)
        return spent + self.decode.finish(end)

    def _hand_over(self, now: float) -> None:
        if now != math.inf:
            self.prefill.tick(now)
        for at, request in self.prefill.handoffs:
            self._seq += 1
            heapq.heappush(self._pending, (at, self._seq, request))
        self.prefill.handoffs.clear()
        while self._pending and self._pending[0][0] <= now:
            at, _, request = heapq.heappop(self._pending)
            self.decode.deliver(request, at)


class _Source:
    def __init__(self, cluster: SimCluster | DisaggCluster) -> None:
        self.cluster, self.now = cluster, 0.0

    async def snapshot(self) -> Snapshot:
        stats = self.cluster.pools()[0].stats
        return Snapshot(at=self.now, sums=dict(stats.sums), inflight=float(stats.arrived - stats.finished))

    def load(self) -> PoolLoad:
        """The workers' per-step load, as their LoadMetrics would say (they were just advanced to `now`)."""
        workers = [w for pool in self.cluster.pools() for w in (*pool.live, *pool.draining)]
        return PoolLoad(
            num_workers=len(workers),
            num_running=sum(w.num_running() for w in workers),
            num_waiting=sum(w.num_waiting() for w in workers),
        )

    async def count(self) -> WorkerCount:
        """The workers serving by now, and their ranks, as discovery and their cards would say them."""
        prefill, decode = self.cluster.counts(serving=True)
        ranks = self.cluster.pools()[-1].ranks_per_worker
        return WorkerCount(prefill, decode, ranks if prefill else 0, ranks if decode else 0)


class _Connector:
    def __init__(self, cluster: SimCluster | DisaggCluster, source: _Source) -> None:
        self.cluster, self.source = cluster, source

    async def next_decision_id(self) -> int:
        return 1

    async def apply(self, target: ScaleTarget) -> bool:
        self.cluster.apply(target.num_prefill, target.num_decode, self.source.now)
        return True

    async def close(self) -> None:
        return None


def _cluster(
    disagg: bool, kv_tokens: int, stats: Stats, first: tuple[int, int], startup_s: float, ranks: int
) -> SimCluster | DisaggCluster:
    """The pools of workers of `ranks` ranks, with the `first` (prefill, decode) workers already serving; later ones
    take `startup_s`."""
    cluster: SimCluster | DisaggCluster = SimCluster(kv_tokens, stats, ranks_per_worker=ranks)
    if disagg:
        cluster = DisaggCluster(
            SimCluster(kv_tokens, stats, role="prefill", ranks_per_worker=ranks),
            SimCluster(kv_tokens, stats, role="decode", ranks_per_worker=ranks),
        )
    cluster.apply(*first, 0.0)
    for pool in cluster.pools():
        pool._promote(0.0)
        pool.startup_s = startup_s
    return cluster


def _oracle_steps(
    requests: list[SimRequest],
    profile: Profile,
    planner: PlannerConfig | None,
    startup_s: float,
    rates: RateAt | None,
    ranks_per_worker: int,
) -> deque[OracleStep]:
    """The oracle's pools of workers of `ranks_per_worker` ranks over the trace, knowing `rates` (None: the requests'
    own over one throughput interval); none without a `planner` to size as."""
    if planner is None:
        return deque()
    rates = rates or trace_rates([(r.arrival_s, r.isl, r.osl) for r in requests], planner.interval_s)
    end = requests[-1].arrival_s if requests else 0.0
    needs = oracle_needs(rates, end, profile, planner, RanksPerWorker.every(ranks_per_worker))
    return deque(oracle_schedule(needs, startup_s))


async def simulate(
    requests: list[SimRequest],
    profile: Profile,
    ttft_ms: float,
    itl_ms: float,
    *,
    static_workers: int = 0,
    static_prefill: int = 0,
    planner: PlannerConfig | None = None,
    startup_s: float = 30.0,
    oracle: bool = False,
    rates: RateAt | None = None,
    ranks_per_worker: int = 1,
    report: Reporter | None = None,
) -> SimResult:
    """Replay `requests` on `static_workers` workers (`static_prefill` > 0: as many prefill, `static_workers` decode),
    on as many as `planner` asks for (each step to `report`), or with `oracle` on what an oracle sizing as `planner`
    keeps, knowing the load `rates` (oracle.py; default: the requests' own); workers of `ranks_per_worker` ranks."""
    stats = Stats(ttft_ms=ttft_ms, itl_ms=itl_ms)
    disagg = planner.mode == "disagg" if planner else static_prefill > 0
    first = planner.bounds.min_workers if planner else 1
    pools = (static_prefill or first, static_workers or first)
    schedule = _oracle_steps(requests, profile, planner if oracle else None, startup_s, rates, ranks_per_worker)
    pools = (schedule[0].num_prefill, schedule[0].num_decode) if schedule else pools
    cluster = _cluster(disagg, profile.max_kv_tokens, stats, pools, startup_s, ranks_per_worker)
    source, brain = _Source(cluster), None
    if planner is not None and not oracle:
        brain = Planner(planner, profile, source, _Connector(cluster, source), source.count, report, source.load)
        await brain.baseline()
    worker_seconds = await _replay(requests, cluster, source, brain, schedule)
    policy = f"static {static_prefill}+{static_workers}" if disagg else f"static {static_workers}"
    policy = policy if planner is None else "oracle" if oracle else "planner"
    return SimResult(
        policy=policy,
        num_requests=stats.finished,
        attainment=stats.met / max(stats.finished, 1),
        worker_seconds=worker_seconds,
        max_workers=cluster.peak,
        ranks_per_worker=ranks_per_worker,
    )


async def _replay(
    requests: list[SimRequest],
    cluster: SimCluster | DisaggCluster,
    source: _Source,
    brain: Planner | None,
    schedule: deque[OracleStep],
) -> float:
    """Route every request, applying the oracle's pools due by then, or running the planner's steps due by then;
    then run every stream to its end: the worker-seconds spent (SimCluster.finish)."""
    config = brain.config if brain is not None else None
    next_plan = config.interval_s if config else math.inf
    load = config.load_interval_s if config and config.load_interval_s > 0 else math.inf
    next_load = load
    for request in requests:
        while schedule and schedule[0].at <= request.arrival_s:  # the oracle's pools, due by this arrival
            step = schedule.popleft()
            cluster.tick(step.at)
            cluster.apply(step.num_prefill, step.num_decode, step.at)
        while brain is not None and min(next_plan, next_load) <= request.arrival_s:
            source.now = min(next_plan, next_load)
            cluster.tick(source.now)
            if next_plan <= next_load:
                next_plan += brain.config.interval_s
                await brain.plan_once()
            else:
                next_load += load
                await brain.check_burst()
        cluster.route(request)
    return cluster.finish(requests[-1].arrival_s if requests else 0.0)


def run_simulation(
    requests: list[SimRequest],
    profile: Profile,
    ttft_ms: float,
    itl_ms: float,
    statics: Sequence[int | tuple[int, int]],
    planner: PlannerConfig,
    startup_s: float,
    rates: RateAt | None = None,
) -> list[SimResult]:
    """Every static size (N workers, or (prefill, decode) workers), then the planner and the oracle (knowing
    `rates`, by default the requests' own), on the same requests; each worker of the planner's
    `--ranks-per-worker` ranks (0: 1)."""
    run = functools.partial(
        simulate, requests, profile, ttft_ms, itl_ms, ranks_per_worker=planner.ranks_per_worker or 1
    )

    async def all_policies() -> list[SimResult]:
        results = []
        for size in statics:
            prefill, decode = size if isinstance(size, tuple) else (0, size)
            results.append(await run(static_workers=decode, static_prefill=prefill))
        for oracle in (False, True):
            results.append(await run(planner=planner, startup_s=startup_s, oracle=oracle, rates=rates))
        return results

    return asyncio.run(all_policies())
