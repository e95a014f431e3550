"""Throughput of the llamacpp engine against raw llama-cpp-python on the same model and CPU.

Raw cells drive llama.cpp's low-level API directly (greedy sampler, no Python between steps beyond
filling the batch): one sequence (prefill tokens/s of an ISL-token prompt, then OSL decode steps), and
8 sequences decoded in one batch, in the library's default layout (a KV stream per sequence) and in the
engine's (one unified cache). Engine cells run `LlamaCppEngine` in-process at concurrency 1, 4, 8, 16
with distinct random prompts (no prefix reuse), ignore_eos. Raw contexts run on the engine's step thread
(one OpenMP team; see the NOTE in engines/llamacpp/engine.py). A round is `--pairs` alternations, each a
raw cell right before the engine cell it is compared with; a round's ratio is the median of its
alternations, because this shared machine's speed drifts by tens of percent within a minute.

    python benchmarks/engine_llamacpp.py [--isl 200] [--osl 128] [--rounds 3] [--pairs 3]
        [--json benchmarks/out/engine_llamacpp.json] [--kv-host-cache-gb 1]   # KV tiers on (host memory)

Bars (issue 16), in every round: engine single-stream decode >= 0.95x raw single-stream decode; engine
decode at 8 sequences >= 0.9x raw's 8-sequence batch doing the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import llama_cpp
from dyn_engines.llamacpp.engine import LlamaCppEngine
from dyn_engines.llamacpp.runner import default_threads

from dynamo_cli.engine import EngineArgs
from dynamo_cli.kv.tiers import KvTierConfig
from dynamo_cli.model.paths import resolve_model_path
from dynamo_cli.wire import GenerateRequest, SamplingParams

CONCURRENCY = (1, 4, 8, 16)


def prompts(n: int, isl: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(isl)] for _ in range(n)]


##### Raw llama-cpp-python #####


class Raw:
    """A plain llama.cpp context (the library's defaults: one KV stream per sequence; `unified`: one shared
    cache, as the engine runs it)."""

    def __init__(self, path: str, n_seq: int, n_ctx: int, threads: int, unified: bool = False) -> None:
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = False  # the AMX buffer type crashes on some VMs
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), params)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = n_ctx, 512, 512, n_seq
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = unified  # False, the library's default: one stream per sequence
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        self.sampler = chain

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(rows)
        if llama_cpp.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [llama_cpp.llama_sampler_sample(self.sampler, self.ctx, i) for i, r in enumerate(rows) if r[3]]

    def run(self, batch_prompts: list[list[int]], osl: int) -> dict[str, float]:
        """Prefill each prompt, then decode all sequences together for osl - 1 steps."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        last = []
        for seq, prompt in enumerate(batch_prompts):
            rows = [(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)]
            last += self.decode(rows)
        t1 = time.perf_counter()
        isl = len(batch_prompts[0])
        for step in range(osl - 1):
            last = self.decode([(tok, isl + step, seq, True) for seq, tok in enumerate(last)])
        t2 = time.perf_counter()
        n = len(batch_prompts)
        return {
            "prefill_tok_s": n * isl / (t1 - t0),
            "decode_tok_s": n * (osl - 1) / (t2 - t1),
            "output_tok_s": n * osl / (t2 - t0),
        }

    def close(self) -> None:
        llama_cpp.llama_sampler_free(self.sampler)
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


##### Through the engine #####


async def engine_cell(engine: LlamaCppEngine, concurrency: int, isl: int, osl: int, seed: int) -> dict[str, float]:
    async def one(i: int, prompt: list[int]) -> list[float]:
        request = GenerateRequest(
            request_id=f"{seed}-{i}",
            token_ids=prompt,
            max_tokens=osl,
            sampling=SamplingParams(temperature=0.0, ignore_eos=True),
        )
        times = []
        async for chunk in engine.generate(request):
            times += [time.perf_counter()] * len(chunk.token_ids)
        return times

    t0 = time.perf_counter()
    streams = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(concurrency, isl, seed))))
    wall = time.perf_counter() - t0
    # Decode phase: from the moment every stream has its first token to the first stream's end.
    start, end = max(s[0] for s in streams), min(s[-1] for s in streams)
    in_window = sum(1 for s in streams for t in s if start < t <= end)
    itl = [(s[-1] - s[0]) / (len(s) - 1) for s in streams]
    return {
        "output_tok_s": concurrency * osl / wall,
        "decode_tok_s": in_window / (end - start) if end > start else float("nan"),
        "single_decode_tok_s": 1 / statistics.mean(itl),
        "ttft_s": statistics.mean(s[0] - t0 for s in streams),
    }


async def measure(args: Any) -> dict[str, Any]:
    """Rounds of `--pairs` alternations: each raw cell right before the engine cell it is compared with.

    The raw contexts run on the engine's step thread (`run_in_step_thread`): llama.cpp keeps one OpenMP
    team per calling thread, and two teams in one process on this machine made both sides 2x slower."""
    path = resolve_model_path("smollm2")
    isl, osl, threads = args.isl, args.osl, args.threads
    extra = {"n_threads": threads, "max_num_seqs": max(CONCURRENCY)}
    tiers = KvTierConfig(host_bytes=int(args.kv_host_cache_gb * 1e9))
    engine = LlamaCppEngine(EngineArgs(model="smollm2", extra=extra, kv_tiers=tiers))
    await engine.start()
    raw_one = await engine.run_in_step_thread(Raw, path, 1, isl + osl + 64, threads)
    raw_eight = await engine.run_in_step_thread(Raw, path, 8, 8 * (isl + osl + 64), threads)
    raw_eight_unified = await engine.run_in_step_thread(Raw, path, 8, 8 * (isl + osl + 64), threads, True)
    await engine.run_in_step_thread(raw_one.run, prompts(1, 16, 0), 4)  # warm-up both
    await engine_cell(engine, 1, 16, 4, seed=0)
    rounds = []
    for r in range(args.rounds):
        pairs = []
        for p in range(args.pairs):
            seed = 100 * r + 10 * p
            step_thread = engine.run_in_step_thread
            cells: dict[str, Any] = {"raw_single": await step_thread(raw_one.run, prompts(1, isl, seed), osl)}
            cells["engine_1"] = await engine_cell(engine, 1, isl, osl, seed=seed + 1)
            cells["raw_batch8"] = await step_thread(raw_eight.run, prompts(8, isl, seed + 2), osl)
            cells["raw_unified8"] = await step_thread(raw_eight_unified.run, prompts(8, isl, seed + 3), osl)
            cells["engine_8"] = await engine_cell(engine, 8, isl, osl, seed=seed + 4)
            pairs.append(cells)
        rounds.append(pairs)
    others = {c: await engine_cell(engine, c, isl, osl, seed=50 + c) for c in CONCURRENCY if c not in (1, 8)}
    for raw in (raw_one, raw_eight, raw_eight_unified):
        await engine.run_in_step_thread(raw.close)
    await engine.stop()
    return {"rounds": rounds, "engine_other": others}


def find_key(doc: Any, key: str) -> Any:
    """The first value under `key` anywhere in a JSON document."""
    if isinstance(doc, dict):
        if key in doc:
            return doc[key]
        doc = list(doc.values())
    if isinstance(doc, list):
        for item in doc:
            found = find_key(item, key)
            if found is not None:
                return found
    return None


def serve_cells(args: Any) -> dict[int, dict[str, float]]:
    """The same load through `dyn serve` (HTTP, tokenizer, router, worker process) driven by `dyn bench`."""
    serve = harness.start_serve(["--max-num-seqs", str(max(CONCURRENCY))], harness.OUT / "engine_llamacpp.serve.log")
    try:
        url = serve.url
        out = {}
        for c in CONCURRENCY:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "bench.json"
                bench = ["dyn", "bench", "--url", url, "-c", str(c), "-n", str(c), "--warmup", "1"]
                bench += ["--isl", str(args.isl), "--osl", str(args.osl), "--ignore-eos", "--no-progress"]
                subprocess.run([*bench, "--json", str(path)], check=True, capture_output=True)
                doc = json.loads(path.read_text())
            itl = find_key(doc, "itl")
            itl_ms = itl.get("mean") if isinstance(itl, dict) else None
            out[c] = {
                "output_tok_s": float(find_key(doc, "output_token_throughput")),
                "single_decode_tok_s": 1000 / itl_ms if itl_ms else float("nan"),
            }
        return out
    finally:
        serve.stop()


RATIOS = {
    "single_decode": lambda c: c["engine_1"]["single_decode_tok_s"] / c["raw_single"]["decode_tok_s"],
    "aggregate_8": lambda c: c["engine_8"]["output_tok_s"] / c["raw_batch8"]["output_tok_s"],
    "decode_phase_8": lambda c: c["engine_8"]["decode_tok_s"] / c["raw_batch8"]["decode_tok_s"],
    "decode_phase_8_vs_unified": lambda c: c["engine_8"]["decode_tok_s"] / c["raw_unified8"]["decode_tok_s"],
    "raw_unified_vs_streams_8": lambda c: c["raw_unified8"]["decode_tok_s"] / c["raw_batch8"]["decode_tok_s"],
}
"""Engine ÷ raw per alternation (the last two: what the engine's unified KV cache costs llama.cpp itself)."""


def ratios(rounds: list[list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Each ratio per round: the median over that round's alternations."""
    return {name: [statistics.median(f(c) for c in pairs) for pairs in rounds] for name, f in RATIOS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isl", type=int, default=200)
    parser.add_argument("--osl", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3, help="raw/engine alternations per round")
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--kv-host-cache-gb", type=float, default=0.0, help="KV tiers: host memory (0: off)")
    parser.add_argument("--serve", action="store_true", help="also measure through `dyn serve` + `dyn bench`")
    parser.add_argument("--json", type=Path, default=harness.results_path("engine_llamacpp"))
    args = parser.parse_args()
    load_start = harness.loadavg()
    result = asyncio.run(measure(args))
    result["ratios"] = ratios(result["rounds"])
    if args.serve:
        result["serve"] = serve_cells(args)
    print(f"ISL {args.isl}, OSL {args.osl}, {args.threads} threads, llama-cpp-python {llama_cpp.__version__}")
    print(f"{'round':<6}{'cell':<12}{'prefill tok/s':>14}{'decode tok/s':>14}{'output tok/s':>14}{'ttft s':>9}")
    for r, pairs in enumerate(result["rounds"]):
        for p, cells in enumerate(pairs):
            for name, cell in cells.items():
                print_cell(f"{r}.{p}", name, cell)
    for c, cell in result["engine_other"].items():
        print_cell("-", f"engine_{c}", cell)
    for c, cell in result.get("serve", {}).items():
        print(
            f"{'-':<6}{'serve_' + str(c):<12}{'':>14}{cell['single_decode_tok_s']:>14.1f}{cell['output_tok_s']:>14.1f}"
        )
    for name, values in result["ratios"].items():
        print(f"{name:<27} per round (median of its alternations): {' / '.join(f'{v:.2f}' for v in values)}")
    result.update(isl=args.isl, osl=args.osl, threads=args.threads, machine=platform.platform())
    result["llama_cpp_python"] = llama_cpp.__version__
    harness.write_results("engine_llamacpp", result, args.json, loadavg_start=load_start)


def print_cell(round_name: str, name: str, cell: dict[str, float]) -> None:
    prefill = f"{cell['prefill_tok_s']:.1f}" if "prefill_tok_s" in cell else ""
    ttft = f"{cell['ttft_s']:.2f}" if "ttft_s" in cell else ""
    decode = cell.get("single_decode_tok_s", cell["decode_tok_s"]) if name == "engine_1" else cell["decode_tok_s"]
    print(f"{round_name:<6}{name:<12}{prefill:>14}{decode:>14.1f}{cell['output_tok_s']:>14.1f}{ttft:>9}")


if __name__ == "__main__":
    main()
