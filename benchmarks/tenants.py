"""A noisy neighbour: tenant A floods long prompts while tenant B sends short requests; what B's first tokens look
like with the router queue's fair shares on and off (issue 52, item 3).

Mocker deployments of `--workers` (3) workers that take `--max-inflight-per-worker` (1) request each, so that no
short request shares a batch step with a long prefill (with 2 a worker, B's p50 triples from that alone: physics,
not the queue) and a busy deployment queues in the frontend's router queue (`--router-queue-timeout 30`, room
for every client); an `--api-key-file` whose two keys are the tenants a and b (a's line with `max-inflight=` in
fair+limit only). A: `--a-clients` closed-loop clients, each `--a-words` fresh words (no cache to find) and
`--a-osl` tokens, again at once after an answer (and 50 ms after a 429), many times its share. B: open loop,
Poisson at `--b-rate` req/s, `--b-words` words and `--b-osl` tokens.
Both are the default class unless a mode says otherwise. Modes, each on a fresh deployment:

  b-alone      B only: the floor
  fifo         A and B, `--no-tenant-fair-share`: one lane per class, first come first served
  fair         A and B, fair shares on (the default): the tenant that did the least work goes first
  fair-again   `fair` once more: the A/A pair, the noise floor of every ratio
  fair+limit   `fair`, and A's key `max-inflight=` `--a-limit`: A's overflow gets 429s naming the limit
  interactive  `fair`, B's requests `x-dyn-priority-class: interactive` (class above fairness): B waits for the
               next worker to free
  preempt      `interactive`, and A's requests `bulk`: B preempts a running A request (which resumes later)

Per mode: B's TTFT p50/p90/p99 and its ratio to `b-alone` (within the repeat), B's and A's completed requests,
their 429s and 503s, and the requests lost (neither answered nor refused: a transport error or a stream that
ended without its usage; must be 0). Modes alternate per repeat, reversed every other one; the ratios are
medians over repeats. Issue 52's bar: B's TTFT p99 within 1.5x of B alone.

    python benchmarks/tenants.py [--repeats 2] [--duration 20] [--json benchmarks/out/tenants.json]
    python benchmarks/tenants.py --repeats 1 --duration 5 --modes b-alone,fair   # a smoke run

Defaults take about 4 minutes. Traffic is 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import httpx


@dataclass(frozen=True)
class Mode:
    floods: bool = True
    """Whether A floods."""
    flags: tuple[str, ...] = ()
    """Extra `dyn serve` flags."""
    a_key: tuple[str, ...] = ()
    """Extra attributes of A's key file line."""
    b_class: str | None = None
    a_class: str | None = None


MODES = {
    "b-alone": Mode(floods=False),
    "fifo": Mode(flags=("--no-tenant-fair-share",)),
    "fair": Mode(),
    "fair-again": Mode(),
    "fair+limit": Mode(a_key=("max-inflight={a_limit}",)),
    "interactive": Mode(b_class="interactive"),
    "preempt": Mode(b_class="interactive", a_class="bulk"),
}
KEYS = {"a": "sk-bench-tenant-a-0000", "b": "sk-bench-tenant-b-0000"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help="of: " + ", ".join(MODES))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of B's arrivals per mode")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--max-inflight-per-worker", type=int, default=1)
    p.add_argument("--a-clients", type=int, default=12)
    p.add_argument("--a-words", type=int, default=1500)
    p.add_argument("--a-osl", type=int, default=32)
    p.add_argument("--a-limit", type=int, default=1, help="A's in-flight limit in fair+limit")
    p.add_argument("--b-rate", type=float, default=3.0)
    p.add_argument("--b-words", type=int, default=20)
    p.add_argument("--b-osl", type=int, default=8)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", default=str(harness.results_path("tenants")))
    return p.parse_args(argv)


async def call(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[str, float]:
    """One streamed chat request: ("ok", TTFT), ("429"|"503", 0), or ("lost", 0)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start, ttft, usage = time.perf_counter(), 0.0, None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as reply:
            if reply.status_code in (429, 503):
                return str(reply.status_code), 0.0
            if reply.status_code != 200:
                return "lost", 0.0
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                if not ttft and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    ttft = time.perf_counter() - start
                usage = chunk.get("usage") or usage
    except httpx.HTTPError:
        return "lost", 0.0
    return ("ok", ttft) if usage is not None and ttft else ("lost", 0.0)


def request(rng: random.Random, words: int, osl: int) -> dict[str, Any]:
    prompt = " ".join(f"w{rng.randrange(5000)}" for _ in range(words))
    messages = [{"role": "user", "content": prompt}]
    return {"model": "smollm2", "max_tokens": osl, "ignore_eos": True, "messages": messages}


async def drive(url: str, args: argparse.Namespace, mode: str, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    counts: dict[str, dict[str, int]] = {t: {"ok": 0, "429": 0, "503": 0, "lost": 0} for t in "ab"}
    b_ttfts: list[float] = []
    floods, b_class, a_class = MODES[mode].floods, MODES[mode].b_class, MODES[mode].a_class
    a_headers = {"Authorization": f"Bearer {KEYS['a']}", **({"x-dyn-priority-class": a_class} if a_class else {})}
    b_headers = {"Authorization": f"Bearer {KEYS['b']}", **({"x-dyn-priority-class": b_class} if b_class else {})}
    stop = asyncio.Event()

    async def flood(client: httpx.AsyncClient, own: random.Random) -> None:
        while not stop.is_set():
            outcome, _ = await call(client, url, request(own, args.a_words, args.a_osl), a_headers)
            counts["a"][outcome] += 1
            if outcome != "ok":
                await asyncio.sleep(0.05)

    async def b_one(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        outcome, ttft = await call(client, url, body, b_headers)
        counts["b"][outcome] += 1
        if outcome == "ok":
            b_ttfts.append(ttft)

    limits = httpx.Limits(max_connections=args.a_clients + 64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await b_one(client, request(rng, args.b_words, args.b_osl))  # warm: a connection, the tokenizer
        b_ttfts.clear()
        counts["b"]["ok"] = 0
        clients = args.a_clients if floods else 0
        flooders = [asyncio.create_task(flood(client, random.Random(f"{seed}:{i}"))) for i in range(clients)]
        await asyncio.sleep(2.0 if floods else 0.0)  # A fills the workers and the queue
        sent, end = [], time.perf_counter() + args.duration
        while (now := time.perf_counter()) < end:
            sent.append(asyncio.create_task(b_one(client, request(rng, args.b_words, args.b_osl))))
            await asyncio.sleep(min(rng.expovariate(args.b_rate), max(0.0, end - now)))
        await asyncio.gather(*sent)
        stop.set()
        await asyncio.gather(*flooders)
    return _summary(b_ttfts, counts)


def _summary(b_ttfts: list[float], counts: dict[str, dict[str, int]]) -> dict[str, Any]:
    ttfts = sorted(b_ttfts)
    quantiles = {f"b_ttft_p{round(100 * q)}_ms": 1e3 * _pct(ttfts, q) for q in (0.5, 0.9, 0.99)}
    return {**quantiles, "a": counts["a"], "b": counts["b"]}


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run_one(mode: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    import uvloop

    flags = ["--engine", "mocker", "--workers", str(args.workers), "--router", "kv", "--host", "127.0.0.1"]
    flags += MODES[mode].flags
    flags += ["--speedup-ratio", str(args.speedup), "--max-inflight-per-worker", str(args.max_inflight_per_worker)]
    flags += ["--router-queue-timeout", "30", "--router-queue-size", str(4 * args.a_clients + 256)]
    a_key = " ".join([KEYS["a"], "tenant=a", *(a.format(a_limit=args.a_limit) for a in MODES[mode].a_key)])
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "keys").write_text(f"{a_key}\n{KEYS['b']} tenant=b\n")
        flags += ["--discovery", f"file://{tmp}/d", "--api-key-file", f"{tmp}/keys"]
        with harness.serving(flags, Path(tmp) / "serve.log", min_instances=args.workers) as serve:
            time.sleep(1.0)
            row = uvloop.run(drive(serve.url, args, mode, seed))
    row["mode"] = mode
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start_load = harness.loadavg()
    modes = args.modes.split(",")
    runs = harness.alternated(modes, args.repeats, lambda m, r: run_one(m, args, args.seed + r), _line)
    medians: dict[str, float] = {}
    for mode in modes:
        ratios = [r[mode]["b_ttft_p99_ms"] / r["b-alone"]["b_ttft_p99_ms"] for r in runs if {mode, "b-alone"} <= set(r)]
        if ratios and mode != "b-alone":
            medians[f"{mode}_over_alone_b_ttft_p99"] = statistics.median(ratios)
    if {"fair", "fair-again"} <= set(modes):
        medians["fair_again_over_fair_b_ttft_p99"] = statistics.median(
            r["fair-again"]["b_ttft_p99_ms"] / r["fair"]["b_ttft_p99_ms"] for r in runs
        )
    harness.print_table([{"repeat": i + 1, **_cells(row)} for i, rows in enumerate(runs) for row in rows.values()])
    harness.print_table([{"ratio": name, "median": f"{value:.2f}"} for name, value in medians.items()])
    lost = sum(row[t]["lost"] for rows in runs for row in rows.values() for t in "ab")
    checks = {"none_lost": lost == 0}
    for mode in ("fair+limit", "preempt"):
        if f"{mode}_over_alone_b_ttft_p99" in medians:
            checks[f"{mode}_b_ttft_p99_within_1_5x_alone"] = medians[f"{mode}_over_alone_b_ttft_p99"] <= 1.5
    print("bar:", checks)
    harness.write_results(
        "tenants",
        {"runs": runs, "medians": medians, "bar": checks, "args": vars(args)},
        args.json,
        loadavg_start=start_load,
    )


def _cells(row: dict[str, Any]) -> dict[str, str]:
    a, b = row["a"], row["b"]
    return {
        "mode": row["mode"],
        "B TTFT p50 ms": f"{row['b_ttft_p50_ms']:.0f}",
        "B TTFT p90 ms": f"{row['b_ttft_p90_ms']:.0f}",
        "B TTFT p99 ms": f"{row['b_ttft_p99_ms']:.0f}",
        "B ok/429/503/lost": f"{b['ok']}/{b['429']}/{b['503']}/{b['lost']}",
        "A ok/429/503/lost": f"{a['ok']}/{a['429']}/{a['503']}/{a['lost']}",
    }


def _line(row: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in _cells(row).items() if k != "mode")


if __name__ == "__main__":
    main()
