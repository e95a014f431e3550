"""KV routing in virtual time: the real routing policies over the mocker's real scheduler, no processes.

The matrix of benchmarks/kv_routing_matrix.py (cache regime x load x router) replayed in simulated time:
N mocker `Scheduler`s (engines/mocker: the timing model and KV manager of `dyn worker --engine mocker`)
and the router's own `KvRoutingPolicy` / `RoundRobinPolicy`, fed the workers' KV events, load, first
tokens and ends of streams; a client sends its next request 0-2 ms after the last ended. Deterministic
per seed, seconds per cell: a cost's prediction is checked on every cell before the real matrix is run.

What the deployment adds on the way (defaults from the code or fitted to the measured round-robin cell,
`--ideal` sets all to 0 as the first replay had them, events at the end of a pass and load after each):

    --kv-at start          the mocker publishes a pass's KV events when the pass starts (engine.py `_run`)
    --kv-delay-ms 0.3      ... and the event plane brings them to the router (ZMQ over loopback)
    --load-interval-ms 50  load metrics (worker.py LOAD_INTERVAL_S; the policy reads only total_blocks)
    --request-delay-ms 0.2 route -> the request is in the worker's scheduler
    --first-token-delay-ms 0.2, --finish-delay-ms 0.2   pass end -> `on_first_token`, `on_finish` + client
    --jitter-ms 0.3        exponential extra per message (0.2/0.2/0.3 bring round-robin's default closed cell
                           from 30.0/31.0/31.4 to the measured 30.6/31.7/32.9 ms p50/p90/p99)
    --oversleep-ms 0       exponential lateness of each pass end, caught up as `_sleep_pass` does (<= 5 ms)
    --route-us 0, --kv-route-us 0, --kv-ingest-us 0, --chunk-us 0   frontend CPU (one event loop, FIFO) per
                           request, further per kv request, per KV batch (kv only), per token chunk relayed
    --trace N              the N slowest first tokens per kv run: decision, reason, what each worker was doing

    python benchmarks/kv_routing_sim.py                                  # the full matrix, 2 seeds
    python benchmarks/kv_routing_sim.py --caches default --loads closed  # one cell

The default-cache closed-loop p99 measured 49-58 ms for kv against 33 for round-robin (RESULTS.md) does not
replay under any of these delays (0.2-4 ms each, jitter 0.3-4 ms, kv-only frontend CPU up to 1 ms per
request and 0.5 ms per KV batch, oversleep up to 2 ms): there the time cost's near-ties are taken in
turn over all 4 workers, so kv routes as round-robin does, step for step, here and in a real run's route
explanations (1,343 of 1,343 steps). Its slow first tokens (11 of 13 over 40 ms) came from the 2 % of
decisions made while every worker had a prefill queued: 39 % of those joined a worker whose queued
prefill had already started its pass, and waited that pass too. Here that state is rare at 8 clients
per worker (<= 3 of 2,000 decisions) but common at 12 (`--clients-per-worker 12`: p99 42-43 ms both ways).
Part of the rest was the benchmark's own: kv_routing.py scraped the kv router's counters on its clients'
event loop at the window's start (kv only), and the requests that stall held back left as one burst
(RESULTS.md). The real open-loop cells' p90 behind round-robin (0.98-0.99) replays with the KV events 2 ms
late (`--kv-delay-ms 2`, or `--jitter-ms 1.5`): a worker whose pass had started looked still to start, and
point 6's choice then took the next turn's worker too (two arrivals there a few ms apart). Dealing
near-ties in rounds (cost.Rounds: each worker once per round) replays at p90/p99 1.01/1.00 there. A cost
that ranked near-ties by each worker's expected start (learned pass length, a late event presumed, a pass
about to end avoided) also put kv ahead at all three percentiles here; its real A/B (RESULTS.md, "a
fairer window and an A/B") ran the same code on both sides (`code=` was ineffective until 2026-11-24
23:00: `python -m` put the working directory ahead of PYTHONPATH), so it is still unmeasured for real.
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import harness
import numpy as np
from dyn_engines.mocker.engine import MAX_CATCH_UP_S
from dyn_engines.mocker.kv_manager import KvManager
from dyn_engines.mocker.scheduler import MockRequest, PassResult, Scheduler, SchedulerConfig

from dynamo_cli.config import KvRouterConfig
from dynamo_cli.routing.base import RoundRobinPolicy, RouteRequest
from dynamo_cli.routing.kv_policy import KvRoutingPolicy
from dynamo_cli.routing.target import targets_of
from dynamo_cli.timing import TimingModel
from dynamo_cli.wire import LoadMetrics

CACHES = {"default": (20, 16384), "p20": (20, 512), "p40": (40, 512)}
"""Cache regime -> (system prompts, KV blocks per worker), as in kv_routing_matrix.py."""
MODES = ("round-robin", "kv", "kv:cost=dynamo")


@dataclass(frozen=True)
class Delays:
    """How late the router and the workers hear of things, seconds (0 = at once, as the first replay);
    the flags' defaults (DELAY_FLAGS) are the deployment's."""

    request: float = 0.0
    """Route -> the request reaches its worker's scheduler (frontend -> worker transport)."""
    first_token: float = 0.0
    """End of the pass that made a first token -> the policy's `on_first_token` (worker -> frontend)."""
    finish: float = 0.0
    """End of the pass that ended a stream -> `on_finish`, and the client hears the end."""
    kv: float = 0.0
    """A pass's KV events published -> `apply_kv_events` (event plane)."""
    kv_at_start: bool = False
    """True: events are published when a pass starts (engine.py `_publish_events`), else at its end."""
    load_interval: float = 0.0
    """Load metrics every this many seconds (worker.py LOAD_INTERVAL_S); 0: after every pass."""
    jitter: float = 0.0
    """Mean of an exponential delay added to each message above (a busy event loop), drawn per message."""
    route: float = 0.0
    """Frontend CPU per request (tokenize, route, send), every mode; requests are routed one at a time."""
    kv_route: float = 0.0
    """Further frontend CPU per request of a kv mode (hashing, the cost, the explanation)."""
    kv_ingest: float = 0.0
    """Frontend CPU per KV event batch (kv modes only; round-robin does not subscribe)."""
    oversleep: float = 0.0
    """Mean of an exponential lateness of each pass's end (the worker's event loop wakes late); the next
    pass catches up up to MAX_CATCH_UP_S, as engines/mocker/engine.py `_sleep_pass`."""
    chunk: float = 0.0
    """Frontend CPU per token chunk relayed (every mode): a pass's chunks queue before the next routes."""


@dataclass
class Decision:
    """One routed request, for the tail trace."""

    request_id: str
    worker: int
    """Index of the chosen worker."""
    sent: float
    """When the client sent it (virtual seconds)."""
    explanation: dict[str, Any]
    """The policy's `RouteDecision.explanation`."""
    busy: list[str]
    """Per worker at routing time: what it was doing (idle, or its pass's prefill tokens and time left)."""
    ttft_ms: float = 0.0


@dataclass
class Run:
    """One replay's outcome."""

    ttft_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    decisions: list[Decision] = field(default_factory=list)
    """Decisions after warm-up (with --trace)."""


def make_policy(mode: str, block_size: int, seed: int, clock: Callable[[], float]) -> Any:
    if mode == "round-robin":
        return RoundRobinPolicy()
    knobs = dict(item.split("=", 1) for item in mode.split(":")[1:])
    return KvRoutingPolicy(KvRouterConfig(block_size=block_size, **knobs), rng=random.Random(seed), clock=clock)


class Replay:
    """One deployment of `mode` under `load` ("closed" or a fraction of `capacity` req/s), `args.seconds` long."""

    def __init__(self, args: argparse.Namespace, cache: str, mode: str, seed: int, delays: Delays) -> None:
        prompts, self.blocks = CACHES[cache]
        self.args, self.delays, self.trace = args, delays, bool(getattr(args, "trace", 0))
        self.rng, self.jitter_rng = random.Random(seed), random.Random(seed + 1_000_003)
        self.systems = [[self.rng.randrange(1000, 30000) for _ in range(args.prefix_tokens)] for _ in range(prompts)]
        self.engines = [
            Scheduler(KvManager(self.blocks, args.block_size), SchedulerConfig(), TimingModel())
            for _ in range(args.workers)
        ]
        self.ids, self.now = list(range(1, args.workers + 1)), 0.0
        self.targets = targets_of(self.ids)  # one rank each
        self.policy = make_policy(mode, args.block_size, seed, lambda: self.now)
        self.running: list[tuple[PassResult, float] | None] = [None] * args.workers
        self.owner: dict[str, tuple[int, float, int]] = {}  # request -> (worker index, sent at, client or -1)
        self.decided: dict[str, Decision] = {}
        self.queue: list[tuple[float, int, str, Any]] = []
        self.order = self.sent = 0
        self.out = Run()
        is_kv = mode != "round-robin"
        self.route_s = delays.route + delays.kv_route * is_kv
        self.ingest_s = delays.kv_ingest * is_kv
        self.frontend_free = 0.0
        """When the frontend's one event loop is done with what it has been given (route_s, ingest_s, chunks)."""
        self.late = [0.0] * args.workers
        """Per worker: how late its last pass ended (the next one is that much shorter, up to MAX_CATCH_UP_S)."""
        self.handlers: dict[str, Callable[[Any], None]] = {
            "send": self.send,
            "route": self.route,
            "arrive": self.arrive,
            "pass": self.end_pass,
            "kv": self.policy.apply_kv_events,
            "first": self.first_token,
            "finish": self.finish,
            "load": self.load,
        }

    def occupy(self, seconds: float) -> float:
        """Queue `seconds` of frontend work; how long from now until it is done."""
        self.frontend_free = max(self.now, self.frontend_free) + seconds
        return self.frontend_free - self.now

    def push(self, delay: float, kind: str, data: Any, jitter: bool = True) -> None:
        if jitter and self.delays.jitter > 0:
            delay += self.jitter_rng.expovariate(1 / self.delays.jitter)
        self.order += 1
        heapq.heappush(self.queue, (self.now + delay, self.order, kind, data))

    def run(self, load: str, capacity: float) -> Run:
        args = self.args
        if load == "closed":
            for client in range(args.clients_per_worker * args.workers):
                self.push(self.rng.random() * 0.005, "send", client, jitter=False)
        else:
            at, rate = 0.0, float(load) * capacity
            while at < args.seconds:
                at += self.rng.expovariate(rate)
                self.push(at, "send", -1, jitter=False)
        if self.delays.load_interval > 0:
            self.push(self.delays.load_interval, "load", None, jitter=False)
        while self.queue:
            self.now, _, kind, data = heapq.heappop(self.queue)
            if self.now > args.seconds:
                break
            self.handlers[kind](data)
        return self.out

    def send(self, client: int) -> None:
        args = self.args
        tokens = self.rng.choice(self.systems) + [self.rng.randrange(1000, 30000) for _ in range(args.suffix_tokens)]
        self.sent += 1
        request_id = f"r{self.sent}"
        self.owner[request_id] = (-1, self.now, client)
        if self.route_s > 0:
            self.push(self.occupy(self.route_s), "route", (request_id, tokens), jitter=False)
        else:
            self.route((request_id, tokens))

    def route(self, item: tuple[str, list[int]]) -> None:
        args, (request_id, tokens) = self.args, item
        _, sent, client = self.owner[request_id]
        busy = [self.doing(w) for w in range(args.workers)] if self.trace else []
        decision = self.policy.select(RouteRequest(request_id, tokens), self.targets)
        w = self.targets.index(decision.target)
        self.owner[request_id] = (w, sent, client)
        if self.trace and sent > args.warmup:
            self.decided[request_id] = Decision(request_id, w, sent, decision.explanation or {}, busy)
        request = MockRequest(request_id, tokens, args.max_tokens, args.block_size, seed=int(request_id[1:]))
        self.later(self.delays.request, "arrive", (w, request))

    def arrive(self, item: tuple[int, MockRequest]) -> None:
        w, request = item
        self.engines[w].add(request)
        self.begin(w)

    def doing(self, w: int) -> str:
        current = self.running[w]
        if current is None:
            return "idle"
        result, ends = current
        return f"pass {result.num_prefill_tokens} prefill tokens, {(ends - self.now) * 1000:.1f} ms left"

    def begin(self, w: int) -> None:
        if self.running[w] is None and self.engines[w].has_work:
            result = self.engines[w].step()
            late = self.jitter_rng.expovariate(1 / self.delays.oversleep) if self.delays.oversleep > 0 else 0.0
            seconds = max(0.0, result.duration_ms / 1000 - self.late[w]) + late
            self.late[w] = late if late <= MAX_CATCH_UP_S else 0.0
            self.running[w] = (result, self.now + seconds)
            self.push(seconds, "pass", w, jitter=False)
            if self.delays.kv_at_start:
                self.publish(w)

    def publish(self, w: int) -> None:
        batch = self.engines[w].kv.take_events(timestamp=self.now, worker_id=self.ids[w])
        if batch is None:
            return
        self.later((self.occupy(self.ingest_s) if self.ingest_s else 0.0) + self.delays.kv, "kv", batch)

    def load(self, _: None) -> None:
        for w in range(self.args.workers):
            self.policy.apply_load(LoadMetrics(worker_id=self.ids[w], total_blocks=self.blocks))
        self.push(self.delays.load_interval, "load", None, jitter=False)

    def end_pass(self, w: int) -> None:
        current, self.running[w] = self.running[w], None
        if not self.engines[w].has_work:
            self.late[w] = 0.0  # idle: the next pass starts afresh
        assert current is not None
        result = current[0]
        if not self.delays.kv_at_start:
            self.publish(w)
        if self.delays.load_interval <= 0:
            self.policy.apply_load(LoadMetrics(worker_id=self.ids[w], total_blocks=self.blocks))
        finished = {request.request_id for request in result.finished}
        for request in result.emitted:
            busy = self.occupy(self.delays.chunk) if self.delays.chunk > 0 else 0.0
            if request.num_output_tokens == 1:
                self.later(busy + self.delays.first_token, "first", request)
            if request.request_id in finished:
                self.later(busy + self.delays.finish, "finish", request.request_id)
        self.begin(w)

    def later(self, delay: float, kind: str, data: Any) -> None:
        """Handle a message `delay` (+ jitter) seconds from now; at once when both are 0."""
        if delay > 0 or self.delays.jitter > 0:
            self.push(delay, kind, data)
        else:
            self.handlers[kind](data)

    def first_token(self, request: MockRequest) -> None:
        self.policy.on_first_token(request.request_id)
        _, sent, _ = self.owner[request.request_id]
        if sent > self.args.warmup:
            ttft = (self.now - sent) * 1000
            self.out.ttft_ms.append(ttft)
            self.out.prompt_tokens += request.prompt_len
            self.out.cached_tokens += request.num_cached_tokens or 0
            decision = self.decided.pop(request.request_id, None)
            if decision is not None:
                decision.ttft_ms = ttft
                self.out.decisions.append(decision)

    def finish(self, request_id: str) -> None:
        self.policy.on_finish(request_id)
        _, _, client = self.owner.pop(request_id)
        if client >= 0:
            self.push(self.rng.random() * 0.002, "send", client, jitter=False)


def replay(args: argparse.Namespace, cache: str, load: str, mode: str, seed: int, capacity: float) -> Run:
    """One deployment of `mode` under `load` ("closed" or a fraction of `capacity` req/s), `args.seconds` long."""
    return Replay(args, cache, mode, seed, delays_of(args)).run(load, capacity)


DELAY_FLAGS = {
    "request-delay-ms": ("request", 1e-3, 0.2),
    "first-token-delay-ms": ("first_token", 1e-3, 0.2),
    "finish-delay-ms": ("finish", 1e-3, 0.2),
    "kv-delay-ms": ("kv", 1e-3, 0.3),
    "load-interval-ms": ("load_interval", 1e-3, 50.0),
    "jitter-ms": ("jitter", 1e-3, 0.3),
    "oversleep-ms": ("oversleep", 1e-3, 0.0),
    "route-us": ("route", 1e-6, 0.0),
    "kv-route-us": ("kv_route", 1e-6, 0.0),
    "kv-ingest-us": ("kv_ingest", 1e-6, 0.0),
    "chunk-us": ("chunk", 1e-6, 0.0),
}
"""Flag -> (`Delays` field, seconds per unit, default); see the module docstring."""


def delays_of(args: argparse.Namespace) -> Delays:
    """The delay flags as a `Delays` (all 0 with --ideal; a namespace without them: the defaults)."""
    if getattr(args, "ideal", False):
        return Delays()
    values = {
        name: getattr(args, flag.replace("-", "_"), default) * unit
        for flag, (name, unit, default) in DELAY_FLAGS.items()
    }
    return Delays(kv_at_start=getattr(args, "kv_at", "start") == "start", **values)


def capacity_of(args: argparse.Namespace, cache: str) -> float:
    """Round-robin's capacity as kv_routing_matrix.py probes it: one worker closed-loop at 32 clients, x N."""
    probe = argparse.Namespace(**{**vars(args), "workers": 1, "clients_per_worker": 32, "seconds": 20.0, "warmup": 5.0})
    run = replay(probe, cache, "closed", "round-robin", 1, 0.0)
    return len(run.ttft_ms) / (probe.seconds - probe.warmup) * args.workers


def print_trace(title: str, runs: list[Run], n: int) -> None:
    """The `n` slowest first tokens of `runs`: where each went, why, and what every worker was doing then."""
    decisions = sorted((d for r in runs for d in r.decisions), key=lambda d: -d.ttft_ms)
    if not decisions:
        return
    print(f"-- {title}: {n} slowest of {len(decisions)} (TTFT p50 {np.median([d.ttft_ms for d in decisions]):.1f} ms)")
    for d in decisions[:n]:
        e = d.explanation
        costs = " ".join(
            f"w{c['worker_id']}:{c['logit'] * 1000:.1f}/q{c.get('queue_s', 0) * 1000:.1f}"
            for c in e.get("candidates", [])
        )
        print(
            f"{d.request_id:>7} t={d.sent:.4f} ttft {d.ttft_ms:.1f} -> w{d.worker + 1} {e.get('reason')} "
            f"[cost/queue ms {costs}] busy: {'; '.join(d.busy)}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--caches", default="default,p20,p40")
    p.add_argument("--loads", default="closed,0.7,0.95")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seeds", default="7,8")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--clients-per-worker", type=int, default=8)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--suffix-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=50)
    p.add_argument("--block-size", type=int, default=64)
    for flag, (_, _, default) in DELAY_FLAGS.items():
        p.add_argument(f"--{flag}", type=float, default=default)
    p.add_argument("--kv-at", choices=("start", "end"), default="start")
    p.add_argument("--ideal", action="store_true", help="no delays: events at pass end, load after each pass")
    p.add_argument("--trace", type=int, default=0, help="print the N slowest requests' decisions per kv run")
    p.add_argument("--json", default=str(harness.results_path("kv_routing_sim")))
    args = p.parse_args()
    load_start = harness.loadavg()
    modes, seeds = args.modes.split(","), [int(s) for s in args.seeds.split(",")]
    rows: list[dict[str, Any]] = []
    head = f"{'cache':8} {'load':6} {'mode':16} {'req':>6} {'hit':>6}"
    print(f"{head} {'TTFT p50/p90/p99 ms':>22} {'rr/x p50/p90/p99':>18}")
    for cache in args.caches.split(","):
        capacity = capacity_of(args, cache)
        for load in args.loads.split(","):
            cell: dict[str, Any] = {}
            for mode in modes:
                runs = [replay(args, cache, load, mode, seed, capacity) for seed in seeds]
                if args.trace:
                    print_trace(f"{cache} {load} {mode}", runs, args.trace)
                ttft = np.array([x for r in runs for x in r.ttft_ms])
                cell[mode] = {
                    "requests": len(ttft) / len(seeds),
                    "hit_rate": sum(r.cached_tokens for r in runs) / max(1, sum(r.prompt_tokens for r in runs)),
                    "ttft_ms": [float(v) for v in np.percentile(ttft, [50, 90, 99])],
                }
            base = cell.get("round-robin")
            for mode, row in cell.items():
                ratio = [b / x for b, x in zip(base["ttft_ms"], row["ttft_ms"], strict=True)] if base else []
                row["rr_over"] = ratio
                rows.append({"cache": cache, "load": load, "capacity": capacity, "mode": mode, **row})
                t, r = "/".join(f"{v:.1f}" for v in row["ttft_ms"]), "/".join(f"{v:.2f}" for v in ratio)
                print(f"{cache:8} {load:6} {mode:16} {row['requests']:6.0f} {row['hit_rate']:6.1%} {t:>22} {r:>18}")
    harness.write_results("kv_routing_sim", {"args": vars(args), "rows": rows}, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
