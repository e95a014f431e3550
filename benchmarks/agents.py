"""Agent sessions under cache pressure: session affinity against plain KV routing and round-robin.

Mocker deployments of 4 workers, driven by S concurrent agent sessions: each session makes N calls, each call's
prompt the session's whole context so far (a system prompt, then every earlier call's tool output, ~300 tokens a
call) plus the new instruction, with a "tool" gap between calls drawn from an exponential distribution. The
sessions together hold more context than one worker's cache, not than the four's, so where a call lands decides
whether its context is found.

  affinity+retain  affinity, and every call but the last hints `nvext.agent_hints.resume_after_s` (twice the mean
               tool time): the worker keeps its blocks pinned for the next call (engines/mocker/kv_manager.py)
  affinity     `--router kv` and every call carries `x-dyn-session-id` (soft affinity, routing/sessions.py)
  kv           `--router kv`, no session header: the KV cost alone follows the context
  round-robin  `--router round-robin`, no session header
  affinity+retain+host, kv+host  (not run by default) those modes with a host tier on every worker
               (`--kv-host-cache-gb`, `--host-gb`): evicted blocks are offloaded there, and a later hit onboards
               them instead of computing them

Per mode: the hit rate of calls 2..N (cached tokens over prompt tokens), the same as a share of what was reachable
(the previous call's prompt, which the session's worker computed), TTFT p50/p90 of calls 2..N, and req/s. Modes
alternate per repeat (reversed every other one); the ratios are medians over repeats, each within one repeat.
Issue 52's bar: hit rate per call >= 85 % of the reachable rate, and TTFT p90 of later calls >= 1.5x better than
plain KV routing under pressure.

    python benchmarks/agents.py [--repeats 2] [--sessions 32] [--calls 12] [--json benchmarks/out/agents.json]
    python benchmarks/agents.py --repeats 1 --sessions 4 --calls 4 --modes affinity,kv   # a smoke run

Defaults take about 5 minutes. Traffic is 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import httpx
from multimodal import one

MODES: dict[str, tuple[str, bool, bool, bool]] = {
    "affinity+retain": ("kv", True, True, False),
    "affinity": ("kv", True, False, False),
    "kv": ("kv", False, False, False),
    "round-robin": ("round-robin", False, False, False),
    "affinity+retain+host": ("kv", True, True, True),
    "kv+host": ("kv", False, False, True),
}
"""Mode -> (router, whether calls carry their session id, whether they hint their resume, whether the workers
have a host tier (`--host-gb`) that evicted blocks go to)."""
DEFAULT_MODES = "affinity+retain,affinity,kv,round-robin"
WORDS = "read edit test build lint grep diff commit patch file line error trace stack module function class".split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=DEFAULT_MODES, help="of: " + ", ".join(MODES))
    p.add_argument("--host-gb", type=float, default=2.0, help="the host tier of the +host modes, per worker")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--sessions", type=int, default=32, help="concurrent agent sessions")
    p.add_argument("--calls", type=int, default=12, help="calls per session")
    p.add_argument("--system-words", type=int, default=400)
    p.add_argument("--tool-words", type=int, default=300, help="words a call adds to the context")
    p.add_argument("--gap-s", type=float, default=0.5, help="mean tool time between calls (exponential)")
    p.add_argument("--max-tokens", type=int, default=30)
    p.add_argument("--num-gpu-blocks", type=int, default=320, help="KV blocks per worker")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", default=str(harness.results_path("agents")))
    return p.parse_args(argv)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def session(
    client: httpx.AsyncClient,
    url: str,
    name: str,
    args: argparse.Namespace,
    mode: tuple[bool, bool],
    rng: random.Random,
) -> list[dict[str, float]]:
    """One agent: N calls over a growing context; each call's TTFT, prompt and cached tokens."""
    context = f"{name}: you are a coding agent. " + words(rng, args.system_words)
    header, retain = mode
    headers = {"x-dyn-session-id": name} if header else {}
    rows: list[dict[str, float]] = []
    previous_prompt = 0
    for n in range(args.calls):
        instruction = f" Call {n}: " + words(rng, 12)
        body: dict[str, Any] = {
            "model": "smollm2",
            "max_tokens": args.max_tokens,
            "messages": [{"role": "user", "content": context + instruction}],
        }
        if retain and n < args.calls - 1:
            body["nvext"] = {"agent_hints": {"resume_after_s": 2 * args.gap_s}}
        row = await one(client, url, body, headers)
        if row is not None:
            reachable = previous_prompt // args.block_size * args.block_size  # the last call's full blocks
            rows.append({**row, "call": n, "reachable": reachable})
            previous_prompt = int(row["prompt"])
        context += instruction + " Tool output: " + words(rng, args.tool_words)
        await asyncio.sleep(rng.expovariate(1 / args.gap_s))
    return rows


async def drive(url: str, args: argparse.Namespace, mode: tuple[bool, bool], seed: int) -> dict[str, Any]:
    started = time.perf_counter()
    limits = httpx.Limits(max_connections=args.sessions * 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        runs = await asyncio.gather(
            *(
                session(client, url, f"agent-{seed}-{i}", args, mode, random.Random(f"{seed}:{i}"))
                for i in range(args.sessions)
            )
        )
    elapsed = time.perf_counter() - started
    later = [r for rows in runs for r in rows if r["call"] > 0]
    ttfts = sorted(r["ttft"] for r in later)
    hit = sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later))
    reachable = sum(r["reachable"] for r in later) / max(1, sum(r["prompt"] for r in later))
    return {
        "calls": sum(len(rows) for rows in runs),
        "req_per_s": sum(len(rows) for rows in runs) / elapsed,
        "later_ttft_p50_ms": 1e3 * _pct(ttfts, 0.5),
        "later_ttft_p90_ms": 1e3 * _pct(ttfts, 0.9),
        "later_hit_rate": hit,
        "reachable_rate": reachable,
        "share_of_reachable": hit / reachable if reachable else float("nan"),
    }


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _kvbm_sum(url: str, series: str) -> int:
    """A `kvbm_*` series of the frontend's /metrics, summed over the workers (the host tier's own account)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + "{")))


def run_one(mode: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    import uvloop

    router, header, retain, host = MODES[mode]
    flags = ["--engine", "mocker", "--workers", str(args.workers), "--router", router, "--host", "127.0.0.1"]
    flags += ["--speedup-ratio", str(args.speedup), "--block-size", str(args.block_size)]
    flags += ["--num-gpu-blocks", str(args.num_gpu_blocks)]
    flags += ["--kv-host-cache-gb", str(args.host_gb)] if host else []
    with tempfile.TemporaryDirectory() as tmp:
        flags += ["--discovery", f"file://{tmp}/d"]
        with harness.serving(flags, Path(tmp) / "serve.log", min_instances=args.workers) as serve:
            time.sleep(1.0)
            row = uvloop.run(drive(serve.url, args, (header, retain), seed))
            row["host_onboarded_blocks"] = _kvbm_sum(serve.url, "kvbm_onboard_blocks_h2d") if host else 0
            row["host_offloaded_blocks"] = _kvbm_sum(serve.url, "kvbm_offload_blocks_d2h") if host else 0
    row["mode"] = mode
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start_load = harness.loadavg()
    runs = harness.alternated(args.modes.split(","), args.repeats, lambda m, r: run_one(m, args, args.seed + r), _line)
    medians: dict[str, float] = {}
    for best in ("affinity+retain", "affinity", "affinity+retain+host"):
        for other in ("kv", "round-robin", "kv+host"):
            ratios = [
                r[other]["later_ttft_p90_ms"] / r[best]["later_ttft_p90_ms"] for r in runs if {other, best} <= set(r)
            ]
            if ratios:
                medians[f"{other}_over_{best}_later_ttft_p90"] = statistics.median(ratios)
        shares = [r[best]["share_of_reachable"] for r in runs if best in r]
        if shares:
            medians[f"{best}_share_of_reachable"] = statistics.median(shares)
    harness.print_table([{"repeat": i + 1, **_cells(row)} for i, rows in enumerate(runs) for row in rows.values()])
    harness.print_table([{"ratio": name, "median": f"{value:.2f}"} for name, value in medians.items()])
    checks = {}
    for best in ("affinity+retain", "affinity+retain+host"):
        if f"{best}_share_of_reachable" in medians:
            checks[f"{best}_hit_rate_85_percent_of_reachable"] = medians[f"{best}_share_of_reachable"] >= 0.85
        if f"kv_over_{best}_later_ttft_p90" in medians:
            checks[f"{best}_later_ttft_p90_1_5x_kv"] = medians[f"kv_over_{best}_later_ttft_p90"] >= 1.5
    print("bar:", checks)
    harness.write_results(
        "agents",
        {"runs": runs, "medians": medians, "bar": checks, "args": vars(args)},
        args.json,
        loadavg_start=start_load,
    )


def _cells(row: dict[str, Any]) -> dict[str, str]:
    return {
        "mode": row["mode"],
        "req/s": f"{row['req_per_s']:.2f}",
        "later TTFT p50 ms": f"{row['later_ttft_p50_ms']:.0f}",
        "later TTFT p90 ms": f"{row['later_ttft_p90_ms']:.0f}",
        "hit rate": f"{row['later_hit_rate']:.1%}",
        "reachable": f"{row['reachable_rate']:.1%}",
        "share": f"{row['share_of_reachable']:.1%}",
        "host blocks off/on": f"{row.get('host_offloaded_blocks', 0)}/{row.get('host_onboarded_blocks', 0)}",
    }


def _line(row: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in _cells(row).items() if k != "mode")


if __name__ == "__main__":
    main()
