"""Soak: `dyn serve` (mocker workers) under mixed load for minutes; memory must stay flat, nothing lost.

Clients loop over a mix: streams read to the end, unary requests, streams the client abandons after
a few chunks, and hostile bodies that must get a 400. `--max-inflight-per-worker` makes the
deployment shed load, so some requests get a deliberate 503. Every few seconds the resident memory
of the frontend and of each worker is sampled; after the warm-up, growth is
(median of the last 3 samples) / (median of the first 3 after warm-up) - 1.

A request is *lost* when it ends any other way than: 200 with a complete answer (a stream ending
in `data: [DONE]`), a 503 (deliberate overload), a 400 for a hostile body, or the client's own
abandonment. The bar: growth < 5 % for the frontend and every worker, and 0 lost.

    python benchmarks/soak.py [--minutes 10] [--clients 48] [--json benchmarks/out/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import harness
import httpx

PAGE = os.sysconf("SC_PAGE_SIZE")
HOSTILE = [
    b'{"model": "smollm2", "prompt": [4294967296]}',
    b'{"model": "smollm2", "prompt": "x", "seed": -9223372036854775809}',
    b'{"model": "smollm2", "prompt": "x", "top_k": 18446744073709551616}',
    b'{"model": "smollm2", "prompt": "x", "a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "smollm2", "prompt": "\xff\xfe"}',
    b'{"model": "smollm2", "prompt": [49999999]}',
]


def rss_mb(pid: int) -> float:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 2**20


def serve_flags(tmp: str, workers: int) -> list[str]:
    flags = ["--engine", "mocker", "--workers", str(workers), "--discovery", f"file://{tmp}/discovery"]
    return [*flags, "--speedup-ratio", "20", "--max-inflight-per-worker", "16"]


class Tally:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.lost: list[str] = []

    def lose(self, kind: str, detail: str) -> None:
        self.outcomes["lost"] += 1
        if len(self.lost) < 20:
            self.lost.append(f"{kind}: {detail[:200]}")


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally, n: int) -> None:
    roll = rng.random()
    prompt = f"request {n}: " + "tell me a story about the sea " * rng.randint(1, 20)
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": rng.randint(8, 200), "ignore_eos": True}
    if roll < 0.05:
        response = await client.post("/v1/completions", content=rng.choice(HOSTILE))
        ok = response.status_code == 400 and "error" in response.json()
        tally.outcomes["hostile_400" if ok else "lost"] += ok
        if not ok:
            tally.lose("hostile", f"{response.status_code} {response.text}")
        return
    if roll < 0.20:
        response = await client.post("/v1/completions", json=body)
        if response.status_code == 200 and response.json()["choices"][0]["finish_reason"]:
            tally.outcomes["unary_ok"] += 1
        elif response.status_code == 503:
            tally.outcomes["overload_503"] += 1
        else:
            tally.lose("unary", f"{response.status_code} {response.text}")
        return
    abandon_after = rng.randint(1, 5) if roll < 0.30 else None
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code == 503:
            await response.aread()
            tally.outcomes["overload_503"] += 1
            return
        if response.status_code != 200:
            tally.lose("stream", f"{response.status_code} {(await response.aread()).decode(errors='replace')}")
            return
        chunks, last = 0, ""
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                chunks, last = chunks + 1, line
                if abandon_after is not None and chunks >= abandon_after:
                    tally.outcomes["abandoned"] += 1
                    return
        if last == "data: [DONE]":
            tally.outcomes["stream_ok"] += 1
        else:
            tally.lose("stream", f"ended without [DONE] after {chunks} chunks: {last}")


async def client_loop(url: str, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    n = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while time.monotonic() < deadline:
            n += 1
            try:
                await one_request(client, rng, tally, seed * 1_000_000 + n)
            except httpx.HTTPError as exc:
                tally.lose("transport", repr(exc))


async def sampler(pids: dict[str, int], deadline: float, every: float, samples: dict[str, list[float]]) -> None:
    while time.monotonic() < deadline:
        for name, pid in pids.items():
            samples[name].append(rss_mb(pid))
        await asyncio.sleep(every)


def growth(series: list[float], warm: int) -> tuple[float, float, float]:
    after = series[warm:]
    base, end = statistics.median(after[:3]), statistics.median(after[-3:])
    return base, end, 100.0 * (end / base - 1.0)


async def soak(url: str, pids: dict[str, int], args: argparse.Namespace) -> dict[str, object]:
    tally = Tally()
    samples: dict[str, list[float]] = {name: [] for name in pids}
    start = time.monotonic()
    deadline = start + args.minutes * 60
    await asyncio.gather(
        sampler(pids, deadline, args.sample_s, samples),
        *(client_loop(url, seed, deadline, tally) for seed in range(args.clients)),
    )
    warm = max(1, int(args.warmup_s / args.sample_s))
    memory = {name: growth(series, warm) for name, series in samples.items()}
    return {
        "minutes": args.minutes,
        "clients": args.clients,
        "outcomes": dict(tally.outcomes),
        "lost": tally.lost,
        "memory_mb": {k: {"after_warmup": v[0], "end": v[1], "growth_pct": v[2]} for k, v in memory.items()},
        "samples_mb": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--json", default=str(harness.results_path("soak")))
    args = parser.parse_args()
    load_start = harness.loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        with harness.serving(
            serve_flags(tmp, args.workers), Path(tmp) / "serve.log", min_instances=args.workers
        ) as serve:
            pids = {"frontend": serve.pid} | {f"worker{i}": pid for i, pid in enumerate(serve.workers())}
            result = asyncio.run(soak(serve.url, pids, args))
            result["serve_alive"] = serve.proc is not None and serve.proc.poll() is None
    print(f"soak: {args.minutes:g} min, {args.clients} clients")
    print("| process | RSS after warm-up MB | RSS at end MB | growth % |\n|---|---|---|---|")
    for name, m in result["memory_mb"].items():  # type: ignore[union-attr]
        print(f"| {name} | {m['after_warmup']:.1f} | {m['end']:.1f} | {m['growth_pct']:+.2f} |")
    print("outcomes:", json.dumps(result["outcomes"]), "serve alive:", result["serve_alive"])
    for line in result["lost"]:  # type: ignore[union-attr]
        print("LOST", line)
    harness.write_results("soak", result, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
