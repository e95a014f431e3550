"""Issue 15's regime matrix in one command: the KV router against round-robin in every cell, TTFT ratios.

Cells = cache regime x load:
  caches  default  20 system prompts, the mocker's default KV (16,384 blocks of 64 tokens per worker)
          p20      20 prompts, 512 blocks per worker (cache pressure: 620 prompt blocks > 512)
          p40      40 prompts, 512 blocks per worker (1,240 prompt blocks over 2,048 in all)
  loads   closed   8 clients per worker (32 for 4 workers), each sending its next request at the end of
                   its last one
          0.7 ...  open loop (Poisson) at that fraction of round-robin's capacity, where capacity is 4x
                   what one worker sustains closed-loop at `--probe-concurrency` 32 on the same workload
                   (probed once per cache regime, or given with `--capacity CACHE=REQ_S`)

Prompts are ~2,000-token system prompts plus a unique ~100-token suffix, `max_tokens` 50, 4 mocker workers
at speedup 1, as in benchmarks/kv_routing.py, whose deployment, load generation and summaries this uses.
In each cell the modes run one after the other (kv, then round-robin; the order flips on each repeat),
each on its own fresh deployment with the same request sequence. The table gives per cell TTFT
p50/p90/p99 of each side, round-robin / kv for each (>= 1: kv at least as good), hit rates and the
router's reachable hit rate.

    python benchmarks/kv_routing_matrix.py                        # 9 cells x 2 modes, ~20 min
    python benchmarks/kv_routing_matrix.py --caches p40 --loads closed --seconds 20 --warmup 5   # one cell
    python benchmarks/kv_routing_matrix.py --modes kv,kv:cost=dynamo,round-robin --repeats 2
    git worktree add /tmp/before HEAD~1     # then: this checkout's kv against an earlier one's, in one run
    python benchmarks/kv_routing_matrix.py --modes kv,kv:code=/tmp/before,round-robin --repeats 2
    python benchmarks/kv_routing_matrix.py --modes kv,round-robin,kv:pin,round-robin:pin   # `pin` modes: the
        # frontend on a CPU of its own (kv_routing.py), each compared with round-robin:pin
    python benchmarks/kv_routing_matrix.py --caches default --repeats 3 --modes kv,round-robin,round-robin:code=.
        # with an A/A pair: round-robin:code=. is the same code as round-robin, so its ratios are the noise floor
    python benchmarks/kv_routing_matrix.py --reprint benchmarks/out/kv_routing_matrix.json   # tables again

With `--repeats` > 1 the cells are pooled per mode, with two 90 % bootstrap intervals for each ratio: over
requests, and over runs then requests (`pool`); only the second carries the run-to-run swing.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import harness
import kv_routing as kr
import numpy as np

CACHES = {"default": (20, None), "p20": (20, 512), "p40": (40, 512)}
"""Cache regime -> (system prompts, KV blocks per worker; None = the mocker's default)."""
RATIO_KEYS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--caches", default="default,p20,p40", help="of: " + ", ".join(CACHES))
    p.add_argument("--loads", default="closed,0.7,0.95", help="closed and/or fractions of rr capacity")
    p.add_argument("--modes", default="kv,round-robin", help="kv knobs as in kv_routing.py: kv:cost=dynamo ...")
    p.add_argument("--repeats", type=int, default=1, help="runs per cell, alternating the modes' order")
    p.add_argument("--no-explain", dest="explain", action="store_false", help="kv modes: no x-dyn-explain-route")
    p.add_argument("--clients-per-worker", type=int, default=8)
    p.add_argument("--capacity", action="append", default=[], help="CACHE=REQ_S: skip that regime's probe")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seconds", type=float, default=40.0, help="measured window per run")
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--drain", type=float, default=60.0)
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--suffix-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=50)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--probe-concurrency", type=int, default=32)
    p.add_argument("--probe-seconds", type=float, default=20.0)
    p.add_argument("--probe-warmup", type=float, default=5.0)
    p.add_argument("--json", default=str(harness.results_path("kv_routing_matrix")))
    p.add_argument("--records", action="store_true", help="keep every measured request in the JSON")
    p.add_argument("--reprint", type=Path, help="print the tables of an earlier run's JSON (pooled anew) and exit")
    args = p.parse_args(argv)
    # knobs kv_routing.py's deployment and summaries read
    args.kv_overlap_score_weight, args.router_temperature, args.hot_spot_guard = 1.0, 0.0, True
    args.router_cost, args.arrival, args.rate, args.clients = None, "poisson", 0.0, 0
    return args


def probe_capacity(work: kr.Workload, blocks: int | None, args: argparse.Namespace) -> dict[str, Any]:
    """Round-robin's capacity: one worker's closed-loop throughput at --probe-concurrency, x workers."""
    import uvloop

    with tempfile.TemporaryDirectory() as tmp:
        serve = kr.start_serve(tmp, "round-robin", args, blocks, Path(tmp) / "serve.log", workers=1)
        try:
            time.sleep(1.0)
            probe = uvloop.run(kr.run_capacity(serve.url, work, args, args.seed + 1))
        finally:
            serve.stop()
    kr.scale(probe, args.speedup)
    probe["rr_capacity_req_per_s"] = probe["req_per_s"] * args.workers
    return probe


def run_one(
    mode: str, work: kr.Workload, blocks: int | None, load: str, capacity: float | None, args: argparse.Namespace
) -> dict[str, Any]:
    """One deployment of `mode` under `load` (closed, or a fraction of `capacity`)."""
    import uvloop

    closed = load == "closed"
    rate = 0.0 if closed else float(load) * (capacity or 0.0) * args.speedup
    clients = args.clients_per_worker * args.workers if closed else 0
    rargs = argparse.Namespace(**{**vars(args), "rate": rate, "clients": clients})
    with tempfile.TemporaryDirectory() as tmp:
        serve = kr.start_serve(tmp, mode, args, blocks, Path(tmp) / "serve.log")
        try:
            time.sleep(1.0)  # let the frontend see every worker's KV stream
            row = uvloop.run(kr.run_mode(serve.url, f"file://{tmp}/d", mode, work, rargs, args.seed, serve.pid))
        finally:
            serve.stop()
        row["serve_argv"] = kr.serve_argv(serve, tmp)
    row["clients"], row["rate"] = clients, rate / args.speedup
    kr.scale(row, args.speedup)
    return row


PINNED = ":pin"


def baseline(mode: str, modes: Iterable[str]) -> str:
    """The round-robin mode `mode` is compared with: `round-robin:pin` for a pinned mode (kv_routing.py's
    `pin`: the frontend on a CPU of its own) when it ran, else `round-robin`."""
    return "round-robin" + PINNED if mode.endswith(PINNED) and "round-robin" + PINNED in modes else "round-robin"


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """For each mode but the baselines: its round-robin's TTFT percentile / the mode's (>= 1: no worse)."""
    out = {}
    for mode, row in runs.items():
        base = baseline(mode, runs)
        if mode != base and base in runs:
            rr = runs[base]
            out[mode] = {key: rr[key] / row[key] if row[key] else float("nan") for key in RATIO_KEYS}
    return out


PERCENTILES = (50, 90, 99)
"""Of RATIO_KEYS, in order."""


def _percentiles(values: np.ndarray) -> np.ndarray:
    """`kr.pct`'s percentiles (the sorted value at index int(q / 100 * n)) of one sample, in one partition."""
    at = [min(len(values) - 1, q * len(values) // 100) for q in PERCENTILES]
    return np.partition(values, at)[at]


def pool(cells: Iterable[dict[str, Any]], draws: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Every repeat's TTFTs of a cell pooled per mode: the percentiles, round-robin / mode, and for each
    ratio two 90 % bootstrap intervals. A per-run p99 rests on ~1 % of one run's requests, so one repeat's
    ratio swings by 10-20 %; pooling the repeats gives the tail more samples.

    - `rr_over_90ci`: each side's requests drawn again with replacement, `draws` times. It treats every
      request as independent, so it misses what moves a whole run (the machine's other load, a slow start).
    - `rr_over_90ci_runs`: the repeats drawn again first (the same repeat indices for both sides: the modes
      of one repeat ran back to back), then the requests of each drawn run. It carries the run-to-run
      swing, and is the one to read before calling a ratio below 1 a regression: an A/A pair (a mode such
      as `round-robin:code=.`, the same code as its baseline) shows how wide it is."""
    cells = list(cells)
    runs: dict[str, list[np.ndarray]] = {}
    for cell in cells:
        for mode, row in cell["runs"].items():
            runs.setdefault(mode, []).append(np.asarray(row["ttft_ms"]))
    rng = np.random.default_rng(seed)
    arrays = {mode: np.concatenate(parts) for mode, parts in runs.items()}
    boot = {mode: np.array([_percentiles(rng.choice(a, len(a))) for _ in range(draws)]).T for mode, a in arrays.items()}
    picks = rng.integers(0, len(cells), size=(draws, len(cells)))
    boot_runs = {mode: _run_bootstrap(parts, picks, rng) for mode, parts in runs.items() if len(parts) == len(cells)}
    out: dict[str, Any] = {
        mode: {"n": len(a), **dict(zip(RATIO_KEYS, _percentiles(a).tolist(), strict=True))}
        for mode, a in arrays.items()
    }
    for mode in arrays:
        base = baseline(mode, arrays)
        if mode == base or base not in boot:
            continue
        ratios = boot[base] / boot[mode]  # (quantile, draw)
        out[mode]["rr_over"] = {k: out[base][k] / out[mode][k] for k in RATIO_KEYS}
        out[mode]["rr_over_90ci"] = _interval(ratios)
        if mode in boot_runs and base in boot_runs:
            out[mode]["rr_over_90ci_runs"] = _interval(boot_runs[base] / boot_runs[mode])
    return out


def _run_bootstrap(parts: list[np.ndarray], picks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(quantile, draw) percentiles of one mode: per draw, the runs `picks` names, each resampled."""
    draws = [np.concatenate([rng.choice(parts[i], len(parts[i])) for i in row]) for row in picks]
    return np.array([_percentiles(d) for d in draws]).T


def _interval(ratios: np.ndarray) -> dict[str, list[float]]:
    """The 5th and 95th percentile of each (quantile, draw) row of ratios."""
    return {
        k: [float(np.percentile(ratios[i], 5)), float(np.percentile(ratios[i], 95))] for i, k in enumerate(RATIO_KEYS)
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.reprint is not None:
        reprint(args.reprint)
        return
    given = {cache: float(rate) for cache, _, rate in (c.partition("=") for c in args.capacity)}
    modes = args.modes.split(",")
    results: dict[str, Any] = {
        "args": vars(args),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "loadavg_start": harness.loadavg(),
        "caches": {},
    }
    for cache in args.caches.split(","):
        num_prefixes, blocks = CACHES[cache]
        work = kr.build_workload(
            num_prefixes, args.prefix_tokens, args.suffix_tokens, args.max_tokens, args.block_size, args.seed
        )
        loads = args.loads.split(",")
        probe = None
        capacity = given.get(cache)
        if capacity is None and any(load != "closed" for load in loads):
            probe = probe_capacity(work, blocks, args)
            capacity = probe["rr_capacity_req_per_s"]
            print(f"{cache}: round-robin capacity {capacity:.1f} req/s ({json.dumps(probe)})", flush=True)
        cells = []
        for load in loads:
            for repeat in range(args.repeats):
                order = modes if repeat % 2 == 0 else modes[::-1]
                runs = {mode: run_one(mode, work, blocks, load, capacity, args) for mode in order}
                cell = {"load": load, "repeat": repeat, "runs": runs, "rr_over": compare(runs)}
                cells.append(cell)
                print(
                    json.dumps({"cache": cache, "load": load, "repeat": repeat, "rr_over": cell["rr_over"]}), flush=True
                )
        pooled = pool_loads(cells)
        results["caches"][cache] = {
            "num_prefixes": num_prefixes,
            "num_gpu_blocks": blocks or 16384,
            "rr_capacity_req_per_s": capacity,
            "probe": probe,
            "cells": cells,
            "pooled": pooled,
        }
    results["loadavg_end"] = harness.loadavg()
    print_table(results)
    harness.write_results("kv_routing_matrix", results, args.json, loadavg_start=results["loadavg_start"])


def reprint(path: Path) -> None:
    """The tables of an earlier run's JSON, its repeats pooled anew (with this version's intervals)."""
    results = harness.read_results(path)
    for reg in results["caches"].values():
        reg["pooled"] = pool_loads(reg["cells"])
    print_table(results)


def pool_loads(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Each load's repeats pooled (`pool`), in the order the loads ran; {} when each cell ran once."""
    if not any(cell["repeat"] for cell in cells):
        return {}
    loads = dict.fromkeys(cell["load"] for cell in cells)
    return {load: pool(c for c in cells if c["load"] == load) for load in loads}


def _span(interval: list[float]) -> str:
    return f" [{interval[0]:.2f}-{interval[1]:.2f}]"


def _ms(row: dict[str, Any]) -> str:
    return "/".join(f"{row[key]:.0f}" for key in RATIO_KEYS)


def print_table(results: dict[str, Any]) -> None:
    """One line per cell and kv-like mode: both sides' TTFT p50/p90/p99 (ms), the ratios, hit rates."""
    print(f"\nload average {results['loadavg_start']} at start, {results['loadavg_end']} at end")
    print(
        "| cache | load | req/s offered | mode | TTFT p50/p90/p99 ms | rr TTFT p50/p90/p99 ms | "
        "rr/kv p50 | rr/kv p90 | rr/kv p99 | hit | rr hit | reachable blk | no worse |"
    )
    print("|" + "---|" * 13)
    for cache, reg in results["caches"].items():
        for cell in reg["cells"]:
            for mode, row in cell["runs"].items():
                base = baseline(mode, cell["runs"])
                if mode == base:
                    continue
                rr = cell["runs"].get(base)
                ratio = cell["rr_over"].get(mode, dict.fromkeys(RATIO_KEYS, float("nan")))
                offered = "closed" if cell["load"] == "closed" else f"{row['rate']:.1f}"
                ok = "-" if rr is None else "yes" if all(r >= 1 for r in ratio.values()) else "NO"
                print(
                    f"| {cache} | {cell['load']} | {offered} | {mode} | {_ms(row)} | {_ms(rr) if rr else '-'} | "
                    + " | ".join(f"{ratio[k]:.2f}" for k in RATIO_KEYS)
                    + f" | {row['hit_rate']:.1%} | {rr['hit_rate'] if rr else float('nan'):.1%} | "
                    f"{row.get('router_reachable_blocks_rate', float('nan')):.1%} | {ok} |"
                )
    pooled = [
        (cache, load, mode, row)
        for cache, reg in results["caches"].items()
        for load, cell in reg.get("pooled", {}).items()
        for mode, row in cell.items()
        if "rr_over" in row
    ]
    if pooled:
        print(
            "\nPooled over the repeats: rr/kv with its 90 % bootstrap interval over requests [and over runs, then"
            " requests]:"
        )
        print("| cache | load | mode | TTFTs | TTFT p50/p90/p99 ms | rr/kv p50 | rr/kv p90 | rr/kv p99 |")
        print("|" + "---|" * 8)
        for cache, load, mode, row in pooled:
            runs = row.get("rr_over_90ci_runs", {})
            cis = [
                f"{row['rr_over'][k]:.2f} ({lo:.2f}-{hi:.2f})" + (_span(runs[k]) if k in runs else "")
                for k, (lo, hi) in row["rr_over_90ci"].items()
            ]
            print(f"| {cache} | {load} | {mode} | {row['n']} | {_ms(row)} | " + " | ".join(cis) + " |")


if __name__ == "__main__":
    main()
