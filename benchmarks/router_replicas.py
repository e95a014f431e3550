"""Do two synced `dyn router` replicas decide as one router would, over the same event stream?

A deterministic replay, no sockets (the replicas' sync messages are the real `ReplicaSync` wire
messages, encoded and applied as `dyn router` does). One simulated timeline:

1. **Reference**: one `KvRoutingPolicy` routes every request (Poisson arrivals; one of P system prompts
   plus a unique suffix). Its decisions drive W simulated worker caches (LRU over C blocks, blocks of
   running requests pinned), whose `BlockStored` / `BlockRemoved` batches reach the router
   `--event-delay-ms` later. First tokens come `--ttft-ms` after routing, ends `--lifetime-s` after.
   The KV event stream and its timing are recorded.
2. **Replicas**: two policies; request i goes to replica i mod 2 (a load balancer in front). Both apply
   the recorded KV event stream at the same times. Each publishes its routing events (added, prefill
   completed, freed) through `ReplicaSync`; the peer applies them `--sync-delay-ms` later.
3. **Unsynced**: the same two replicas without the sync (each sees only its own load): the control.

Reported: decision agreement with the reference (% of requests routed to the same worker; also over
the decisions the reference did not take by an arbitrary tie-break: at random, or in turn, which each
policy draws or counts itself), hit blocks / request blocks of each world, and load-accounting drift:
at every arrival, each replica's per-worker
in-flight totals (requests, active blocks, prefill tokens) against the truth of its world (every request
of both replicas, applied at once): mean signed difference (systematic drift) and mean absolute one.
After the last request ends every view must be back to 0 (no leaked load).

    python benchmarks/router_replicas.py [--requests 4000] [--rate 25] [--cost time|dynamo]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from collections import OrderedDict
from collections.abc import Callable
from itertools import count
from typing import Any

import harness
import msgspec

from dynamo_cli.config import KvRouterConfig
from dynamo_cli.core.registry import ModelEntry, RouterRegistry
from dynamo_cli.core.replicas import ActiveSequenceEvent, ReplicaSync
from dynamo_cli.kv.events import BlockRemoved, BlockStored, KvEvent, KvEventBatch, StoredBlock
from dynamo_cli.kv.hashing import sequence_hashes
from dynamo_cli.model_card import ModelCard
from dynamo_cli.routing.base import RouteRequest
from dynamo_cli.routing.kv_policy import KvRoutingPolicy
from dynamo_cli.routing.sequences import ActiveSequences
from dynamo_cli.routing.target import targets_of

MODEL = "m"


class Clock:
    """The simulated time every policy reads."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Timeline:
    """A heap of (time, seq, action)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = count()

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), action))

    def run(self, clock: Clock) -> None:
        while self._heap:
            clock.now, _, action = heapq.heappop(self._heap)
            action()


class WorkerCache:
    """One worker's prefix cache: LRU over `capacity` blocks; blocks of running requests are pinned."""

    def __init__(self, worker_id: int, capacity: int) -> None:
        self.worker_id, self.capacity = worker_id, capacity
        self.lru: OrderedDict[int, int] = OrderedDict()  # hash -> pins
        self.next_event = 0

    def admit(self, hashes: list[int]) -> KvEventBatch | None:
        """A request starts here: pin its blocks, storing the new ones and evicting unpinned LRU ones."""
        new = [h for h in hashes if h not in self.lru]
        for h in hashes:
            self.lru[h] = self.lru.get(h, 0) + 1
            self.lru.move_to_end(h)
        evicted = [h for h, pins in self.lru.items() if not pins][: max(0, len(self.lru) - self.capacity)]
        for h in evicted:
            del self.lru[h]
        events: list[KvEvent] = []
        if new:
            events.append(BlockStored(parent_hash=None, blocks=[StoredBlock(h, h) for h in new]))
        if evicted:
            events.append(BlockRemoved(block_hashes=evicted))
        if not events:
            return None
        self.next_event += 1
        return KvEventBatch(event_id=self.next_event - 1, worker_id=self.worker_id, events=events)

    def release(self, hashes: list[int]) -> None:
        for h in hashes:
            if h in self.lru:
                self.lru[h] -= 1


def make_requests(args: argparse.Namespace) -> list[tuple[float, list[int]]]:
    rng = random.Random(args.seed)
    prompts = [[1_000_000 * (p + 1) + i for i in range(args.prefix_tokens)] for p in range(args.prompts)]
    out, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        suffix = [rng.randrange(1 << 30) for _ in range(args.suffix_tokens)]
        out.append((t, rng.choice(prompts) + suffix))
    return out


def policy(args: argparse.Namespace, clock: Clock) -> KvRoutingPolicy:
    config = KvRouterConfig(block_size=args.block_size, cost=args.cost, total_kv_blocks=args.capacity)
    return KvRoutingPolicy(config, rng=random.Random(args.seed), clock=clock)


def reference(args: argparse.Namespace, requests: list[tuple[float, list[int]]]) -> dict[str, Any]:
    """One router; returns its decisions and the KV event stream its decisions caused, with times."""
    clock, timeline = Clock(), Timeline()
    router = policy(args, clock)
    caches = {w: WorkerCache(w, args.capacity) for w in range(args.workers)}
    stream: list[tuple[float, KvEventBatch]] = []
    decisions: list[int] = []
    random_ties: list[bool] = []

    def arrive(n: int, tokens: list[int]) -> None:
        rid = f"r{n}"
        decision = router.select(RouteRequest(rid, tokens), targets_of(caches))
        worker = decision.worker_id
        decisions.append(worker)
        random_ties.append(decision.explanation["reason"] in ("tie-random", "tie-in-turn"))  # arbitrary among equals
        hashes = sequence_hashes(tokens, args.block_size)
        batch = caches[worker].admit(hashes)
        if batch is not None:
            when = clock.now + args.event_delay_ms / 1000
            stream.append((when, batch))
            timeline.at(when, lambda: router.apply_kv_events(batch))
        timeline.at(clock.now + args.ttft_ms / 1000, lambda: router.on_first_token(rid))
        timeline.at(clock.now + args.lifetime_s, lambda: (router.on_finish(rid), caches[worker].release(hashes)))

    for n, (t, tokens) in enumerate(requests):
        timeline.at(t, lambda n=n, tokens=tokens: arrive(n, tokens))  # type: ignore[misc]
    timeline.run(clock)
    c = router.counters
    return {
        "decisions": decisions,
        "random_ties": random_ties,
        "stream": stream,
        "hit_blocks_rate": c.num_hit_blocks / c.num_request_blocks,
    }


def replicas(
    args: argparse.Namespace,
    requests: list[tuple[float, list[int]]],
    stream: list[tuple[float, KvEventBatch]],
    synced: bool,
) -> dict[str, Any]:
    """Two replicas over the recorded KV stream; request i to replica i % 2."""
    clock, timeline = Clock(), Timeline()
    card = ModelCard(display_name=MODEL, tokenizer_source="-", engine="mocker", kv_cache_block_size=args.block_size)
    workers, targets = list(range(args.workers)), targets_of(range(args.workers))  # one rank each
    pairs = []
    for router_id in (0xA, 0xB):
        p = policy(args, clock)
        registry = RouterRegistry(None, "ns", lambda card, p=p: p)  # type: ignore[arg-type,misc]
        registry.models[MODEL] = ModelEntry(MODEL, card, p, p, workers=dict.fromkeys(workers))  # type: ignore[arg-type]
        pairs.append((ReplicaSync(None, "ns", router_id, registry), p))  # type: ignore[arg-type]
    truth = ActiveSequences()
    decode = msgspec.msgpack.Decoder(list[ActiveSequenceEvent]).decode
    encode = msgspec.msgpack.Encoder().encode
    decisions: list[int] = []
    drift: dict[str, list[int]] = {"prefill_tokens": [], "active_blocks": [], "requests": []}  # totals()' order

    def deliver(sender: int) -> None:
        sync, _ = pairs[sender]
        peer, _ = pairs[1 - sender]
        while not sync._outbox.empty():  # what publish_loop would send, decoded as the peer's subscriber does
            (event,) = decode(encode([sync._outbox.get_nowait()]))
            if synced:
                timeline.at(clock.now + args.sync_delay_ms / 1000, lambda e=event: peer.apply(e))  # type: ignore[misc]

    def arrive(n: int, tokens: list[int]) -> None:
        side = n % 2
        sync, router = pairs[side]
        sample_drift(router)
        rid = f"r{n}"
        decision = router.select(RouteRequest(rid, tokens), targets)
        decisions.append(decision.worker_id)
        sync.added(MODEL, rid, router)
        info = router.sequences.describe(rid)
        assert info is not None
        truth.add_request(rid, *info)
        deliver(side)
        timeline.at(clock.now + args.ttft_ms / 1000, lambda: step(side, rid, first=True))
        timeline.at(clock.now + args.lifetime_s, lambda: step(side, rid, first=False))

    def step(side: int, rid: str, first: bool) -> None:
        sync, router = pairs[side]
        if first:
            router.on_first_token(rid)
            sync.prefill_completed(MODEL, rid)
            truth.mark_prefill_completed(rid)
        else:
            router.on_finish(rid)
            sync.freed(MODEL, rid)
            truth.free(rid)
        deliver(side)

    def sample_drift(router: KvRoutingPolicy) -> None:
        mine, real = router.sequences.totals(targets), truth.totals(targets)
        for name, a, b in zip(drift, mine, real, strict=True):
            drift[name].extend(x - y for x, y in zip(a, b, strict=True))

    for when, batch in stream:
        for _, p in pairs:
            timeline.at(when, lambda p=p, batch=batch: p.apply_kv_events(batch))  # type: ignore[misc]
    for n, (t, tokens) in enumerate(requests):
        timeline.at(t, lambda n=n, tokens=tokens: arrive(n, tokens))  # type: ignore[misc]
    timeline.run(clock)
    leftover = [p.sequences.num_requests() for _, p in pairs]
    hits = sum(p.counters.num_hit_blocks for _, p in pairs)
    blocks = sum(p.counters.num_request_blocks for _, p in pairs)
    return {
        "decisions": decisions,
        "hit_blocks_rate": hits / blocks,
        "requests_left_in_flight": leftover,
        "drift": {
            name: {"mean": statistics.fmean(v), "mean_abs": statistics.fmean(map(abs, v))} for name, v in drift.items()
        },
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--rate", type=float, default=25.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--capacity", type=int, default=512, help="KV blocks per worker")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--suffix-tokens", type=int, default=100)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--ttft-ms", type=float, default=60.0)
    p.add_argument("--lifetime-s", type=float, default=1.5)
    p.add_argument("--event-delay-ms", type=float, default=5.0)
    p.add_argument("--sync-delay-ms", type=float, default=1.0)
    p.add_argument("--cost", default="time")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--json", default=str(harness.results_path("router_replicas")))
    args = p.parse_args(argv)
    load_start = harness.loadavg()
    requests = make_requests(args)
    ref = reference(args, requests)
    out: dict[str, Any] = {"args": vars(args), "reference_hit_blocks_rate": ref["hit_blocks_rate"]}
    for name, synced in (("synced", True), ("unsynced", False)):
        world = replicas(args, requests, ref["stream"], synced)
        same = [a == b for a, b in zip(world.pop("decisions"), ref["decisions"], strict=True)]
        decided = [agree for agree, tie in zip(same, ref["random_ties"], strict=True) if not tie]
        out[name] = {
            "agreement": sum(same) / len(same),
            "agreement_without_random_ties": sum(decided) / max(1, len(decided)),
            **world,
        }
    print(json.dumps(out, indent=2))
    harness.write_results("router_replicas", out, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
