"""KV routing in virtual time: the real routing policies over the mocker's real scheduler, no processes.

The matrix of benchmarks/kv_routing_matrix.py (cache regime x load x router) replayed in simulated time:
N mocker `Scheduler`s (engines/mocker, the same timing model and KV manager a `dyn worker --engine mocker`
runs) and the router's own `KvRoutingPolicy` / `RoundRobinPolicy` (router/kv.py, router/base.py),
fed the workers' KV events and load after every pass, first tokens and ends of streams as they happen.
What it leaves out is the network and the event loop (a request reaches its worker at once, events the
router at the end of the pass that made them); a client sends its next request 0-2 ms after the last
ended. It is deterministic per seed and takes seconds, so a cost formula's prediction can be checked
on every cell before the real matrix is run (time_cost.py quotes it).

    python benchmarks/kv_routing_sim.py                                  # the full matrix, 2 seeds
    python benchmarks/kv_routing_sim.py --caches default --loads closed  # one cell
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynamo_cli.config import KvRouterConfig  # noqa: E402
from dynamo_cli.engine import LoadMetrics  # noqa: E402
from dynamo_cli.router.base import RoundRobinPolicy, RouteRequest  # noqa: E402
from dynamo_cli.router.kv import KvRoutingPolicy  # noqa: E402
from engines.mocker.kv_manager import KvManager  # noqa: E402
from engines.mocker.scheduler import MockRequest, PassResult, Scheduler, SchedulerConfig  # noqa: E402
from engines.mocker.timing import TimingModel  # noqa: E402

CACHES = {"default": (20, 16384), "p20": (20, 512), "p40": (40, 512)}
"""Cache regime -> (system prompts, KV blocks per worker), as in kv_routing_matrix.py."""
MODES = ("round-robin", "kv", "kv:cost=dynamo")


@dataclass
class Run:
    """One replay's outcome."""

    ttft_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0


def make_policy(mode: str, block_size: int, seed: int, clock: Callable[[], float]) -> Any:
    if mode == "round-robin":
        return RoundRobinPolicy()
    knobs = dict(item.split("=", 1) for item in mode.split(":")[1:])
    return KvRoutingPolicy(KvRouterConfig(block_size=block_size, **knobs), rng=random.Random(seed), clock=clock)


def replay(args: argparse.Namespace, cache: str, load: str, mode: str, seed: int, capacity: float) -> Run:
    """One deployment of `mode` under `load` ("closed" or a fraction of `capacity` req/s), `args.seconds` long."""
    prompts, blocks = CACHES[cache]
    bs, workers = args.block_size, args.workers
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 30000) for _ in range(args.prefix_tokens)] for _ in range(prompts)]
    engines = [Scheduler(KvManager(blocks, bs), SchedulerConfig(), TimingModel()) for _ in range(workers)]
    ids = list(range(1, workers + 1))
    now = [0.0]
    policy = make_policy(mode, bs, seed, lambda: now[0])
    running: list[PassResult | None] = [None] * workers
    owner: dict[str, tuple[int, float, int]] = {}  # request -> (worker index, sent at, client or -1)
    started: set[str] = set()
    queue: list[tuple[float, int, str, int]] = []
    order, sent = [0], [0]
    out = Run()

    def push(at: float, kind: str, data: int) -> None:
        order[0] += 1
        heapq.heappush(queue, (at, order[0], kind, data))

    def begin(w: int) -> None:
        if running[w] is None and engines[w].has_work:
            running[w] = result = engines[w].step()
            push(now[0] + result.duration_ms / 1000, "pass", w)

    if load == "closed":
        for client in range(args.clients_per_worker * workers):
            push(rng.random() * 0.005, "send", client)
    else:
        at, rate = 0.0, float(load) * capacity
        while at < args.seconds:
            at += rng.expovariate(rate)
            push(at, "send", -1)
    while queue:
        now[0], _, kind, data = heapq.heappop(queue)
        if now[0] > args.seconds:
            break
        if kind == "send":
            tokens = rng.choice(systems) + [rng.randrange(1000, 30000) for _ in range(args.suffix_tokens)]
            sent[0] += 1
            request_id = f"r{sent[0]}"
            w = ids.index(policy.select(RouteRequest(request_id, tokens), ids).worker_id)
            owner[request_id] = (w, now[0], data)
            engines[w].add(MockRequest(request_id, tokens, args.max_tokens, bs, seed=sent[0]))
            begin(w)
            continue
        result, running[data] = running[data], None
        w = data
        batch = engines[w].kv.take_events(timestamp=now[0], worker_id=ids[w])
        if batch is not None:
            policy.apply_kv_events(batch)
        policy.apply_load(LoadMetrics(worker_id=ids[w], total_blocks=blocks))
        assert result is not None
        for request in result.emitted:
            if request.request_id not in started:
                started.add(request.request_id)
                policy.on_first_token(request.request_id)
                if now[0] > args.warmup:
                    out.ttft_ms.append((now[0] - owner[request.request_id][1]) * 1000)
                    out.prompt_tokens += request.prompt_len
                    out.cached_tokens += request.num_cached_tokens or 0
        for request in result.finished:
            policy.on_finish(request.request_id)
            started.discard(request.request_id)
            _, _, client = owner.pop(request.request_id)
            if client >= 0:
                push(now[0] + rng.random() * 0.002, "send", client)
        begin(w)
    return out


def capacity_of(args: argparse.Namespace, cache: str) -> float:
    """Round-robin's capacity as kv_routing_matrix.py probes it: one worker closed-loop at 32 clients, x N."""
    probe = argparse.Namespace(**{**vars(args), "workers": 1, "clients_per_worker": 32, "seconds": 20.0,
                                  "warmup": 5.0})  # fmt: skip
    run = replay(probe, cache, "closed", "round-robin", 1, 0.0)
    return len(run.ttft_ms) / (probe.seconds - probe.warmup) * args.workers


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
    p.add_argument("--json", default="benchmarks/out/kv_routing_sim.json")
    args = p.parse_args()
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
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
