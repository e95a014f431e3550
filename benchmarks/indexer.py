"""Benchmark of the KV indexer: block-event ingest rate and prefix-query latency.

Workload: W workers, each caching ~B blocks made of chains (a shared system-prompt prefix drawn from a
pool, then blocks unique to that worker), stored as `BlockStored` events of `--event-blocks` blocks.
Queries are 64-block requests: a shared prefix then the suffix of one worker's chain (full hit on one
worker, prefix hit on most), a shared prefix then unseen blocks, or all unseen blocks.

    python benchmarks/indexer.py                      # 64 workers x 100k blocks
    python benchmarks/indexer.py --workers 128        # the issue-15 bar: select p99 <= 1 ms at 128 workers
    python benchmarks/indexer.py --workers 8 --blocks-per-worker 20000 --json /tmp/idx.json
    python benchmarks/indexer.py --workers 128 --offload-fraction 0.5   # half the system prompts' holders
                                                   # keep its second half on host only (KV tiers)
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import harness
import numpy as np

from dynamo_cli.config import KvRouterConfig
from dynamo_cli.kv.events import BlockRemoved, BlockStored, KvEvent, KvEventBatch, StoredBlock
from dynamo_cli.kv.hashing import sequence_hashes
from dynamo_cli.routing.base import RouteRequest
from dynamo_cli.routing.indexer import KvIndexer
from dynamo_cli.routing.kv_policy import KvRoutingPolicy
from dynamo_cli.routing.target import Target, targets_of


@dataclass(frozen=True, slots=True)
class Workload:
    """The generated chains: per worker, a list of (prefix index, suffix hashes)."""

    prefixes: list[list[int]]
    prefix_blocks: list[list[StoredBlock]]
    """The prefixes as stored blocks, built once and shared by every worker's events."""
    chains: list[list[tuple[int, list[int]]]]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--blocks-per-worker", type=int, default=100_000)
    parser.add_argument("--prefixes", type=int, default=512, help="shared system prompts in the pool")
    parser.add_argument("--prefix-blocks", type=int, default=32)
    parser.add_argument("--suffix-blocks", type=int, default=32)
    parser.add_argument("--event-blocks", type=int, default=16, help="blocks per BlockStored event")
    parser.add_argument("--churn-chains", type=int, default=200, help="suffixes evicted and re-stored per worker")
    parser.add_argument("--queries", type=int, default=20_000)
    parser.add_argument("--selects", type=int, default=5_000, help="routing decisions timed per cost")
    parser.add_argument(
        "--offload-fraction",
        type=float,
        default=0.0,
        help="select: share of a system prompt's holders that keep its second half on host only",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="default: benchmarks/out/indexer.json")
    return parser.parse_args(argv)


def make_workload(args: argparse.Namespace, rng: random.Random) -> Workload:
    size = args.workers * (args.blocks_per_worker + args.suffix_blocks) + args.prefixes * args.prefix_blocks
    pool = iter(np.random.default_rng(args.seed).integers(0, 2**64, size=size, dtype=np.uint64).tolist())

    def fresh(n: int) -> list[int]:
        return list(islice(pool, n))

    prefixes = [fresh(args.prefix_blocks) for _ in range(args.prefixes)]
    chains: list[list[tuple[int, list[int]]]] = []
    for _ in range(args.workers):
        held: set[int] = set()
        mine: list[tuple[int, list[int]]] = []
        while len(mine) * args.suffix_blocks + len(held) * args.prefix_blocks < args.blocks_per_worker:
            index = rng.randrange(args.prefixes)
            held.add(index)
            mine.append((index, fresh(args.suffix_blocks)))
        chains.append(mine)
    prefix_blocks = [list(map(StoredBlock, prefix, prefix)) for prefix in prefixes]
    return Workload(prefixes, prefix_blocks, chains)


def worker_batches(workload: Workload, worker: int, event_blocks: int) -> list[KvEventBatch]:
    """The worker's cache filled chain by chain: its prefix (first time only), then its suffix."""
    stored: set[int] = set()
    blocks: list[StoredBlock] = []
    for index, suffix in workload.chains[worker]:
        if index not in stored:
            stored.add(index)
            blocks.extend(workload.prefix_blocks[index])
        blocks.extend(map(StoredBlock, suffix, suffix))
    events: list[KvEvent] = [
        BlockStored(parent_hash=None, blocks=blocks[i : i + event_blocks]) for i in range(0, len(blocks), event_blocks)
    ]
    per_batch = 8
    return [
        KvEventBatch(event_id=n, worker_id=worker, events=events[i : i + per_batch])
        for n, i in enumerate(range(0, len(events), per_batch))
    ]


def bench_ingest(indexer: KvIndexer, workload: Workload, args: argparse.Namespace) -> dict[str, float]:
    """Fill every worker's cache from empty, worker by worker (event generation is not timed)."""
    total_blocks, wall, cpu = 0, 0.0, 0.0
    for worker in range(args.workers):
        batches = worker_batches(workload, worker, args.event_blocks)
        total_blocks += sum(len(e.blocks) for b in batches for e in b.events if isinstance(e, BlockStored))
        wall_start, cpu_start = time.perf_counter(), time.thread_time()
        for batch in batches:
            indexer.apply_batch(batch)
        wall += time.perf_counter() - wall_start
        cpu += time.thread_time() - cpu_start
    return _rates(total_blocks, wall, cpu)


def bench_churn(
    indexer: KvIndexer, workload: Workload, args: argparse.Namespace, rng: random.Random
) -> dict[str, float]:
    """Steady state: evict then re-store whole suffixes (as many removed as stored block events).

    Two rounds: the first usually includes a resize of the big hash -> mask dict (its stall is
    reported as `max_batch_ms`), the second is the steady rate reported.
    """
    max_batch = 0.0
    for _ in range(2):
        batches = churn_batches(indexer, workload, args, rng)
        wall_start, cpu_start = time.perf_counter(), time.thread_time()
        for batch in batches:
            batch_start = time.perf_counter()
            indexer.apply_batch(batch)
            max_batch = max(max_batch, time.perf_counter() - batch_start)
        wall, cpu = time.perf_counter() - wall_start, time.thread_time() - cpu_start
    return {**_rates(len(batches) * args.suffix_blocks, wall, cpu), "max_batch_ms": max_batch * 1000}


def churn_batches(
    indexer: KvIndexer, workload: Workload, args: argparse.Namespace, rng: random.Random
) -> list[KvEventBatch]:
    batches: list[KvEventBatch] = []
    for worker in range(args.workers):
        next_id = indexer.next_event_id(worker)
        chains = rng.sample(workload.chains[worker], min(args.churn_chains, len(workload.chains[worker])))
        for n, (_, suffix) in enumerate(chains):
            stored = BlockStored(parent_hash=None, blocks=list(map(StoredBlock, suffix, suffix)))
            removed = BlockRemoved(block_hashes=suffix)
            batches.append(KvEventBatch(event_id=next_id + 2 * n, worker_id=worker, events=[removed]))
            batches.append(KvEventBatch(event_id=next_id + 2 * n + 1, worker_id=worker, events=[stored]))
    return batches


def _rates(block_events: int, wall: float, cpu: float) -> dict[str, float]:
    return {
        "block_events": block_events,
        "wall_s": wall,
        "cpu_s": cpu,
        "block_events_per_s": block_events / wall,
        "block_events_per_cpu_s": block_events / cpu,
    }


def make_queries(workload: Workload, args: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    queries: list[list[int]] = []
    size = args.prefix_blocks + args.suffix_blocks
    for n in range(args.queries):
        kind = n % 3
        if kind == 0:  # full hit on one worker, prefix hit on every worker holding the prefix
            index, suffix = rng.choice(workload.chains[rng.randrange(args.workers)])
            queries.append(workload.prefixes[index] + suffix)
        elif kind == 1:  # shared prefix, then unseen blocks
            prefix = rng.choice(workload.prefixes)
            queries.append(prefix + [rng.getrandbits(64) for _ in range(size - len(prefix))])
        else:  # nothing cached
            queries.append([rng.getrandbits(64) for _ in range(size)])
    return queries


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000

    return {"p50_us": pick(0.50), "p99_us": pick(0.99), "mean_us": statistics.fmean(ordered) / 1000}


def bench_query(indexer: KvIndexer, queries: list[list[int]]) -> dict[str, float]:
    """Per-query latency, wall clock and on-CPU (the latter without preemption by other processes)."""
    wall: list[int] = []
    cpu: list[int] = []
    wall_clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for hashes in queries:
        wall_start, cpu_start = wall_clock(), cpu_clock()
        indexer.find_matches(hashes)
        cpu_end, wall_end = cpu_clock(), wall_clock()
        wall.append(wall_end - wall_start)
        cpu.append(cpu_end - cpu_start)
    on_cpu = percentiles(cpu)
    return {**percentiles(wall), **{f"cpu_{k}": v for k, v in on_cpu.items()}}


def bench_select(indexer: KvIndexer, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """Whole decisions over every worker and the filled index, for each cost function.

    Each request is one of 64 system prompts (32 blocks, each cached on 1-8 random workers on top of
    their ~100k blocks) plus 32 unseen blocks: hashing 64 blocks, the prefix query, load, the cost of
    every candidate and the explanation. About 2 requests per worker stay in flight, half of them
    past their first token, as the router would see them.
    """
    systems = [[rng.randrange(32_000) for _ in range(512)] for _ in range(64)]
    for system in systems:
        hashes = sequence_hashes(system, 16)
        for worker in rng.sample(range(args.workers), rng.randint(1, min(8, args.workers))):
            if args.offload_fraction and rng.random() < args.offload_fraction:  # offloaded: a tiered split
                indexer.store_blocks(Target(worker), hashes[:16])
                indexer.store_blocks(Target(worker), hashes[16:], "host")
            else:
                indexer.store_blocks(Target(worker), hashes)
    requests = [rng.choice(systems) + [rng.randrange(32_000) for _ in range(512)] for _ in range(args.selects)]
    hashing = _timed(lambda: sequence_hashes(requests[0], 16), 2000)
    results: dict[str, Any] = {"hash_64_blocks": percentiles(hashing[0])}
    for cost in ("time", "dynamo"):
        config = KvRouterConfig(block_size=16, cost=cost, total_kv_blocks=args.blocks_per_worker + 1024)
        policy = KvRoutingPolicy(config, rng=random.Random(args.seed))
        policy.indexer = indexer
        results[cost] = _select_latency(policy, requests, targets_of(range(args.workers)))
    return results


def _select_latency(policy: KvRoutingPolicy, requests: list[list[int]], targets: list[Target]) -> dict[str, float]:
    in_flight = 2 * len(targets)
    wall: list[int] = []
    cpu: list[int] = []
    wall_clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for n, tokens in enumerate(requests):
        request = RouteRequest(f"r{n}", tokens)
        wall_start, cpu_start = wall_clock(), cpu_clock()
        _ = policy.select(request, targets).explanation  # built when read: as for x-dyn-explain-route
        cpu_end, wall_end = cpu_clock(), wall_clock()
        wall.append(wall_end - wall_start)
        cpu.append(cpu_end - cpu_start)
        policy.on_first_token(f"r{n - in_flight // 2}")
        policy.on_finish(f"r{n - in_flight}")
    return {**percentiles(wall), **{f"cpu_{k}": v for k, v in percentiles(cpu).items()}}


def _timed(call: Any, times: int) -> tuple[list[int], list[int]]:
    wall: list[int] = []
    cpu: list[int] = []
    for _ in range(times):
        wall_start, cpu_start = time.perf_counter_ns(), time.thread_time_ns()
        call()
        cpu.append(time.thread_time_ns() - cpu_start)
        wall.append(time.perf_counter_ns() - wall_start)
    return wall, cpu


def _detail(rates: dict[str, float]) -> str:
    per_cpu, events, wall = rates["block_events_per_cpu_s"], rates["block_events"], rates["wall_s"]
    detail = f"{per_cpu:,.0f} per CPU-s; {events:,.0f} in {wall:.2f} s"
    if "max_batch_ms" in rates:
        detail += f"; slowest batch {rates['max_batch_ms']:.0f} ms"
    return detail


def print_table(result: dict[str, Any]) -> None:
    ingest, churn, query, select = (result[k] for k in ("ingest", "churn", "query", "select"))
    workers = result["config"]["workers"]
    rows = [
        ("ingest (fill)", f"{ingest['block_events_per_s']:,.0f} block events/s", _detail(ingest)),
        ("churn (remove+store)", f"{churn['block_events_per_s']:,.0f} block events/s", _detail(churn)),
        (
            "query 64 blocks",
            f"p50 {query['p50_us']:.1f} us  p99 {query['p99_us']:.1f} us",
            f"on-CPU p50 {query['cpu_p50_us']:.1f} us  p99 {query['cpu_p99_us']:.1f} us",
        ),
        *[
            (
                f"select ({workers} workers, {cost} cost)",
                f"p50 {select[cost]['p50_us']:.1f} us  p99 {select[cost]['p99_us']:.1f} us",
                f"on-CPU p50 {select[cost]['cpu_p50_us']:.1f} us  p99 {select[cost]['cpu_p99_us']:.1f} us",
            )
            for cost in ("time", "dynamo")
        ],
        ("hash 64 blocks", f"p50 {select['hash_64_blocks']['p50_us']:.1f} us", "(part of select)"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, main, extra in rows:
        print(f"{name:<{width}}  {main:<34}  {extra}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = harness.loadavg()
    rng = random.Random(args.seed)
    workload = make_workload(args, rng)
    indexer = KvIndexer()
    # NOTE: the collector stays on; the generated workload is frozen out of it, as a server would
    # freeze its start-up objects, so its pauses measure the indexer's own containers.
    gc.collect()
    gc.freeze()
    ingest = bench_ingest(indexer, workload, args)
    churn = bench_churn(indexer, workload, args, rng)
    query = bench_query(indexer, make_queries(workload, args, rng))
    select = bench_select(indexer, args, rng)
    sizes = [indexer.num_blocks(Target(w)) for w in range(args.workers)]
    result: dict[str, Any] = {
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "min_worker_blocks": min(sizes),
            "max_worker_blocks": max(sizes),
        },
        "ingest": ingest,
        "churn": churn,
        "query": query,
        "select": select,
    }
    print_table(result)
    harness.write_results("indexer", result, args.json, loadavg_start=load_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
