"""Multi-turn chat against the KV tiers: without tiers, with a host tier, with host + disk (issue 16).

C conversations (`--conversations`, 32) of T turns (`--turns`, 6) run at once: each turn appends a user
message of ~U tokens (`--user-tokens`, 200, +-10 %) to the conversation so far and asks for `--max-tokens`
(32, ignore_eos); between turns the user thinks for an exponential time of mean `--think-s`, and the
conversations start spread over the first think time. Prompts are token-id lists (/v1/completions) built
with the SmolLM2 tokenizer from a fixed corpus, so every count is exact; each conversation starts with its
own token, so conversations share no block and every hit is the conversation's own history. The next
turn carries the model's own answer (`--answers model`, what a chat client sends back: its text,
tokenized again), so the previous prompt and all but the answer's last token can hit; `--answers
synthetic` carries `--max-tokens` random tokens instead (prompts identical across configurations, and
only the previous prompt's blocks can hit).

The engine's own cache holds `--cache-fraction` (1/4) of the conversations' total KV (their final
prompts plus answers): the mocker gets `--num-gpu-blocks`, llamacpp `--engine-arg max_cached_tokens`
(never less than two of the longest prompts, so a request always fits). One `dyn serve --workers 1`
is started per configuration (`--configs`):

    none          no tiers
    host          --kv-host-cache-gb HOST_GB
    host+disk     --kv-host-cache-gb HOST_GB --kv-disk-cache-gb DISK_GB --kv-disk-cache-dir TMP/kv-disk
    host:0.1+disk:2   the same with these sizes (GB)

Measured per configuration, over turns >= 2 (turn 1 has nothing to reuse): TTFT p50/p90 (and per turn),
prompt tokens computed (prompt - `usage.prompt_tokens_details.cached_tokens`, summed over turns >= 2; and
over the whole run, turn 1 included, the worker's `LoadMetrics.num_prefill_tokens_computed`, read on the
event plane), the router's view of the hits
(`dynamo_router_counter` num_hit_blocks, of which num_host_ / num_disk_hit_blocks), and onboarded blocks,
bytes and GB/s from the frontend's /metrics (`kvbm_onboard_{blocks,bytes,seconds}_{h2d,d2d}`, Dynamo's
KVBM names; n/a when the worker publishes none). Ratios are against the first configuration.

    python benchmarks/kv_tiers.py --engine mocker                          # ~4 min
    python benchmarks/kv_tiers.py --engine llamacpp --configs none,host    # the issue's bar: host tier
    python benchmarks/kv_tiers.py --engine mocker --configs none --conversations 4 --turns 3 \\
        --user-tokens 64 --think-s 0.2 --speedup 10                        # a < 1 min smoke run

Extra `dyn serve` arguments go after `--serve-arg` (repeatable, one token each: `--serve-arg=--n-ctx`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
import httpx
import kv_routing as kr

from dynamo_cli.wire import LoadMetrics

ONBOARD_PATHS = ("h2d", "d2d")
"""Dynamo's KVBM onboard directions: host -> device, disk -> device."""


@dataclass(slots=True)
class Turn(kr.KvRecord):
    conversation: int = 0
    turn: int = 0


@dataclass(frozen=True, slots=True)
class TierConfig:
    name: str
    host_gb: float = 0.0
    disk_gb: float = 0.0

    def argv(self, tmp: str) -> list[str]:
        argv = ["--kv-host-cache-gb", str(self.host_gb)] if self.host_gb else []
        if self.disk_gb:
            argv += ["--kv-disk-cache-gb", str(self.disk_gb), "--kv-disk-cache-dir", f"{tmp}/kv-disk"]
        return argv


def parse_config(text: str, args: argparse.Namespace) -> TierConfig:
    """`none`, `host`, `host+disk`, `host:0.5+disk:4` -> tier sizes."""
    sizes = {"host": 0.0, "disk": 0.0}
    for part in filter(None, text.split("+")):
        tier, _, size = part.partition(":")
        if tier == "none":
            continue
        if tier not in sizes:
            raise SystemExit(f"--configs item {text!r}: unknown tier {tier!r} (none, host, disk)")
        sizes[tier] = float(size) if size else getattr(args, f"{tier}_gb")
    return TierConfig(text, sizes["host"], sizes["disk"])


##### Workload #####


@dataclass(slots=True)
class Conversation:
    first: int
    """Its own first token: no two conversations share a block."""
    history: list[int] = field(default_factory=list)


def user_messages(args: argparse.Namespace, pool: list[int], seed: int) -> list[list[list[int]]]:
    """messages[c][t]: the tokens conversation c adds at turn t (a user message; with synthetic answers,
    the answer before it)."""
    rng = random.Random(seed)
    out = []
    for _ in range(args.conversations):
        turns = []
        for t in range(args.turns):
            synthetic = t and args.answers == "synthetic"
            answer = [rng.choice(pool) for _ in range(args.max_tokens)] if synthetic else []
            n = max(1, round(args.user_tokens * rng.uniform(0.9, 1.1)))
            start = rng.randrange(len(pool))
            turns.append(answer + [pool[(start + i) % len(pool)] for i in range(n)])
        out.append(turns)
    return out


def first_tokens(pool: list[int], n: int) -> list[int]:
    """`n` distinct tokens to start the conversations with (the corpus's, then ids from 1000)."""
    firsts = list(dict.fromkeys(pool))[:n]
    return firsts + [t for t in range(1000, 1000 + n) if t not in set(firsts)][: n - len(firsts)]


def engine_cache(args: argparse.Namespace, messages: list[list[list[int]]]) -> tuple[int, int]:
    """(tokens the engine's own cache gets, the conversations' total KV in tokens)."""
    answers = args.turns if args.answers == "model" else 1  # synthetic ones are in the messages but the last
    finals = [1 + sum(len(m) for m in turns) + answers * args.max_tokens for turns in messages]
    total = sum(finals)
    return max(int(total * args.cache_fraction), 2 * max(finals)), total


##### Running one configuration #####


def start_serve(
    tmp: str, config: TierConfig, args: argparse.Namespace, cache_tokens: int, log_path: Path
) -> harness.Deployment:
    flags = ["--engine", args.engine, "--workers", str(args.workers), "--router", "kv", "--host", "127.0.0.1"]
    flags += ["--discovery", f"file://{tmp}/d", "--block-size", str(args.block_size), *config.argv(tmp)]
    if args.engine == "mocker":
        flags += ["--num-gpu-blocks", str(math.ceil(cache_tokens / args.block_size))]
        flags += ["--speedup-ratio", str(args.speedup)]
    else:
        flags += ["--engine-arg", f"max_cached_tokens={cache_tokens}"]
    flags += args.serve_arg or []
    return harness.start_serve(flags, log_path, timeout_s=args.start_timeout, min_instances=args.workers)


async def converse(
    client: kr.KvClient,
    c: int,
    first: int,
    turns: list[list[int]],
    args: argparse.Namespace,
    records: list[Turn],
    encode: Callable[[str], list[int]],
) -> None:
    rng = random.Random(1000 + c)
    await asyncio.sleep(rng.uniform(0, args.think_s))
    prompt = [first]
    answer: list[int] = []
    for t, added in enumerate(turns, start=1):
        prompt = prompt + answer + added
        body = {
            "model": kr.MODEL,
            "prompt": prompt,
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream_options": {"include_usage": True},
        }
        record = Turn(conversation=c, turn=t, input_tokens=len(prompt))
        records.append(record)
        await client.stream("/v1/completions", body, record)
        if args.answers == "model":
            answer = encode("".join(record.pieces))
        if t < len(turns):
            await asyncio.sleep(rng.expovariate(1 / args.think_s) if args.think_s > 0 else 0)


async def run_config(
    url: str,
    discovery_url: str,
    firsts: list[int],
    messages: list[list[list[int]]],
    args: argparse.Namespace,
    encode: Callable[[str], list[int]],
) -> dict[str, Any]:
    samples: list[tuple[float, LoadMetrics]] = []
    ready = asyncio.Event()
    watcher = asyncio.get_running_loop().create_task(kr.watch_load(discovery_url, samples, ready))
    await asyncio.wait_for(ready.wait(), 10)
    await asyncio.sleep(2 * 0.5)  # a load heartbeat from every worker: the counters before the run
    before = computed_tokens(samples)
    records: list[Turn] = []
    client = kr.KvClient(url, max_connections=args.conversations, idle_timeout=300, request_timeout=900)
    started = time.perf_counter()
    await asyncio.gather(*(converse(client, c, firsts[c], m, args, records, encode) for c, m in enumerate(messages)))
    elapsed = time.perf_counter() - started
    await asyncio.sleep(1.0)  # the last load report
    computed = computed_tokens(samples) - before
    kvbm = await scrape_kvbm(url)
    router = await kr.scrape_router(url)
    client.close()
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    row = summarize(records, computed, kvbm, elapsed)
    row["router_hit_blocks"] = {k: router.get(f"num_{k}hit_blocks") for k in ("", "host_", "disk_")}
    return row


def computed_tokens(samples: list[tuple[float, LoadMetrics]]) -> int:
    """Prompt tokens computed so far, summed over workers (each reports a cumulative count)."""
    last: dict[int, int] = {}
    for _, m in samples:
        last[m.worker_id] = max(last.get(m.worker_id, 0), m.num_prefill_tokens_computed)
    return sum(last.values())


async def scrape_kvbm(url: str) -> dict[str, float]:
    """Every `kvbm_*` sample on the frontend's /metrics, summed over labels (empty when none is published)."""
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{url}/metrics")).text
    out: dict[str, float] = {}
    for m in re.finditer(r"^(kvbm_\w+?)(?:_total)?(?:\{[^}]*\})? (\S+)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def summarize(records: list[Turn], computed: int, kvbm: dict[str, float], elapsed: float) -> dict[str, Any]:
    ok = [r for r in records if r.is_ok]
    later = [r for r in ok if r.turn >= 2]
    ttft = [r.ttft * 1000 for r in later if r.ttft is not None]
    per_turn = {}
    for t in sorted({r.turn for r in ok}):
        values = [r.ttft * 1000 for r in ok if r.turn == t and r.ttft is not None]
        per_turn[t] = {"p50_ms": kr.pct(values, 50), "p90_ms": kr.pct(values, 90), "n": len(values)}
    prompt = sum(r.prompt_tokens or r.input_tokens for r in later)
    cached = sum(r.cached_tokens or 0 for r in later)
    blocks = {p: kvbm.get(f"kvbm_onboard_blocks_{p}") for p in ONBOARD_PATHS}
    nbytes = [kvbm[f"kvbm_onboard_bytes_{p}"] for p in ONBOARD_PATHS if f"kvbm_onboard_bytes_{p}" in kvbm]
    seconds = [kvbm[f"kvbm_onboard_seconds_{p}"] for p in ONBOARD_PATHS if f"kvbm_onboard_seconds_{p}" in kvbm]
    onboard_bytes = sum(nbytes) if nbytes else None
    gbps = onboard_bytes / sum(seconds) / 1e9 if onboard_bytes and seconds and sum(seconds) > 0 else None
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "seconds": elapsed,
        "ttft_p50_ms": kr.pct(ttft, 50),
        "ttft_p90_ms": kr.pct(ttft, 90),
        "ttft_per_turn": per_turn,
        "prompt_tokens_turn2plus": prompt,
        "cached_tokens_turn2plus": cached,
        "computed_tokens_turn2plus": prompt - cached,
        "prompt_tokens_computed": computed or None,
        "onboard_blocks": blocks,
        "onboard_bytes": onboard_bytes,
        "onboard_gb_per_s": gbps,
        "kvbm": kvbm,
        "turns": [
            [
                r.conversation,
                r.turn,
                r.prompt_tokens or r.input_tokens,
                r.cached_tokens,
                None if r.ttft is None else round(r.ttft * 1000, 1),
            ]
            for r in records
        ],
    }


##### Report #####


def fmt(value: Any, spec: str = ".0f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def print_table(results: dict[str, dict[str, Any]]) -> None:
    base = next(iter(results.values()))
    print(
        f"{'config':<16} {'TTFT p50':>9} {'p90':>9} {'x p50':>6} {'comp t>=2':>9} {'x fewer':>7} "
        f"{'computed':>9} {'x fewer':>7} {'cached %':>8} "
        f"{'onb h2d':>8} {'onb d2d':>8} {'onb GB':>7} {'GB/s':>6} {'router h/d':>11} {'fail':>4}"
    )
    for name, row in results.items():
        speedup = base["ttft_p50_ms"] / row["ttft_p50_ms"] if row["ttft_p50_ms"] else None
        fewer = (
            base["prompt_tokens_computed"] / row["prompt_tokens_computed"]
            if base["prompt_tokens_computed"] and row["prompt_tokens_computed"]
            else None
        )
        later = row["computed_tokens_turn2plus"]
        fewer_later = base["computed_tokens_turn2plus"] / later if later else None
        prompt = row["prompt_tokens_turn2plus"]
        cached = 100 * row["cached_tokens_turn2plus"] / prompt if prompt else None
        gb = row["onboard_bytes"] / 1e9 if row["onboard_bytes"] is not None else None
        hits = row.get("router_hit_blocks", {})
        seen = f"{fmt(hits.get('host_'))}/{fmt(hits.get('disk_'))}"
        print(
            f"{name:<16} {fmt(row['ttft_p50_ms']):>7}ms {fmt(row['ttft_p90_ms']):>7}ms {fmt(speedup, '.2f'):>6} "
            f"{later:>9} {fmt(fewer_later, '.2f'):>7} {fmt(row['prompt_tokens_computed']):>9} "
            f"{fmt(fewer, '.2f'):>7} {fmt(cached, '.1f'):>8} "
            f"{fmt(row['onboard_blocks']['h2d']):>8} {fmt(row['onboard_blocks']['d2d']):>8} {fmt(gb, '.3f'):>7} "
            f"{fmt(row['onboard_gb_per_s'], '.2f'):>6} {seen:>11} {row['failed']:>4}"
        )
    print(
        "TTFT and tokens over turns >= 2; 'x' columns are against the first configuration; comp t>=2 = prompt - "
        "cached tokens over turns >= 2 (usage); computed = the worker's num_prefill_tokens_computed over the whole "
        "run, turn 1 included; router h/d = blocks the router routed to as host / "
        "disk hits."
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("mocker", "llamacpp"), default="mocker")
    p.add_argument("--configs", default="none,host,host+disk", help="comma-separated: none, host, host+disk, ...")
    p.add_argument("--host-gb", type=float, default=2.0, help="host tier size when a config names none")
    p.add_argument("--disk-gb", type=float, default=8.0, help="disk tier size when a config names none")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--user-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--answers",
        choices=("model", "synthetic"),
        default="model",
        help="what the next turn carries: the model's answer (its text, tokenized) or random tokens",
    )
    p.add_argument("--think-s", type=float, default=3.0, help="mean think time between turns (exponential)")
    p.add_argument("--cache-fraction", type=float, default=0.25, help="engine cache / conversations' total KV")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--speedup", type=float, default=1.0, help="mocker: --speedup-ratio")
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--serve-arg", action="append", help="one extra `dyn serve` argument (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=harness.results_path("kv_tiers"))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    configs = [parse_config(c.strip(), args) for c in args.configs.split(",") if c.strip()]
    from dynamo_cli.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(kr.MODEL)
    pool = tokenizer.encode(kr.CORPUS)
    firsts = first_tokens(pool, args.conversations)
    messages = user_messages(args, pool, args.seed)
    cache_tokens, total_tokens = engine_cache(args, messages)
    print(
        f"{args.conversations} conversations x {args.turns} turns: {total_tokens} KV tokens in all; engine cache "
        f"{cache_tokens} tokens ({args.engine})",
        flush=True,
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    load_start = harness.loadavg()
    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for config in configs:
        with tempfile.TemporaryDirectory(prefix="kv-tiers-") as tmp:
            try:
                serve = start_serve(tmp, config, args, cache_tokens, Path(tmp) / "serve.log")
            except SystemExit as exc:  # e.g. an engine without tiers: report it, run the other configurations
                print(f"{config.name}: skipped: {exc}", flush=True)
                skipped[config.name] = str(exc)
                continue
            try:
                results[config.name] = asyncio.run(
                    run_config(serve.url, f"file://{tmp}/d", firsts, messages, args, tokenizer.encode)
                )
            finally:
                serve.stop()
                shutil.copy(Path(tmp) / "serve.log", args.json.with_suffix(f".{config.name}.log"))  # kept beside
        print(f"{config.name}: done in {results[config.name]['seconds']:.1f} s", flush=True)
    if results:
        print_table(results)
    meta = {k: (v if not isinstance(v, Path) else str(v)) for k, v in vars(args).items()}
    report = {
        "args": meta,
        "engine_cache_tokens": cache_tokens,
        "total_kv_tokens": total_tokens,
        "results": results,
        "skipped": skipped,
    }
    harness.write_results("kv_tiers", report, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
