"""The Batch API beside interactive traffic (issue 39): does a large batch hurt interactive TTFT, and how much of
the capacity interactive traffic leaves does it use?

One `dyn serve --engine mocker --workers 4` (real timing: `--speedup-ratio 1`). First its capacity: a closed
loop of `--probe-concurrency` streaming chat requests (`--isl` words of unique text, `--osl` tokens) for
`--probe-seconds`, in completed requests/s. Then rounds, alternating the two sides: `alone`, interactive
requests in open loop (Poisson) at `--load` × capacity for `--seconds`; `batch`, the same interactive load
while a batch of `--lines` lines of the same shape runs (created before the window, cancelled after it).
Per side: interactive TTFT p50/p99 and requests/s; for `batch`, the batch's lines/s in the window and their
share of the idle capacity, (capacity − interactive requests/s).

    python benchmarks/batch.py [--rounds 2] [--seconds 60] [--lines 20000] [--load 0.6] [--batch-max-inflight 0]
        [--batch-db postgresql://USER@HOST/DB]   # the PostgreSQL store instead of SQLite

The bars (issue 39): TTFT p99 with the batch ≤ 1.1× alone; the batch's share of the idle capacity ≥ 80 %.
The load average at the start and the end is recorded: figures are only valid on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import httpx
import openai

WORDS = "sky river stone light cloud field wind song road tree glass paper iron salt flame snow".split()


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat_body(text: str, osl: int) -> dict[str, Any]:
    return {"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": osl, "stream": False}


async def one(client: httpx.AsyncClient, text: str, osl: int) -> float | None:
    """Send one streaming request; its TTFT (None if it failed)."""
    body = chat_body(text, osl) | {"stream": True}
    started = time.perf_counter()
    ttft = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return None
            async for chunk in response.aiter_lines():
                if ttft is None and chunk.startswith("data: ") and '"content"' in chunk:
                    ttft = time.perf_counter() - started
    except httpx.HTTPError:
        return None
    return ttft


async def closed_loop(url: str, concurrency: int, seconds: float, args: argparse.Namespace) -> float:
    """Completed requests/s of a closed loop (the capacity probe)."""
    rng, done = random.Random(1), 0
    deadline = time.monotonic() + seconds

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            if await one(client, prompt(rng, args.isl), args.osl) is not None:
                done += 1

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
        started = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return done / (time.monotonic() - started)


async def open_loop(url: str, rate: float, seconds: float, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Poisson arrivals at `rate` for `seconds`: TTFTs and completed requests/s."""
    rng = random.Random(seed)
    ttfts: list[float] = []
    failed = 0
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=512)) as client:

        async def send() -> None:
            nonlocal failed
            ttft = await one(client, prompt(rng, args.isl), args.osl)
            if ttft is None:
                failed += 1
            else:
                ttfts.append(ttft)

        tasks = []
        started = time.monotonic()
        next_at = started
        while next_at < started + seconds:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.create_task(send()))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        wall = time.monotonic() - started
    ttfts.sort()
    return {
        "requests_per_s": len(ttfts) / wall,
        "failed": failed,
        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2] if ttfts else float("nan"),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("nan"),
    }


def submit_batch(client: openai.OpenAI, lines: int, seed: int, args: argparse.Namespace) -> str:
    rng = random.Random(seed)
    rows = [
        json.dumps(
            {
                "custom_id": f"b{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": chat_body(prompt(rng, args.isl), args.osl),
            }
        )
        for i in range(lines)
    ]
    upload = client.files.create(file=("batch.jsonl", io.BytesIO("\n".join(rows).encode())), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h").id


def completed(client: openai.OpenAI, batch_id: str) -> int:
    return client.batches.retrieve(batch_id).request_counts.completed  # type: ignore[union-attr]


def side(
    url: str, client: openai.OpenAI, rate: float, seed: int, args: argparse.Namespace, *, batch: bool
) -> dict[str, Any]:
    batch_id = None
    if batch:
        batch_id = submit_batch(client, args.lines, seed, args)
        deadline = time.monotonic() + 120
        while completed(client, batch_id) < 1 and time.monotonic() < deadline:  # running before the window opens
            time.sleep(0.2)
        before, started = completed(client, batch_id), time.monotonic()
    row = asyncio.run(open_loop(url, rate, args.seconds, seed, args))
    if batch_id is not None:
        lines = completed(client, batch_id) - before
        row["batch_lines_per_s"] = lines / (time.monotonic() - started)
        client.batches.cancel(batch_id)
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch_id).status != "cancelled" and time.monotonic() < deadline:
            time.sleep(0.2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0, help="Each side's measured window.")
    parser.add_argument("--lines", type=int, default=20_000, help="Lines of each side's batch.")
    parser.add_argument("--load", type=float, default=0.6, help="Interactive rate, as a share of the capacity.")
    parser.add_argument("--isl", type=int, default=400, help="Words of each prompt.")
    parser.add_argument("--osl", type=int, default=32, help="Tokens of each answer.")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--speedup-ratio", type=float, default=1.0)
    parser.add_argument("--batch-max-inflight", type=int, default=0, help="0: dyn serve's default.")
    parser.add_argument("--probe-concurrency", type=int, default=48)
    parser.add_argument("--probe-seconds", type=float, default=30.0)
    parser.add_argument(
        "--batch-db",
        default="",
        help="The store: '' = a SQLite file in a temporary directory; a postgresql:// URL (password in PGPASSWORD).",
    )
    parser.add_argument("--json", default=str(harness.results_path("batch")))
    args = parser.parse_args()
    load_start = harness.loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--engine", "mocker", "--workers", str(args.workers), "--router", "kv"]
        flags += ["--speedup-ratio", str(args.speedup_ratio), "--discovery", f"file://{tmp}/d"]
        store = args.batch_db or f"{tmp}/batches.db"
        flags += ["--batch-db", store, "--batch-max-inflight", str(args.batch_max_inflight)]
        with harness.serving(flags, Path(tmp) / "serve.log", min_instances=args.workers) as deployment:
            url = deployment.url
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=2, timeout=120)
            capacity = asyncio.run(closed_loop(url, args.probe_concurrency, args.probe_seconds, args))
            rate = args.load * capacity
            print(f"capacity {capacity:.1f} req/s; interactive at {rate:.1f} req/s")
            rows = []
            for round_ in range(args.rounds):
                for with_batch in (False, True):
                    row = side(url, client, rate, 100 + round_, args, batch=with_batch)
                    row |= {"round": round_, "side": "batch" if with_batch else "alone"}
                    if with_batch:
                        row["idle_share"] = row["batch_lines_per_s"] / max(capacity - row["requests_per_s"], 1e-9)
                    rows.append(row)
                    print(row, flush=True)
    alone = [r for r in rows if r["side"] == "alone"]
    busy = [r for r in rows if r["side"] == "batch"]
    summary = {
        "capacity_req_s": capacity,
        "interactive_req_s": rate,
        "ttft_p50_ratio": sum(r["ttft_p50_ms"] for r in busy) / sum(r["ttft_p50_ms"] for r in alone),
        "ttft_p99_ratio": sum(r["ttft_p99_ms"] for r in busy) / sum(r["ttft_p99_ms"] for r in alone),
        "idle_share": sum(r["idle_share"] for r in busy) / len(busy),
    }
    harness.print_table(
        rows,
        ["round", "side", "requests_per_s", "failed", "ttft_p50_ms", "ttft_p99_ms", "batch_lines_per_s", "idle_share"],
    )
    print(json.dumps(summary, indent=2))
    harness.write_results(
        "batch", {"args": vars(args), "rows": rows, "summary": summary}, args.json, loadavg_start=load_start
    )


if __name__ == "__main__":
    main()
