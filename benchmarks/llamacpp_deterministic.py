"""What the llamacpp engine's deterministic mode costs: single-stream prefill and decode, against the default.

Two engines run in this process on the built-in SmolLM2-135M, the default one (flash attention, one
unified KV cache, chunked prefill) and a `deterministic=true` one (no flash attention, a KV stream per
sequence, prompts fed one token per step). Each round measures the default engine, then the
deterministic one, so a shared machine's drift hits both alike: prefill tokens/s is the prompt length
over the time to the first token of a fresh ISL-token prompt (max_tokens 1, no prefix reuse), decode
tokens/s is (OSL - 1) over the time from the first to the last token of a second fresh prompt.

    python benchmarks/llamacpp_deterministic.py [--isl 500] [--osl 128] [--rounds 3] [--threads N]
        [--json benchmarks/out/llamacpp_deterministic.json]

On a busy shared CPU pass `--threads 1`: llama.cpp's spinning thread barriers collapse when its threads
do not all get a core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import time
from typing import Any

import harness
from dyn_engines.llamacpp.engine import LlamaCppEngine

from dynamo_cli.engine import EngineArgs
from dynamo_cli.wire import GenerateRequest, SamplingParams

MODES = {
    "default": {"n_ctx": 4096, "max_num_seqs": 4},
    "deterministic": {"deterministic": True, "max_num_seqs": 4, "max_cached_seqs": 2},
}


async def timed(engine: LlamaCppEngine, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival time of every token of one greedy request."""
    request = GenerateRequest(
        request_id=f"b-{time.monotonic_ns()}",
        token_ids=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, ignore_eos=True),
    )
    times = []
    async for chunk in engine.generate(request):
        times += [time.perf_counter()] * len(chunk.token_ids)
    return times


async def measure(engine: LlamaCppEngine, rng: random.Random, isl: int, osl: int) -> dict[str, float]:
    prompt = [rng.randrange(1000, 40000) for _ in range(isl)]
    start = time.perf_counter()
    first = (await timed(engine, prompt, 1))[0]
    decode = await timed(engine, [rng.randrange(1000, 40000) for _ in range(isl)], osl)
    return {"prefill_tok_s": isl / (first - start), "decode_tok_s": (osl - 1) / (decode[-1] - decode[0])}


async def run(isl: int, osl: int, rounds: int, threads: int | None) -> dict[str, Any]:
    engines = {}
    for mode, extra in MODES.items():
        options = {**extra, "n_threads": threads} if threads else extra
        engines[mode] = LlamaCppEngine(EngineArgs(model="smollm2", context_length=isl + osl + 64, extra=options))
        await engines[mode].start()
    rng = random.Random(0)
    cells: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    try:
        await measure(engines["default"], rng, 32, 8)  # warm-up: page the model in
        for _ in range(rounds):
            for mode, engine in engines.items():
                cells[mode].append(await measure(engine, rng, isl, osl))
    finally:
        for engine in engines.values():
            await engine.stop()
    return {"cells": cells, "median": {mode: _medians(rows) for mode, rows in cells.items()}}


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def print_table(result: dict[str, Any]) -> None:
    median = result["median"]
    print(f"{'mode':14s} {'prefill tok/s':>14s} {'decode tok/s':>13s}   rounds (prefill / decode)")
    for mode, rows in result["cells"].items():
        per_round = ", ".join(f"{r['prefill_tok_s']:.0f}/{r['decode_tok_s']:.0f}" for r in rows)
        m = median[mode]
        print(f"{mode:14s} {m['prefill_tok_s']:14.0f} {m['decode_tok_s']:13.1f}   {per_round}")
    d, base = median["deterministic"], median["default"]
    print(
        f"deterministic / default: prefill {d['prefill_tok_s'] / base['prefill_tok_s']:.2f}x, "
        f"decode {d['decode_tok_s'] / base['decode_tok_s']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isl", type=int, default=500, help="prompt tokens")
    parser.add_argument("--osl", type=int, default=128, help="output tokens of the decode cell")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, help="llama.cpp threads (default: every core)")
    parser.add_argument("--json", default=str(harness.results_path("llamacpp_deterministic")))
    args = parser.parse_args()
    load_before = harness.loadavg()
    result = asyncio.run(run(args.isl, args.osl, args.rounds, args.threads))
    result["info"] = {
        "isl": args.isl,
        "osl": args.osl,
        "rounds": args.rounds,
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }
    print_table(result)
    harness.write_results("llamacpp_deterministic", result, args.json, loadavg_start=load_before)


if __name__ == "__main__":
    main()
