"""On-CPU time of one KV routing decision, and an A/B of it against another checkout in the same process.

A decision is what the frontend pays per request in kv mode: `KvRoutingPolicy.select` (hash the prompt,
query the index, read the load, cost every candidate, choose, count the load) plus `on_first_token` and
`on_finish`. The workload is the kv_routing benchmark's: 40 system prompts of 2,000 tokens plus 100
unique tokens, block size 64, every prompt cached on one of W workers, 8 requests in flight per worker.

Timings of a few hundred microseconds swing by half between runs of a shared 2-core machine, so `--against
DIR` loads DIR's `dynamo_cli` a second time, under another name, and runs the two policies in alternating
blocks of decisions in one process: the ratio holds where the absolute numbers do not.

    python benchmarks/investigations/decision_cpu.py                           # this checkout, 4, 32 and 128 workers
    python benchmarks/investigations/decision_cpu.py --against /tmp/old        # A/B: DIR holds another checkout
    python benchmarks/investigations/decision_cpu.py --workers 4 --blocks 100 --json /tmp/d.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (the one path insert: harness.py)
import harness  # noqa: E402

BLOCK_SIZE = 64
PACKAGE = "dynamo_cli"
OTHER = "dynamo_ab"
"""The name the `--against` checkout's package is loaded under."""
LAYOUTS = (("routing.kv_policy", "routing.base"), ("router.kv", "router.base"))
"""Where a checkout keeps the policy and `RouteRequest`: today's, then before the routing split (issue 48)."""


def _layout(package: str) -> tuple[Any, Any]:
    """`package`'s policy module and base module, in whichever layout its checkout has."""
    for policy, base in LAYOUTS:
        if importlib.util.find_spec(f"{package}.{policy}") is not None:
            return importlib.import_module(f"{package}.{policy}"), importlib.import_module(f"{package}.{base}")
    sys.exit(f"{package}: no routing policy module ({', '.join(p for p, _ in LAYOUTS)})")


def _targets(package: str, workers: int) -> list[Any]:
    """The candidates `select` takes: routing targets (rank 0 of each worker), or worker ids before them."""
    if importlib.util.find_spec(f"{package}.routing.target") is None:
        return list(range(workers))
    return importlib.import_module(f"{package}.routing.target").targets_of(range(workers))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="4,32,128", help="comma-separated worker counts")
    parser.add_argument("--against", type=Path, help="a checkout whose dynamo_cli is the A side")
    parser.add_argument("--blocks", type=int, default=60, help="alternating blocks of decisions per side")
    parser.add_argument("--block-decisions", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=harness.results_path("decision_cpu"))
    return parser.parse_args(argv)


def load_other(checkout: Path, into: Path) -> str:
    """`checkout`'s dynamo_cli copied under `into` as OTHER, its imports renamed; returns the name."""
    source = checkout / PACKAGE
    if not any((source / layout[0].replace(".", "/")).with_suffix(".py").is_file() for layout in LAYOUTS):
        sys.exit(f"--against {checkout}: no {PACKAGE}/routing/kv_policy.py there; pass a checkout of this repository")
    target = into / OTHER
    shutil.copytree(source, target)
    for path in target.rglob("*.py"):
        path.write_text(path.read_text().replace(PACKAGE, OTHER))
    sys.path.insert(0, str(into))
    return OTHER


class Side:
    """One package's policy over the workload."""

    def __init__(self, package: str, workers: int, prompts: list[list[int]]) -> None:
        config = importlib.import_module(f"{package}.config")
        kv, base = _layout(package)
        self.request = base.RouteRequest
        hashes = importlib.import_module(f"{package}.kv.hashing").sequence_hashes
        self.policy = kv.KvRoutingPolicy(
            config.KvRouterConfig(block_size=BLOCK_SIZE, total_kv_blocks=16_384), rng=random.Random(1)
        )
        self.workers, self.in_flight, self.sent = _targets(package, workers), 8 * workers, 0
        for n, prompt in enumerate(prompts):
            self.policy.indexer.store_blocks(self.workers[n % workers], hashes(prompt, BLOCK_SIZE))

    def run(self, requests: list[list[int]], count: int) -> float:
        """On-CPU microseconds per decision over `count` decisions."""
        policy, start = self.policy, time.thread_time_ns()
        for _ in range(count):
            n = self.sent
            self.sent += 1
            policy.select(self.request(f"r{n}", requests[n % len(requests)]), self.workers)
            policy.on_first_token(f"r{n - self.in_flight // 2}")
            policy.on_finish(f"r{n - self.in_flight}")
        return (time.thread_time_ns() - start) / count / 1000


def measure(packages: list[str], workers: int, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(32_000) for _ in range(2000)] for _ in range(40)]
    requests = [rng.choice(prompts) + [rng.randrange(32_000) for _ in range(100)] for _ in range(4000)]
    sides = {package: Side(package, workers, prompts) for package in packages}
    samples: dict[str, list[float]] = {package: [] for package in packages}
    for block in range(args.blocks):
        order = packages if block % 2 == 0 else packages[::-1]
        for package in order:
            us = sides[package].run(requests, args.block_decisions)
            if block >= 4:  # the first blocks fill the in-flight window
                samples[package].append(us)
    return {package: statistics.median(values) for package, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = harness.loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        packages = [PACKAGE] if args.against is None else [load_other(args.against, Path(tmp)), PACKAGE]
        rows = [{"workers": w, **measure(packages, w, args)} for w in map(int, args.workers.split(","))]
    header = ["workers", *[f"{p} us/decision" for p in packages]] + (["this / against"] if args.against else [])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [str(row["workers"]), *[f"{row[p]:.1f}" for p in packages]]
        if args.against:
            cells.append(f"{row[PACKAGE] / row[OTHER]:.2f}")
        print("| " + " | ".join(cells) + " |")
    result: dict[str, Any] = {
        "against": str(args.against) if args.against else None,
        "rows": rows,
        "block_decisions": args.block_decisions,
        "blocks": args.blocks,
    }
    harness.write_results("decision_cpu", result, args.json, loadavg_start=load_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
