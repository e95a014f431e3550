"""Multi-LoRA serving (issue 37): what adapters cost on llama.cpp, and what adapter-aware routing saves.

Part 1, `llamacpp`: one `dyn serve --engine llamacpp` worker with 4 synthetic SmolLM2 adapters (rank 8,
`dyn_engines.llamacpp.adapters.write_adapter`, loaded from the start: `--max-loras 4`), a closed loop of
`--concurrency` streaming chat requests (`--max-tokens` each, greedy, EOS ignored), two traffic mixes on the same
deployment, alternating round by round: `base` (every request on the base model) and `mixed` (half on the base,
half spread over the 4 adapters). llama.cpp applies adapters per context, so a step runs one `llama_decode` per
adapter among its sequences (engines/llamacpp: the batching policy): the mixed mix pays for the extra decodes.
Per mix: output tokens/s, TTFT p50/p99, and the ratio mixed/base of each.

Part 2, `mocker`: 4 mocker workers (real timing, `lora_load_ms` 50), 50 adapters given with `--lora`,
`--max-loras 8`, requests naming an adapter drawn from Zipf(1.1) with a unique ~200-token prompt, a closed loop
of `--concurrency`; two deployments, `--router kv` and `--router round-robin`, run at once and driven in turn.
Per router: the share of requests sent where their adapter was loaded (the `x-dyn-route` header's
`lora.was_loaded`), adapter loads per minute (the workers' `lora_loads`, from the frontend's `/metrics`), TTFT
p50/p99 and requests/s.

    python benchmarks/lora.py [--parts llamacpp,mocker] [--rounds 2] [--seconds 20] [--json benchmarks/out/lora.json]

The load average at the start and the end is printed and recorded: timings are only valid on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import httpx
from prometheus_client.parser import text_string_to_metric_families

NUM_LLAMACPP_ADAPTERS = 4
NUM_MOCKER_ADAPTERS = 50
ZIPF_S = 1.1
QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Record:
    model: str
    ttft: float
    tokens: int
    was_loaded: bool | None


def start(tmp: str, name: str, flags: list[str], workers: int) -> harness.Deployment:
    flags = ["--discovery", f"file://{tmp}/d-{name}", *flags]
    return harness.start_serve(flags, Path(tmp) / f"{name}.log", min_instances=workers)


async def closed_loop(
    url: str, concurrency: int, seconds: float, pick: Any, max_tokens: int, chat: bool
) -> tuple[list[Record], float]:
    """`concurrency` clients sending streaming requests back to back for `seconds`; `pick()` -> (model, prompt)."""
    records: list[Record] = []
    deadline = time.monotonic() + seconds
    headers = {"x-dyn-explain-route": "1"}

    async def one(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            model, prompt = pick()
            body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            body |= {"temperature": 0}
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            started, first, tokens = time.perf_counter(), None, 0
            path = "/v1/chat/completions" if chat else "/v1/completions"
            async with client.stream("POST", path, json=body, headers=headers) as response:
                response.raise_for_status()
                route = response.headers.get("x-dyn-route")
                loaded = json.loads(route).get("lora", {}).get("was_loaded") if route else None
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        first = first or time.perf_counter()
                        tokens += 1
            records.append(Record(model, (first or time.perf_counter()) - started, tokens, loaded))

    started = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        await asyncio.gather(*(one(client) for _ in range(concurrency)))
    return records, time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summary(records: list[Record], wall: float) -> dict[str, float]:
    ttfts = [r.ttft * 1000 for r in records]
    loaded = [r.was_loaded for r in records if r.was_loaded is not None]
    return {
        "requests": len(records),
        "req_per_s": len(records) / wall,
        "output_tok_per_s": sum(r.tokens for r in records) / wall,
        "ttft_p50_ms": statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_p99_ms": pct(ttfts, 0.99),
        "loaded_share": sum(loaded) / len(loaded) if loaded else float("nan"),
    }


def lora_loads(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "dynamo_frontend_worker_lora_loads"
        for s in family.samples
    )


##### Part 1: llama.cpp #####


def llamacpp(tmp: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from dyn_engines.llamacpp.adapters import write_adapter

    from dynamo_cli.model.paths import resolve_model_path

    model = resolve_model_path("smollm2")
    flags = ["--engine", "llamacpp", "--max-loras", str(NUM_LLAMACPP_ADAPTERS)]
    for i in range(NUM_LLAMACPP_ADAPTERS):
        path = Path(tmp) / f"lora{i}.gguf"
        write_adapter(str(path), str(model), seed=i)
        flags += ["--lora", f"lora{i}={path}"]
    serve = start(tmp, "llamacpp", flags, 1)
    url = serve.url
    rng = random.Random(0)
    mixes = {
        "base": lambda: ("smollm2", QUESTION),
        "mixed": lambda: (
            "smollm2" if rng.random() < 0.5 else f"lora{rng.randrange(NUM_LLAMACPP_ADAPTERS)}",
            QUESTION,
        ),
    }
    rows = []
    try:
        asyncio.run(closed_loop(url, args.concurrency, 3.0, mixes["mixed"], args.max_tokens, True))  # warm up
        for round_ in range(args.rounds):
            order = list(mixes) if round_ % 2 == 0 else list(reversed(mixes))
            for mix in order:
                records, wall = asyncio.run(
                    closed_loop(url, args.concurrency, args.seconds, mixes[mix], args.max_tokens, True)
                )
                row = {"part": "llamacpp", "side": mix, "round": round_, **summary(records, wall)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        serve.stop()
    return rows


##### Part 2: mocker routing #####


def mocker(tmp: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    folder = Path(tmp) / "adapters"
    folder.mkdir(exist_ok=True)
    base = ["--engine", "mocker", "--workers", "4", "--max-loras", "8"]
    for i in range(NUM_MOCKER_ADAPTERS):
        (folder / f"t{i}.bin").write_bytes(b"x")
        base += ["--lora", f"t{i}={folder / f't{i}.bin'}"]
    sides = {router: start(tmp, router, [*base, "--router", router], 4) for router in ("kv", "round-robin")}
    weights = [1 / (i + 1) ** ZIPF_S for i in range(NUM_MOCKER_ADAPTERS)]
    rng = random.Random(1)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()

    def pick() -> tuple[str, str]:
        name = rng.choices([f"t{i}" for i in range(NUM_MOCKER_ADAPTERS)], weights)[0]
        return name, f"tenant {name}: " + " ".join(rng.choice(words) for _ in range(190))

    rows = []
    try:
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            for router in order:
                url = sides[router].url
                before = lora_loads(url)
                records, wall = asyncio.run(closed_loop(url, args.concurrency, args.seconds, pick, 32, False))
                time.sleep(0.7)  # the workers' last load reports
                loads = lora_loads(url) - before
                row = {"part": "mocker", "side": router, "round": round_, **summary(records, wall)}
                row["lora_loads_per_min"] = loads / wall * 60
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        for serve in sides.values():
            serve.stop()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = ["req_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "loaded_share", "lora_loads_per_min"]
    print(f"{'part':<9} {'side':<12} " + " ".join(f"{c:>18}" for c in columns))
    for part in dict.fromkeys(r["part"] for r in rows):
        by_side: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            if r["part"] == part:
                by_side.setdefault(r["side"], []).append(r)
        for side, found in by_side.items():
            means = [statistics.fmean(r.get(c, float("nan")) for r in found) for c in columns]
            print(f"{part:<9} {side:<12} " + " ".join(f"{v:>18.3f}" for v in means))
        sides = list(by_side)
        if len(sides) == 2:
            a, b = sides[1], sides[0]
            ratios = []
            for c in columns:
                num = statistics.fmean(r.get(c, float("nan")) for r in by_side[a])
                den = statistics.fmean(r.get(c, float("nan")) for r in by_side[b])
                ratios.append(num / den if den else float("nan"))
            print(f"{part:<9} {a + '/' + b:<12} " + " ".join(f"{v:>18.3f}" for v in ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="llamacpp,mocker")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", default=str(harness.results_path("lora")))
    args = parser.parse_args()
    load_start = harness.loadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        parts = args.parts.split(",")
        if "llamacpp" in parts:
            rows += llamacpp(tmp, args)
        if "mocker" in parts:
            rows += mocker(tmp, args)
    print_table(rows)
    harness.write_results("lora", {"args": vars(args), "rows": rows}, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
