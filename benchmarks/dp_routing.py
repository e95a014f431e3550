"""Data-parallel ranks as routing targets: rank-aware KV routing against rank-blind KV routing and round-robin.

Mocker deployments of 2 workers x 4 ranks (`--engine-arg data_parallel_size=4`, each rank a scheduler and a KV
cache of its own) under cache pressure, driven closed loop with kv_routing.py's workload (P distinct system
prompts + a unique suffix; every prompt fits in the ranks' caches together, not in any one):

  aware        the router sees each (worker, rank) as a target (the ranks' KV events and load, the rank sent)
  blind        the same engine with its ranks hidden (`data_parallel_hidden=true`: one card rank, events without
               their rank, the engine spreads requests over its ranks itself, as vLLM's internal balancer does)
  round-robin  round-robin over the 8 (worker, rank) targets
  single       8 single-rank workers with the same blocks each: the same total cache, one target per worker

The modes alternate in each repeat (the order reversed every other repeat). Per mode: TTFT p50/p90, req/s and the
prefix-cache hit rate (`usage.prompt_tokens_details.cached_tokens`); the ratios are medians over the repeats.
The bar (issue 50): blind TTFT p50 / aware TTFT p50 >= 1.3, and aware's hit rate within 5 points of single's.

    python benchmarks/dp_routing.py [--repeats 2] [--seconds 30] [--clients 16] [--json benchmarks/out/dp_routing.json]
    python benchmarks/dp_routing.py --repeats 1 --seconds 3 --warmup 1 --drain 5   # a smoke run, no figure

Defaults take about 6 minutes (8 deployments of about 45 s). Traffic is 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import kv_routing as kr

MODES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "aware": ("kv", 2, ("--engine-arg", "data_parallel_size=4")),
    "blind": ("kv", 2, ("--engine-arg", "data_parallel_size=4", "--engine-arg", "data_parallel_hidden=true")),
    "round-robin": ("round-robin", 2, ("--engine-arg", "data_parallel_size=4")),
    "single": ("kv", 8, ()),
}
"""Mode -> (router mode, workers, extra `dyn serve` flags)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help="of: " + ", ".join(MODES))
    p.add_argument("--repeats", type=int, default=2, help="runs of every mode, alternating their order")
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients (2 per rank by default)")
    p.add_argument("--seconds", type=float, default=30.0, help="measured window per run")
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--drain", type=float, default=60.0)
    p.add_argument("--prefixes", type=int, default=40, help="distinct system prompts")
    p.add_argument("--num-gpu-blocks", type=int, default=256, help="KV blocks per rank")
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--suffix-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=50)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", default=str(harness.results_path("dp_routing")))
    args = p.parse_args(argv)
    # the knobs kv_routing.py's deployment and summaries read
    args.kv_overlap_score_weight, args.router_temperature, args.hot_spot_guard = 1.0, 0.0, True
    args.router_cost, args.arrival, args.rate, args.records, args.explain = None, "poisson", 0.0, False, True
    args.workers = 2
    return args


def run_one(mode: str, work: kr.Workload, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One deployment of `mode`, one closed-loop window."""
    import uvloop

    router, workers, extra = MODES[mode]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        serve = kr.start_serve(tmp, router, args, args.num_gpu_blocks, log, workers=workers, extra=extra)
        try:
            time.sleep(1.0)  # the frontend sees every worker's KV stream
            row = uvloop.run(kr.run_mode(serve.url, f"file://{tmp}/d", router, work, args, seed, serve.pid))
        finally:
            serve.stop()
        row["serve_argv"] = kr.serve_argv(serve, tmp)
    kr.scale(row, args.speedup)
    row["mode"] = mode
    return row


def ratios(runs: list[dict[str, dict[str, Any]]]) -> dict[str, float]:
    """Medians over the repeats of each ratio the bar reads (each ratio taken within one repeat)."""
    out: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        out.setdefault(name, []).append(value)

    for rows in runs:
        aware = rows.get("aware")
        if aware is None:
            continue
        for other in ("blind", "round-robin"):
            if other in rows:
                add(f"{other}_over_aware_ttft_p50", rows[other]["ttft_p50_ms"] / aware["ttft_p50_ms"])
                add(f"{other}_over_aware_ttft_p90", rows[other]["ttft_p90_ms"] / aware["ttft_p90_ms"])
                add(f"aware_over_{other}_req_per_s", aware["req_per_s"] / rows[other]["req_per_s"])
        if "single" in rows:
            add("single_minus_aware_hit_rate_points", 100 * (rows["single"]["hit_rate"] - aware["hit_rate"]))
    return {name: statistics.median(values) for name, values in out.items()}


def bar(medians: dict[str, float]) -> dict[str, bool]:
    """Issue 50's bar on the medians."""
    checks = {}
    if "blind_over_aware_ttft_p50" in medians:
        checks["rank_aware_1_3x_blind_ttft_p50"] = medians["blind_over_aware_ttft_p50"] >= 1.3
    if "single_minus_aware_hit_rate_points" in medians:
        checks["hit_rate_within_5_points_of_single"] = medians["single_minus_aware_hit_rate_points"] <= 5.0
    return checks


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start_load = harness.loadavg()
    work = kr.build_workload(
        args.prefixes, args.prefix_tokens, args.suffix_tokens, args.max_tokens, args.block_size, args.seed
    )
    modes = args.modes.split(",")
    runs: list[dict[str, dict[str, Any]]] = []
    for repeat in range(args.repeats):
        order = modes if repeat % 2 == 0 else modes[::-1]
        rows = {}
        for mode in order:
            rows[mode] = run_one(mode, work, args, args.seed + repeat)
            print(f"repeat {repeat + 1}, {mode}: {_line(rows[mode])}", flush=True)
        runs.append(rows)
    medians = ratios(runs)
    table = [{"repeat": i + 1, **_cells(row)} for i, rows in enumerate(runs) for row in rows.values()]
    harness.print_table(table)
    harness.print_table([{"ratio": name, "median": f"{value:.2f}"} for name, value in medians.items()])
    checks = bar(medians)
    print("bar:", checks)
    results = {"runs": runs, "medians": medians, "bar": checks, "args": vars(args)}
    harness.write_results("dp_routing", results, args.json, loadavg_start=start_load)


def _cells(row: dict[str, Any]) -> dict[str, str]:
    return {
        "mode": row["mode"],
        "req/s": f"{row['req_per_s']:.2f}",
        "TTFT p50 ms": f"{row['ttft_p50_ms']:.0f}",
        "TTFT p90 ms": f"{row['ttft_p90_ms']:.0f}",
        "hit rate": f"{row['hit_rate']:.1%}",
        "failed": str(row["failed"]),
    }


def _line(row: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in _cells(row).items() if k != "mode")


if __name__ == "__main__":
    main()
