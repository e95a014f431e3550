"""Disaggregated serving vs aggregated serving on the same simulated or real hardware (issue 13).

Every side is a `dyn serve --port 0` deployment on its own file:// discovery dir, started once per part
and kept up while the load alternates between the sides round by round (A, B, C, A, B, C ...), so drift
of the machine's load hits every side alike; ratios are taken within a round, then the median over
rounds is reported. The load generator is `dyn bench` (a subprocess; its --json and --jsonl are read).
Prompts go to /v1/completions as text built from single-token SmolLM2 words, so every ISL is exact.

Parts (`--parts mocker,mixed,llamacpp`):

1. mocker: `--engine mocker --speedup-ratio 1`, ISL 3,000, OSL 150, closed loop at concurrency 16.
   Sides: `agg` (`--workers 2`), `disagg` (`--disagg --prefill-workers 1 --decode-workers 1`, default
   policy `adaptive`) and `always` (the same with `--disagg-policy always`). Reports req/s, output tok/s,
   TTFT p50/p99, ITL p50/p99, gap p99 and the ratios to agg. Issue's bar (Dynamo's own mocker): +25 %
   req/s, ~3x lower TTFT p50, 2-5x lower ITL p99.
2. mixed: half ISL 100, half ISL 3,000 (a --prompts-file, shuffled, the same file for every side of a
   round), OSL 150, open loop (Poisson) at each rate of a sweep. Sides: `agg`, `always` and one per
   conditional policy (`adaptive`, `isl`, `load`, `isl-or-load`), all 1P+1D. Rates: `--rates`, or
   fractions (`--rate-fractions`, default 0.8 .. 1.3) of the capacity measured first: the req/s of `always`
   closed loop at concurrency `--capacity-concurrency` (64), i.e. the rate at which its one prefill worker
   saturates. (The mocker's decode step does not grow with batch size, so below that rate every side
   meets any sensible SLO and goodput ties at the offered rate; the sides part above it.) Goodput =
   requests meeting the SLO (`--slo`, default TTFT <= 1,000 ms and ITL <= 25 ms, in ms at speedup 1,
   divided by the speedup ratio) per second; also the share of prompts prefilled remotely, from the
   frontend's `dynamo_frontend_disagg_decisions` counter. Bar: adaptive beats agg and always at every rate.
   SLO: a decode step at these KV loads takes 6-9 ms, a pass that also prefills a 3,000-token prompt
   ~75 ms; ITL <= 25 ms lets a stream spend about a quarter of its steps behind prefills (40 tok/s), and
   TTFT <= 1 s is ~15 lone 3,000-token prefills, so only a growing queue breaks it.
3. llamacpp (real SmolLM2): `agg` (`--workers 2`) vs `disagg` (1P+1D, `--kv-transfer` nixl when NIXL
   imports, else tcp) at ISL 1,500, OSL 64, concurrency 4, for `--llama-seconds`: TTFT p50, ITL p99. Then
   the KV transfer of a 2,000-token state (`--transfer-tokens`): one untimed warm-up prompt (NIXL agent,
   first connection), then `--transfer-requests` prompts (OSL 4, concurrency 1) to a 1P+1D deployment with
   `--kv-transfer tcp` and one with `--kv-transfer nixl`; the mean pull time per backend is the growth of
   the frontend's `dynamo_frontend_kv_transfer_seconds` sum / count (by backend) over those prompts, set
   against that prompt length's prefill time = TTFT p50 of the same prompts on `agg` at concurrency 1.
   Bar: transfer <= 10 % of prefill. The 1P+1D deployments run the default policy with
   `--max-local-prefill-length 16`: dyn bench's 1-token probe stays local (its pull would land in the
   counters) and every measured prompt goes remote; at ISL 1,500 that is the default policy exactly.

`remote`: the share of a run's prompts prefilled remotely (dyn bench's probe and warm-up included). ITL:
per request (e2e - TTFT) / (tokens - 1); gap p99: p99 of every gap between two tokens. Latencies in ms.

    python benchmarks/disagg.py [--parts mocker,mixed,llamacpp] [--repeats 2] [--seconds 40]
        [--mixed-seconds 30] [--rates 24,32,36,40 | --rate-fractions 0.8,1,1.15,1.3] [--policies adaptive,isl]
        [--slo 'ttft=1000 itl=25'] [--llama-seconds 90] [--transfer-requests 4]
        [--json benchmarks/out/disagg.json]
    # smoke (each ~1 min on a quiet machine; results meaningless):
    python benchmarks/disagg.py --parts mocker --speedup-ratio 20 --seconds 5 --repeats 1 --warmup 4
    python benchmarks/disagg.py --parts mixed --speedup-ratio 20 --mixed-seconds 4 --rate-fractions 0.5,1.2 \
        --capacity-concurrency 16 --repeats 1 --policies adaptive
    python benchmarks/disagg.py --parts llamacpp --llama-seconds 2 --repeats 1 --warmup 1 \
        --transfer-requests 2 --transfer-tokens 300 --llama-isl 100

benchmarks/disagg_model.py gives what the mocker's timing model alone predicts for parts 1 and 2 (the
same scheduler, simulated time, no processes), to set the measured figures against.

Defaults take about an hour (mocker ~5 min, mixed ~35, llamacpp ~15). The load average is printed and recorded at
the start and the end: timings are only valid on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2"
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
POLICIES = ("adaptive", "isl", "load", "isl-or-load")
FIGURES = (
    ("req/s", "request_throughput"),
    ("tok/s", "output_token_throughput"),
    ("TTFT p50", "ttft.p50"),
    ("TTFT p99", "ttft.p99"),
    ("ITL p50", "itl.p50"),
    ("ITL p99", "itl.p99"),
    ("gap p99", "chunk_gap.p99"),
)


# ------------------------------------------------------------------------------------------ deployments


@dataclass(slots=True)
class Side:
    """One deployment under test: its `dyn serve` flags, and once started its deployment."""

    name: str
    """Label in the tables (agg, disagg, always, adaptive ...)."""
    flags: list[str]
    """`dyn serve` flags beyond the common ones (engine, port, discovery)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment (UCX settings for NIXL)."""
    url: str = ""
    log: Path | None = None
    deployment: harness.Deployment | None = None
    """The `dyn serve` started for this side (None for a server started elsewhere: Dynamo's, in mocker_live)."""


def start(side: Side, tmp: Path, timeout_s: float = 180.0) -> None:
    """Start `dyn serve` for `side` (harness.start_serve: ready line, /health)."""
    flags = [*side.flags, "--host", "127.0.0.1", "--discovery", f"file://{tmp}/{side.name}.d"]
    side.deployment = harness.start_serve(flags, tmp / f"{side.name}.log", env=side.env, timeout_s=timeout_s)
    side.url, side.log = side.deployment.url, side.deployment.log_path
    print(f"  {side.name}: {side.url}  (dyn serve {' '.join(side.flags)})", flush=True)


def stop(side: Side) -> None:
    """Stop the deployment by its PID (harness: SIGTERM, SIGKILL after 30 s)."""
    if side.deployment is not None:
        side.deployment.stop()


@contextlib.contextmanager
def deployed(sides: list[Side], tmp: Path) -> Iterator[list[Side]]:
    """All `sides` up for the duration of the block (started one after the other), then stopped."""
    try:
        for side in sides:
            start(side, tmp)
        yield sides
    finally:
        for side in sides:
            stop(side)


def mocker_flags(args: argparse.Namespace, policy: str | None) -> list[str]:
    """`agg` (policy None: `--workers 2`) or 1P+1D with `policy`, on the simulated hardware of `args`."""
    flags = ["--engine", "mocker", "--speedup-ratio", str(args.speedup_ratio), "--router", args.router]
    if policy is None:
        return [*flags, "--workers", "2"]
    return [*flags, "--disagg", "--prefill-workers", "1", "--decode-workers", "1", "--disagg-policy", policy]


# -------------------------------------------------------------------------------------------- the load


def bench(side: Side, tmp: Path, tag: str, flags: list[str], timeout_s: float = 900.0) -> dict[str, Any]:
    """One `dyn bench` run against `side`: its --json summary plus the per-request rows of --jsonl."""
    out = tmp / f"{side.name}-{tag}"
    argv = [
        sys.executable,
        "-m",
        "dynamo_cli.cli.main",
        "bench",
        "--url",
        side.url,
        "--endpoint",
        "completions",
        "--tokenizer",
        MODEL,
        "--no-progress",
        "--json",
        f"{out}.json",
        "--jsonl",
        f"{out}.jsonl",
        *flags,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        log = side.log.read_text(errors="replace")[-4000:] if side.log else ""
        print(f"dyn serve log of {side.name} (tail):\n{log}", file=sys.stderr)
        raise SystemExit(
            f"dyn bench failed on {side.name} ({' '.join(flags)}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    document: dict[str, Any] = json.loads(Path(f"{out}.json").read_text())
    rows = [json.loads(line) for line in Path(f"{out}.jsonl").read_text().splitlines() if line.strip()]
    return {"summary": document["summary"], "rows": rows}


def figure(summary: dict[str, Any], key: str) -> float:
    """`request_throughput` or `ttft.p50` from a dyn bench summary (NaN when absent)."""
    if "." in key:
        metric, stat = key.split(".")
        value = summary["latency"][metric].get(stat)
    else:
        value = summary.get(key)
    return float("nan") if value is None else float(value)


def goodput(result: dict[str, Any], ttft_ms: float, itl_ms: float) -> float:
    """Requests that succeeded with TTFT <= ttft_ms and ITL <= itl_ms, per second of the run."""
    duration = result["summary"]["duration_s"] or float("nan")
    good = sum(
        1
        for r in result["rows"]
        if r["ok"] and (r["ttft_ms"] or 0) <= ttft_ms and (r["itl_ms"] is None or r["itl_ms"] <= itl_ms)
    )
    return float(good / duration)


def scrape(side: Side) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the frontend's /metrics, keyed by (name, sorted labels)."""
    text = httpx.get(f"{side.url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def delta(after: dict[Any, float], before: dict[Any, float], name: str, label: str) -> dict[str, float]:
    """Growth of counter/histogram sample `name` between two scrapes, summed by the value of `label`."""
    out: dict[str, float] = {}
    for (sample, labels), value in after.items():
        if sample == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + value - before.get((sample, labels), 0.0)
    return out


class Prompts:
    """Writes JSONL prompts files of single-token SmolLM2 words, so every prompt's length is exact."""

    def __init__(self, tmp: Path) -> None:
        from dynamo_cli.bench.workload import load_vocab

        self.tmp = tmp
        self.vocab = load_vocab(MODEL)
        if not self.vocab.is_exact:
            raise SystemExit(f"the SmolLM2 tokenizer did not load ({self.vocab.source}); lengths would be inexact")

    def write(self, tag: str, lengths: list[int], seed: int) -> Path:
        """One prompt per length; a marker word per prompt, then random words (no two share a KV block)."""
        words, rng = self.vocab.words, random.Random(seed)
        path = self.tmp / f"prompts-{tag}.jsonl"
        with path.open("w") as f:
            for index, n in enumerate(lengths):
                text = "".join([words[(seed * 7919 + index) % len(words)], *rng.choices(words, k=n - 1)])
                f.write(json.dumps({"text": text}) + "\n")
        return path

    def mixed(self, tag: str, count: int, seed: int) -> Path:
        """`count` prompts, half of 100 tokens and half of 3,000, in a seeded random order."""
        lengths = [100, 3000] * (count // 2 + 1)
        random.Random(seed).shuffle(lengths)
        return self.write(tag, lengths[:count], seed)


# ------------------------------------------------------------------------------------------ reporting


def median(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def side_medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median over rounds of every figure in FIGURES."""
    return {key: median([figure(r["summary"], key) for r in runs]) for _, key in FIGURES}


def round_ratios(runs: dict[str, list[dict[str, Any]]], base: str) -> dict[str, dict[str, float]]:
    """For each side but `base`: median over rounds of (side's figure / base's figure in the same round)."""
    ratios: dict[str, dict[str, float]] = {}
    for name, side_runs in runs.items():
        if name == base:
            continue
        ratios[name] = {
            key: median(
                [
                    figure(a["summary"], key) / figure(b["summary"], key)
                    for a, b in zip(side_runs, runs[base], strict=True)
                ]
            )
            for _, key in FIGURES
        }
    return ratios


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if value != value else f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    cells = [header, *[[fmt(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for number, row in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if number == 0:
            print("  " + "  ".join("-" * w for w in widths))


def strip_rows(runs: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """The runs without their per-request rows (the JSON keeps summaries only)."""
    return {name: [r["summary"] for r in side_runs] for name, side_runs in runs.items()}


def show(label: str, result: dict[str, Any]) -> None:
    """One progress line: a run's figures (ms), and its remote-prefill share when it has one."""
    extra = f"  remote {result['remote_share']:.0%}" if "remote_share" in result else ""
    line = "  ".join(f"{name} {fmt(figure(result['summary'], key))}" for name, key in FIGURES)
    print(f"  {label}: {line}{extra}", flush=True)


def side_table(title: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Print each side's medians over rounds and its per-round ratios to `agg`; return both."""
    medians = {name: side_medians(r) for name, r in runs.items()}
    ratios = round_ratios(runs, "agg")
    header = ["side", *(label for label, _ in FIGURES), "remote", "failed"]
    rows: list[list[Any]] = []
    for name, m in medians.items():
        remote = median([r.get("remote_share", float("nan")) for r in runs[name]])
        rows.append(
            [
                name,
                *(m[k] for _, k in FIGURES),
                "" if remote != remote else f"{remote:.0%}",
                sum(r["summary"]["num_failed"] for r in runs[name]),
            ]
        )
    rows += [[f"{n}/agg", *(r[k] for _, k in FIGURES), "", ""] for n, r in ratios.items()]
    table(title, header, rows)
    return {"medians": medians, "ratios_vs_agg": ratios, "runs": strip_rows(runs)}


# ------------------------------------------------------------------------------------ part 1: mocker


def part_mocker(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """ISL 3,000 / OSL 150 / c=16: agg vs 1P+1D (adaptive) vs 1P+1D (always), alternating by round."""
    sides = [
        Side("agg", mocker_flags(args, None)),
        Side("disagg", mocker_flags(args, "adaptive")),
        Side("always", mocker_flags(args, "always")),
    ]
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in sides}
    load = [
        "--isl",
        "3000",
        "--osl",
        "150",
        "--concurrency",
        "16",
        "--duration",
        str(args.seconds),
        "--warmup",
        str(args.warmup),
    ]
    with deployed(sides, tmp):
        for rnd in range(args.repeats):
            for side in sides:
                runs[side.name].append(bench_routed(side, tmp, f"mocker-r{rnd}", [*load, "--seed", str(rnd)]))
                show(f"round {rnd} {side.name}", runs[side.name][-1])
    out = side_table(
        f"mocker, speedup {args.speedup_ratio}: ISL 3000, OSL 150, c=16, {args.seconds:g} s x "
        f"{args.repeats} rounds (medians; ratios = median of per-round ratios; ms)",
        runs,
    )
    print("  bar (Dynamo's mocker): req/s ratio >= 1.25, TTFT p50 ratio <= 0.33, ITL p99 ratio <= 0.5")
    return {**out, "sides": {s.name: s.flags for s in sides}}


# ------------------------------------------------------------------------------------- part 2: mixed


def parse_slo(spec: str, speedup: float) -> tuple[float, float]:
    """'ttft=1000 itl=25' (ms at speedup 1) -> (ttft_ms, itl_ms) at this speedup ratio."""
    values = dict(item.split("=") for item in spec.replace(",", " ").split())
    return float(values["ttft"]) / speedup, float(values["itl"]) / speedup


def capacity(args: argparse.Namespace, always: Side, tmp: Path, prompts: Prompts) -> float:
    """Requests/s of `always` on the mixed workload, closed loop at --capacity-concurrency: where its one
    prefill worker saturates."""
    n = int(args.capacity_concurrency * 2 + args.mixed_seconds * 60 * args.speedup_ratio)  # ~2x what it sends
    path = prompts.mixed("capacity", min(n, 6_000), seed=10_000)
    flags = [
        "--prompts-file",
        str(path),
        "--osl",
        "150",
        "--concurrency",
        str(args.capacity_concurrency),
        "--duration",
        str(args.mixed_seconds),
    ]
    result = bench(always, tmp, "capacity", flags)
    return figure(result["summary"], "request_throughput")


def bench_routed(side: Side, tmp: Path, tag: str, flags: list[str]) -> dict[str, Any]:
    """`bench`, plus where the run's prompts were prefilled (the frontend's disagg decision counters)."""
    before = scrape(side)
    result = bench(side, tmp, tag, flags)
    decisions = delta(scrape(side), before, "dynamo_frontend_disagg_decisions_total", "outcome")
    total = sum(decisions.values())
    result["decisions"] = decisions
    result["remote_share"] = sum(v for k, v in decisions.items() if k.startswith("remote")) / total if total else 0.0
    return result


def mixed_run(
    side: Side, tmp: Path, tag: str, prompts: Path, rate: float, seconds: float, seed: int, slo: tuple[float, float]
) -> dict[str, Any]:
    """One open-loop run of `side` at `rate`: figures, goodput and where its prompts were prefilled."""
    flags = [
        "--prompts-file",
        str(prompts),
        "--osl",
        "150",
        "--request-rate",
        f"{rate:g}",
        "--arrival",
        "poisson",
        "--duration",
        str(seconds),
        "--seed",
        str(seed),
    ]
    result = bench_routed(side, tmp, tag, flags)
    result["goodput"] = goodput(result, *slo)
    return result


def part_mixed(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Half ISL 100, half ISL 3,000, OSL 150, Poisson arrivals: goodput of every side at every rate."""
    sides = [
        Side("agg", mocker_flags(args, None)),
        Side("always", mocker_flags(args, "always")),
        *(Side(p, mocker_flags(args, p)) for p in args.policies.split(",")),
    ]
    slo = parse_slo(args.slo, args.speedup_ratio)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    prompts = Prompts(tmp)
    with deployed(sides, tmp):
        cap = capacity(args, sides[1], tmp, prompts) if not args.rates else float("nan")
        rates = (
            [float(r) for r in args.rates.split(",")]
            if args.rates
            else [round(cap * float(f), 2) for f in args.rate_fractions.split(",")]
        )
        print(f"  capacity (always, closed loop c={args.capacity_concurrency}): {fmt(cap)} req/s; rates {rates}")
        for rnd in range(args.repeats):
            for rate in rates:
                count = int(rate * args.mixed_seconds * 1.3) + 20  # never cycles: no prompt repeats in a run
                path = prompts.mixed(f"r{rnd}-{rate:g}", count, seed=rnd * 1000 + int(rate * 10))
                for side in sides:
                    result = mixed_run(side, tmp, f"mixed-r{rnd}-{rate:g}", path, rate, args.mixed_seconds, rnd, slo)
                    runs.setdefault(f"{rate:g}", {}).setdefault(side.name, []).append(result)
                    show(f"round {rnd} rate {rate:g} {side.name}: goodput {fmt(result['goodput'])}", result)
    return report_mixed(args, runs, rates, slo, cap, sides)


def report_mixed(
    args: argparse.Namespace,
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    rates: list[float],
    slo: tuple[float, float],
    cap: float,
    sides: list[Side],
) -> dict[str, Any]:
    header = [
        "rate",
        "side",
        "goodput",
        "req/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "gap p99",
        "remote",
        "good/agg",
        "good/always",
        "failed",
    ]
    rows: list[list[Any]] = []
    out: dict[str, dict[str, Any]] = {}
    verdict: list[bool] = []
    for rate in rates:
        by_side = runs[f"{rate:g}"]
        out[f"{rate:g}"] = {}
        for name, side_runs in by_side.items():
            good = [r["goodput"] for r in side_runs]
            vs = {
                base: median(
                    [
                        g / b["goodput"] if b["goodput"] else float("nan")
                        for g, b in zip(good, by_side[base], strict=True)
                    ]
                )
                for base in ("agg", "always")
            }
            figures = {key: median([figure(r["summary"], key) for r in side_runs]) for _, key in FIGURES}
            entry = {
                "goodput": median(good),
                "remote_share": median([r["remote_share"] for r in side_runs]),
                "goodput_vs": vs,
                **figures,
                "decisions": [r["decisions"] for r in side_runs],
                "summaries": [r["summary"] for r in side_runs],
            }
            out[f"{rate:g}"][name] = entry
            rows.append(
                [
                    rate,
                    name,
                    entry["goodput"],
                    figures["request_throughput"],
                    figures["ttft.p50"],
                    figures["ttft.p99"],
                    figures["itl.p50"],
                    figures["itl.p99"],
                    figures["chunk_gap.p99"],
                    f"{entry['remote_share']:.0%}",
                    vs["agg"],
                    vs["always"],
                    sum(r["summary"]["num_failed"] for r in side_runs),
                ]
            )
        if "adaptive" in by_side:
            a = out[f"{rate:g}"]["adaptive"]["goodput"]
            verdict.append(a > out[f"{rate:g}"]["agg"]["goodput"] and a > out[f"{rate:g}"]["always"]["goodput"])
    table(
        f"mixed (half ISL 100, half 3000; OSL 150; Poisson), speedup {args.speedup_ratio}, {args.mixed_seconds:g} s "
        f"x {args.repeats} rounds; goodput = req/s with TTFT <= {slo[0]:g} ms and ITL <= {slo[1]:g} ms; "
        "ratios = median of per-round ratios",
        header,
        rows,
    )
    if verdict:
        print(f"  bar: adaptive beats agg and always at every rate: {all(verdict)} ({verdict})")
    return {
        "capacity_req_s": cap,
        "rates": rates,
        "slo_ms": {"ttft": slo[0], "itl": slo[1], "spec": args.slo},
        "by_rate": out,
        "adaptive_beats_both": verdict,
        "sides": {s.name: s.flags for s in sides},
    }


# ---------------------------------------------------------------------------------- part 3: llamacpp


def nixl_imports() -> bool:
    from dynamo_cli.runtime.kv_transfer_nixl import load_agent_class

    return load_agent_class() is not None


def llama_sides(args: argparse.Namespace) -> list[Side]:
    """agg (2 workers), and 1P+1D over TCP and, when NIXL imports, over NIXL."""
    base = ["--engine", "llamacpp", "--router", args.router]
    # The default policy, prefilling locally only prompts of <= 16 tokens: dyn bench's 1-token probe stays
    # local (its pull would count in /metrics) while every measured prompt goes remote, even a short one in
    # a smoke run. At ISL 1,500 this is the default policy exactly (the default limit is 512).
    disagg = [*base, "--disagg", "--prefill-workers", "1", "--decode-workers", "1", "--max-local-prefill-length", "16"]
    sides = [Side("agg", [*base, "--workers", "2"]), Side("tcp", [*disagg, "--kv-transfer", "tcp"])]
    if nixl_imports():
        env = {k: os.environ.get(k, v) for k, v in UCX_ENV.items()}
        sides.append(Side("nixl", [*disagg, "--kv-transfer", "nixl"], env))
    return sides


def transfer_run(side: Side, tmp: Path, tag: str, prompts: tuple[Path, Path], n: int) -> dict[str, Any]:
    """One warm-up prompt (NIXL agent, first connection), then n prompts at concurrency 1; the KV pulls'
    mean time and size by backend, from the growth of the frontend's /metrics over the measured prompts."""
    bench(side, tmp, f"{tag}-warm", ["--prompts-file", str(prompts[0]), "--osl", "4", "--num-requests", "1"])
    before = scrape(side)
    result = bench_routed(
        side,
        tmp,
        tag,
        ["--prompts-file", str(prompts[1]), "--osl", "4", "--concurrency", "1", "--num-requests", str(n)],
    )
    after = scrape(side)
    total = delta(after, before, "dynamo_frontend_kv_transfer_seconds_sum", "backend")
    count = delta(after, before, "dynamo_frontend_kv_transfer_seconds_count", "backend")
    nbytes = delta(after, before, "dynamo_frontend_kv_transfer_bytes_total", "backend")
    result["transfer"] = {
        b: {
            "count": c,
            "mean_ms": total[b] / c * 1e3 if c else float("nan"),
            "mib": nbytes.get(b, 0.0) / c / 2**20 if c else 0.0,
        }
        for b, c in count.items()
    }
    return result


def part_llamacpp(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """agg vs 1P+1D at ISL ~1,500 / OSL 64 / c=4, then the transfer of a 2,000-token state vs its prefill."""
    sides = llama_sides(args)
    load = [
        "--isl",
        str(args.llama_isl),
        "--osl",
        "64",
        "--concurrency",
        "4",
        "--duration",
        str(args.llama_seconds),
        "--warmup",
        str(min(args.warmup, 4)),
    ]
    runs: dict[str, list[dict[str, Any]]] = {"agg": [], "disagg": []}
    transfers: dict[str, list[dict[str, Any]]] = {s.name: [] for s in sides}
    prompts = Prompts(tmp)
    with deployed(sides, tmp):
        for rnd in range(args.repeats):
            for name, side in (("agg", sides[0]), ("disagg", sides[-1])):  # disagg: nixl when it imports
                runs[name].append(bench_routed(side, tmp, f"llama-r{rnd}", [*load, "--seed", str(rnd)]))
                show(f"round {rnd} {name} ({side.name})", runs[name][-1])
            n, tokens = args.transfer_requests, args.transfer_tokens
            paths = (
                prompts.write(f"warm-r{rnd}", [tokens], seed=900 + rnd),
                prompts.write(f"transfer-r{rnd}", [tokens] * n, seed=500 + rnd),
            )
            for side in sides:
                transfers[side.name].append(transfer_run(side, tmp, f"transfer-r{rnd}", paths, n))
                show(
                    f"round {rnd} transfer {side.name} {transfers[side.name][-1]['transfer']}", transfers[side.name][-1]
                )
    title = (
        f"llamacpp (SmolLM2): ISL {args.llama_isl}, OSL 64, c=4, {args.llama_seconds:g} s x {args.repeats} "
        f"rounds; disagg = 1P+1D over {sides[-1].name} (medians; ms)"
    )
    return {
        **side_table(title, runs),
        "transfer": report_transfer(args, transfers, sides),
        "sides": {s.name: s.flags for s in sides},
    }


def report_transfer(
    args: argparse.Namespace, transfers: dict[str, list[dict[str, Any]]], sides: list[Side]
) -> dict[str, Any]:
    """Mean pull time per backend against the prefill time (TTFT p50 on agg at c=1) of the same prompts."""
    prefill = [figure(r["summary"], "ttft.p50") for r in transfers["agg"]]
    out: dict[str, Any] = {"prefill_ttft_p50_ms": median(prefill), "tokens": args.transfer_tokens}
    rows: list[list[Any]] = []
    for side in sides[1:]:
        per_round = [r["transfer"].get(side.name, {}) for r in transfers[side.name]]
        mean_ms = [p.get("mean_ms", float("nan")) for p in per_round]
        share = median([m / f for m, f in zip(mean_ms, prefill, strict=True)])
        local = sum(r["transfer"].get("local", {}).get("count", 0) for r in transfers[side.name])
        pulls = sum(p.get("count", 0) for p in per_round)
        row = out[side.name] = {
            "pulls": pulls,
            "mib": median([p.get("mib", float("nan")) for p in per_round]),
            "transfer_mean_ms": median(mean_ms),
            "share_of_prefill": share,
            "local_fallbacks": local,
            "ttft_p50_ms": median([figure(r["summary"], "ttft.p50") for r in transfers[side.name]]),
        }
        rows.append(
            [
                side.name,
                f"{pulls:g}/{args.transfer_requests * args.repeats}",
                row["mib"],
                row["transfer_mean_ms"],
                median(prefill),
                f"{share:.1%}",
                share <= 0.10,
                local,
            ]
        )
    if len(sides) < 3:
        rows.append(["nixl", "", "", "NIXL does not import here", "", "", "", ""])
    table(
        f"KV transfer of a {args.transfer_tokens}-token state ({args.transfer_requests} prompts x {args.repeats} "
        "rounds, c=1; 1 warm-up prompt untimed); prefill = TTFT p50 of the same prompts on agg",
        ["backend", "pulls", "MiB", "pull ms", "prefill ms", "share", "<= 10 %", "local fallbacks"],
        rows,
    )
    return out


# ----------------------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="mocker,mixed,llamacpp")
    p.add_argument("--repeats", type=int, default=2, help="rounds of alternation (each side once per round)")
    p.add_argument("--seconds", type=float, default=40.0, help="measured seconds per run (mocker, llamacpp)")
    p.add_argument("--warmup", type=int, default=16, help="warm-up requests per closed-loop run")
    p.add_argument("--speedup-ratio", type=float, default=1.0, help="mocker time divisor (1 = realistic)")
    p.add_argument("--router", default="kv", help="--router of every deployment (kv | round-robin)")
    p.add_argument("--mixed-seconds", type=float, default=30.0, help="measured seconds per mixed run")
    p.add_argument("--rates", default="", help="mixed: req/s values (default: fractions of measured capacity)")
    p.add_argument("--rate-fractions", default="0.8,1.0,1.15,1.3")
    p.add_argument("--capacity-concurrency", type=int, default=64)
    p.add_argument("--policies", default=",".join(POLICIES), help="mixed: conditional policies to compare")
    p.add_argument("--slo", default="ttft=1000 itl=25", help="mixed goodput SLO, ms at speedup 1")
    p.add_argument("--llama-isl", type=int, default=1500)
    p.add_argument("--llama-seconds", type=float, default=90.0, help="measured seconds per llamacpp c=4 run")
    p.add_argument("--transfer-requests", type=int, default=4, help="transfer prompts per side per round")
    p.add_argument("--transfer-tokens", type=int, default=2000, help="tokens of each transfer prompt")
    p.add_argument("--json", default=str(harness.results_path("disagg")))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    parts = {"mocker": part_mocker, "mixed": part_mixed, "llamacpp": part_llamacpp}
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := [p for p in chosen if p not in parts]:
        raise SystemExit(f"--parts: unknown {unknown}; choose from {', '.join(parts)}")
    document: dict[str, Any] = {"args": vars(args)}
    load_start = harness.loadavg()
    print(f"load average at start: {load_start}  (timings are valid only on a quiet machine)", flush=True)
    with tempfile.TemporaryDirectory(prefix="dyn-disagg-") as name:
        for part in chosen:
            print(f"\n== part {part}", flush=True)
            started = time.monotonic()
            document[part] = parts[part](args, Path(name))
            document[part]["wall_s"] = time.monotonic() - started
    harness.write_results("disagg", document, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
