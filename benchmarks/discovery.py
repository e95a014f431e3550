"""Benchmark the multi-node planes: NATS KV-event throughput and latency, and lease-expiry removal.

    python benchmarks/discovery.py [--events-per-publisher 50000] [--json benchmarks/out/discovery.json]

1. NATS throughput: 8 publisher processes (workers) each send N KV events as fast as they can on
   `namespace.bench.component.w{i}.kv-events`; one subscriber (the router) decodes every event.
   events/s = events received / (last arrival - first arrival). Bar: >= 50,000 events/s.
   Run twice: core NATS, and with the subjects captured by a JetStream stream (as KV events are),
   then a late router replays that whole stream (`subscribe_replay`): ingestion with no publisher.
   Publishers run at nice 10: in a deployment they are on other hosts, not on the router's cores.
2. NATS latency: the same 8 publishers at fixed total rates (5,000 and 20,000 events/s); each
   event carries its send time (CLOCK_MONOTONIC is one clock for every process of a Linux host);
   p50/p99 of arrival - send. (At max rate the latency columns only measure the backlog.)
3. Removal: a process registers a leased key and is SIGKILLed; time until the watcher sees the
   DELETE, on etcd and on the embedded backend. Bar: <= TTL + 2 s.

It starts its own nats-server and etcd (benchmarks/harness.py) on free loopback ports.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import harness
import msgspec

from dynamo_cli.runtime.discovery import WatchKind
from dynamo_cli.runtime.nats import NatsEventBus
from dynamo_cli.runtime.planes import open_discovery

NUM_PUBLISHERS = 8
SUBJECTS = "namespace.bench.component.*.kv-events"
THROUGHPUT_BAR = 50_000
JETSTREAM = "bench-kv-events"


class KvEvent(msgspec.Struct, array_like=True):
    """A stored-blocks event as a worker would send it: ~100 bytes of msgpack."""

    worker_id: int
    event_id: int
    sent_ns: int
    parent_hash: int
    block_hashes: list[int]


PUBLISHER = """
import asyncio, os, sys, time, msgspec
# Workers run on other hosts in a deployment; here they share the router's two cores, so they
# yield the CPU to it rather than starve it (os.nice), which would measure the box, not the router.
os.nice(10)
from dynamo_cli.runtime.nats import NatsEventBus

async def main(url, worker, count, rate):
    bus = NatsEventBus(url)
    await bus.start()
    go = await bus.subscribe("bench.go")
    print("ready", flush=True)
    await anext(aiter(go))
    subject = f"namespace.bench.component.w{worker}.kv-events"
    encode = msgspec.msgpack.Encoder().encode
    hashes = [(worker << 48) + i for i in range(4)]
    started = time.monotonic()
    for i in range(count):
        if rate and i % 10 == 0:  # paced: sleep until this event's slot
            delay = started + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        # the wire form of KvEvent (array_like): worker_id, event_id, sent_ns, parent_hash, block_hashes
        await bus.publish(subject, encode([worker, i, time.monotonic_ns(), i, hashes]))
        if i % 1000 == 999:
            await asyncio.sleep(0)  # let the client's flusher run
    await bus.close()
    print("done", flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
"""


async def run_nats_phase(url: str, count: int, rate_per_publisher: float, jetstream: bool) -> dict[str, float]:
    """Start the publishers, release them together, and receive every event in this process."""
    router = NatsEventBus(url)
    await router.start()
    if jetstream:
        await router.ensure_stream(JETSTREAM, [SUBJECTS])
    subscription = await router.subscribe(SUBJECTS)
    publishers = [
        subprocess.Popen(
            [sys.executable, "-c", PUBLISHER, url, str(w), str(count), str(rate_per_publisher)],
            stdout=subprocess.PIPE,
        )
        for w in range(NUM_PUBLISHERS)
    ]
    decode = msgspec.msgpack.Decoder(KvEvent).decode
    expected = NUM_PUBLISHERS * count
    latencies_ns: list[int] = []
    first_last_ns = [0, 0]

    async def consume() -> None:
        # NOTE: the router's loop, kept lean: decode every event, stamp its arrival.
        async for _, payload in subscription:
            now_ns = time.monotonic_ns()
            latencies_ns.append(now_ns - decode(payload).sent_ns)
            first_last_ns[0] = first_last_ns[0] or now_ns
            first_last_ns[1] = now_ns

    try:
        for proc in publishers:
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        consumer = asyncio.create_task(consume())
        await router.publish("bench.go", b"go")
        for proc in publishers:
            await asyncio.to_thread(proc.wait, 120)
        await _wait_until_quiet(lambda: len(latencies_ns) + subscription.dropped, expected)
        await subscription.close()
        await asyncio.wait_for(consumer, 10)
    finally:
        for proc in publishers:
            proc.kill()
            proc.wait()
        await router.close()
    received = len(latencies_ns)
    first, last = first_last_ns[0] / 1e9, first_last_ns[1] / 1e9
    latencies_ms = sorted(x / 1e6 for x in latencies_ns)
    return {
        "events_expected": expected,
        "events_received": received,
        "events_dropped": subscription.dropped,
        "messages_lost": expected - received - subscription.dropped,
        "seconds": round(last - first, 3),
        "events_per_s": round(received / (last - first)) if last > first else 0,
        "latency_p50_ms": round(statistics.median(latencies_ms), 3),
        "latency_p99_ms": round(latencies_ms[int(0.99 * (len(latencies_ms) - 1))], 3),
    }


async def _wait_until_quiet(progress: Callable[[], int], target: int, quiet_s: float = 2.0) -> None:
    """Until progress() reaches target, or stops moving for quiet_s (events were lost)."""
    last, last_change = -1, time.monotonic()
    while progress() < target and time.monotonic() - last_change < quiet_s:
        if progress() != last:
            last, last_change = progress(), time.monotonic()
        await asyncio.sleep(0.05)


async def run_replay_phase(url: str, expected: int) -> dict[str, float]:
    """A late router reads the whole stream back: its ingestion rate with no publisher competing."""
    router = NatsEventBus(url)
    await router.start()
    decode = msgspec.msgpack.Decoder(KvEvent).decode
    received = 0
    try:
        started = time.monotonic()
        subscription = await router.subscribe_replay(SUBJECTS, stream=JETSTREAM, start_seq=1)
        async with asyncio.timeout(120):
            async for _, payload in subscription:
                decode(payload)
                received += 1
                if received + subscription.dropped >= expected:
                    break
        seconds = time.monotonic() - started
    finally:
        await router.close()
    return {
        "events_expected": expected,
        "events_received": received,
        "events_dropped": subscription.dropped,
        "seconds": round(seconds, 3),
        "events_per_s": round(received / seconds),
        "latency_p50_ms": float("nan"),
        "latency_p99_ms": float("nan"),
    }


OWNER = """
import asyncio, sys
from dynamo_cli.runtime.planes import open_discovery


async def main():
    discovery = open_discovery(sys.argv[1], ttl=float(sys.argv[2]))
    await discovery.start()
    await discovery.put("v1/instances/bench/backend/generate/" + format(discovery.lease_id, "x"), b"w")
    print("ready", flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


async def measure_removal(url: str, ttl: float) -> float:
    """Seconds from SIGKILL of a registered process to the watcher's DELETE."""
    watcher = open_discovery(url, ttl=ttl)
    await watcher.start()
    owner = subprocess.Popen([sys.executable, "-c", OWNER, url, str(ttl)], stdout=subprocess.PIPE)
    events = aiter(watcher.watch("v1/instances/bench/"))
    try:
        assert owner.stdout is not None and owner.stdout.readline() == b"ready\n"
        async with asyncio.timeout(10):
            while (await anext(events)).kind is not WatchKind.PUT:
                pass
        os.kill(owner.pid, signal.SIGKILL)
        killed = time.monotonic()
        async with asyncio.timeout(ttl + 10):
            while (await anext(events)).kind is not WatchKind.DELETE:
                pass
        return round(time.monotonic() - killed, 3)
    finally:
        await events.aclose()  # type: ignore[attr-defined]
        owner.kill()
        owner.wait()
        await watcher.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events-per-publisher", type=int, default=50_000)
    parser.add_argument(
        "--latency-rates", type=float, nargs="+", default=[5_000, 20_000], help="total events/s, paced phases"
    )
    parser.add_argument("--ttl", type=float, default=10.0, help="lease TTL for the removal phase (s)")
    parser.add_argument("--json", type=Path, default=harness.results_path("discovery"))
    args = parser.parse_args()

    results: dict[str, dict[str, float]] = {}
    load_start = harness.loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        nats = harness.start_nats(Path(tmp))
        etcd = harness.start_etcd(Path(tmp))
        try:
            n = args.events_per_publisher
            results["nats core, max rate"] = await run_nats_phase(nats.url, n, 0, jetstream=False)
            results["nats + jetstream, max rate"] = await run_nats_phase(nats.url, n, 0, jetstream=True)
            expected = NUM_PUBLISHERS * n
            results["jetstream replay, late router"] = await run_replay_phase(nats.url, expected)
            for rate in args.latency_rates:
                paced = rate / NUM_PUBLISHERS
                name = f"nats core, paced {rate:,.0f}/s"
                results[name] = await run_nats_phase(nats.url, int(paced * 5), paced, jetstream=False)
            results["removal etcd"] = {"seconds": await measure_removal(etcd.url, args.ttl), "ttl": args.ttl}
            embedded = f"file://{Path(tmp) / 'embedded'}"
            results["removal embedded"] = {
                "seconds": await measure_removal(embedded, args.ttl),
                "ttl": args.ttl,
            }
        finally:
            nats.stop()
            etcd.stop()

    print(f"{'phase':<28} {'events/s':>9} {'received':>9} {'dropped':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for name, row in results.items():
        if "events_per_s" in row:
            counts = f"{row['events_per_s']:>9,} {row['events_received']:>9,} {row['events_dropped']:>8,}"
            print(f"{name:<28} {counts} {row['latency_p50_ms']:>8.2f} {row['latency_p99_ms']:>8.2f}")
    for name, row in results.items():
        if "ttl" in row:
            print(f"{name:<28} SIGKILL -> DELETE {row['seconds']:.2f} s (ttl {row['ttl']:g} s)")
    best = max(r.get("events_per_s", 0) for r in results.values())
    print(f"throughput bar >= {THROUGHPUT_BAR:,} events/s: {'met' if best >= THROUGHPUT_BAR else 'NOT met'}")
    harness.write_results("discovery", results, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    asyncio.run(main())
