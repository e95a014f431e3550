"""Issue 36, item 2: does the KV router's decision gain from leaving the frontend's event loop?

The workload of benchmarks/decision_cpu.py (40 system prompts of 2,000 tokens plus 100 unique tokens, block size 64,
every prompt cached on one of W workers, 8 requests in flight per worker); one decision is `select` +
`on_first_token` + `on_finish`. Three ways to run it, each driven by `--concurrency` coroutines on one asyncio loop
(as the frontend's requests are):

    inline   on the loop (what the frontend does)
    thread   in a one-thread executor (`run_in_executor`): the loop hands the prompt over and awaits the choice
    process  in a child process that keeps the policy: the prompt goes over a socket (msgpack), the choice back

Per decision it reports the CPU of the loop's thread (what is taken off the hot loop), the CPU of the whole
process tree (what it costs in all) and the wall time per decision (decisions are serialized in every mode: one
policy). A mode pays off only if it takes more CPU off the loop than it adds around it.

    python benchmarks/investigations/select_offload.py [--workers 4] [--decisions 3000] [--rounds 3] [--json ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (the one path insert: harness.py)
import harness  # noqa: E402

from dynamo_cli.config import KvRouterConfig
from dynamo_cli.kv.hashing import sequence_hashes
from dynamo_cli.routing.base import RouteRequest
from dynamo_cli.routing.kv_policy import KvRoutingPolicy
from dynamo_cli.routing.target import targets_of

BLOCK_SIZE = 64
TICK = os.sysconf("SC_CLK_TCK")


class Decider:
    """The policy over the workload, and one decision at a time."""

    def __init__(self, workers: int, seed: int) -> None:
        rng = random.Random(seed)
        prompts = [[rng.randrange(32_000) for _ in range(2000)] for _ in range(40)]
        self.requests = [rng.choice(prompts) + [rng.randrange(32_000) for _ in range(100)] for _ in range(4000)]
        self.policy = KvRoutingPolicy(KvRouterConfig(block_size=BLOCK_SIZE, total_kv_blocks=16_384), rng=rng)
        self.targets, self.in_flight = targets_of(range(workers)), 8 * workers
        for n, prompt in enumerate(prompts):
            self.policy.indexer.store_blocks(self.targets[n % workers], sequence_hashes(prompt, BLOCK_SIZE))

    def decide(self, n: int, token_ids: list[int]) -> int:
        decision = self.policy.select(RouteRequest(f"r{n}", token_ids), self.targets)
        self.policy.on_first_token(f"r{n - self.in_flight // 2}")
        self.policy.on_finish(f"r{n - self.in_flight}")
        return decision.worker_id


def tree_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


async def drive(decide: Any, decider: Decider, count: int, concurrency: int) -> None:
    """`count` decisions from `concurrency` coroutines; `decide(n, token_ids)` is awaited."""
    numbers = iter(range(count))

    async def client() -> None:
        for n in numbers:
            await decide(n, decider.requests[n % len(decider.requests)])

    await asyncio.gather(*(client() for _ in range(concurrency)))


##### process mode: the policy in a child, a length-prefixed msgpack request/reply over a socket


def serve_child(fd: int, workers: int, seed: int) -> None:
    decider, sock = Decider(workers, seed), socket.socket(fileno=fd)
    decode, encode = msgspec.msgpack.Decoder(tuple[int, list[int]]).decode, msgspec.msgpack.Encoder().encode
    stream = sock.makefile("rb")
    while header := stream.read(4):
        n, token_ids = decode(stream.read(struct.unpack("<I", header)[0]))
        reply = encode(decider.decide(n, token_ids))
        sock.sendall(struct.pack("<I", len(reply)) + reply)


class Remote:
    """The loop's side of process mode: one request in flight at a time (one policy), in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.lock = reader, writer, asyncio.Lock()
        self.encode = msgspec.msgpack.Encoder().encode

    async def decide(self, n: int, token_ids: list[int]) -> int:
        body = self.encode((n, token_ids))
        async with self.lock:
            self.writer.write(struct.pack("<I", len(body)) + body)
            size = struct.unpack("<I", await self.reader.readexactly(4))[0]
            return int(msgspec.msgpack.decode(await self.reader.readexactly(size)))


async def measure(mode: str, args: argparse.Namespace) -> dict[str, float]:
    decider = Decider(args.workers, args.seed)
    pids, child = [os.getpid()], None
    executor = ThreadPoolExecutor(1)
    if mode == "inline":

        async def decide(n: int, token_ids: list[int]) -> int:
            return decider.decide(n, token_ids)

    elif mode == "thread":
        loop = asyncio.get_running_loop()

        async def decide(n: int, token_ids: list[int]) -> int:
            return await loop.run_in_executor(executor, decider.decide, n, token_ids)

    else:
        ours, theirs = socket.socketpair()
        code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import select_offload as s; "
        code += f"s.serve_child({theirs.fileno()}, {args.workers}, {args.seed})"
        child = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()])
        theirs.close()
        remote = Remote(*await asyncio.open_connection(sock=ours))
        pids.append(child.pid)
        decide = remote.decide
    try:
        await drive(decide, decider, 200, args.concurrency)  # warm up (the child: its policy built)
        loop0, tree0, wall0 = time.thread_time(), tree_cpu(pids), time.perf_counter()
        await drive(decide, decider, args.decisions, args.concurrency)
        loop1, tree1, wall1 = time.thread_time(), tree_cpu(pids), time.perf_counter()
    finally:
        executor.shutdown()
        if child is not None:
            remote.writer.close()
            await remote.writer.wait_closed()  # the child reads the end of its socket and exits
            child.wait(10)
    per = 1e6 / args.decisions
    return {"loop_us": (loop1 - loop0) * per, "total_us": (tree1 - tree0) * per, "wall_us": (wall1 - wall0) * per}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--decisions", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(harness.results_path("select_offload")))
    args = p.parse_args()
    load_start = harness.loadavg()
    modes = ["inline", "thread", "process"]
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for rnd in range(args.rounds):
        for mode in modes if rnd % 2 == 0 else modes[::-1]:
            runs[mode].append(asyncio.run(measure(mode, args)))
            print(f"round {rnd} {mode}: " + "  ".join(f"{k} {v:.1f}" for k, v in runs[mode][-1].items()), flush=True)
    print("\n| mode | loop CPU µs/decision | all CPU µs/decision | wall µs/decision |\n|---|---|---|---|")
    medians = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    for mode, m in medians.items():
        print(f"| {mode} | {m['loop_us']:.1f} | {m['total_us']:.1f} | {m['wall_us']:.1f} |")
    results = {"args": vars(args), "runs": runs, "medians": medians}
    harness.write_results("select_offload", results, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
