"""The router's wait queue against the immediate 503, at 120 % of capacity (issue 15 item 5).

`dyn serve --engine mocker --workers 2 --max-inflight-per-worker 8`: a worker with 8 streams is busy,
and with every worker busy a request either waits in the router's queue (core/queue.py) or, with
`--router-queue-size 0`, gets a 503 at once. Steps:

1. capacity: closed loop with exactly workers x max-inflight clients (16) for `--capacity-seconds`, on a
   queue-on deployment: requests completed per second after the first 2 s (the ramp) until the load
   stops (not the drain) is the capacity C.
2. open loop, Poisson arrivals at `--overload` x C (1.2) for `--duration` s per phase, sides alternating
   within each repeat (the order reversed on odd repeats); every phase gets a fresh `dyn serve`, and every
   side of one repeat gets the same arrival times and prompts (one seed per repeat). Sides:
   - `off`: `--router-queue-size 0`, today's instant 503.
   - `fcfs`: the default queue (256 requests, 30 s, first come first served).
   - `sjf`: `--router-queue-policy sjf` (shortest job, prompt + max_tokens, first).
   - `deadline`: `--router-queue-policy deadline`, every request sent with `x-dyn-deadline-ms`
     (`--deadline-ms`, below the TTFT SLO): a request that cannot start in time is refused early.
3. per phase: offered req/s (sent / `--duration`), completed, refused (HTTP 503), other errors, goodput =
   completed requests meeting TTFT <= `--slo-ttft-ms` and e2e <= `--slo-e2e-ms`, per second of arrivals
   (good / `--duration`: every side gets the same arrivals, so goodput ratios are ratios of good counts;
   `dyn bench`'s first-send-to-last-end duration would also charge a side for its drain), the good share
   of all sent, TTFT p50/p90/p99 and e2e p99 of the completed, and the queue wait p50/p99 of the queued
   (from the frontend's `dynamo_frontend_queue_wait_seconds` histogram, interpolated within buckets like Prometheus'
   histogram_quantile) and the deepest `dynamo_frontend_queued_requests` sampled each second.
   Then the mean per side over repeats and its goodput ratio to `off`.

Workload: ISL `--isl` tokens; a share `--long-fraction` (0.2) of requests ask for `--long-osl` (128)
tokens, the rest `--short-osl` (16), `ignore_eos`, so `sjf` has something to reorder. Mocker at
`--speedup-ratio 0.25` (4x slower than Dynamo's fitted model: ~24 ms per decode step) keeps the token
rate, hence the client's and frontend's CPU, low: C is ~15 req/s. Default SLO: TTFT <= 1,000 ms (about
10x an idle prefill), e2e <= 5,000 ms (an idle long request takes ~3.3 s). In sustained overload a FIFO
queue grows by (overload - 1) x C requests per second, so its wait passes any fixed TTFT SLO after a few
seconds; the result depends on --duration and the SLO, and both are in the JSON.

`--routers N` measures the queue in the `dyn router` service instead: `dyn serve --router remote --routers N`,
the busy check and the queue in each router replica, `--max-inflight-per-worker` max-inflight / N (a
replica counts its own streams, so the workers' slots stay the same). The queue-wait and queue-peak
columns then stay empty: they come from the frontend's /metrics, and routers have none.

Everything is bounded: each phase has a hard timeout, every request `--request-timeout`, and every
process started here is stopped by its PID (serve, then any worker left behind).

    python benchmarks/router_queue.py [--duration 15] [--repeats 2] [--json benchmarks/out/router_queue.json]
    python benchmarks/router_queue.py --routers 2 --json benchmarks/out/router_queue_routers.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import re
import resource
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness
import httpx

from dynamo_cli.bench import workload as wl
from dynamo_cli.bench.http import HttpClient, RequestRecord
from dynamo_cli.bench.load import LoadConfig, LoadRunner, RequestBuilder, run_async
from dynamo_cli.bench.metrics import Slo, meets_slo, request_metrics, summarize

MODEL = "smollm2"
SIDES = ("off", "fcfs", "sjf", "deadline")
CAPACITY_SKIP_S = 2.0
"""The capacity run's ramp, left out of its count."""


# ------------------------------------------------------------------------------------------- process


def serve_flags(side: str, tmp: str, args: argparse.Namespace) -> list[str]:
    max_inflight = max(1, args.max_inflight // args.routers) if args.routers else args.max_inflight
    flags = ["--engine", "mocker", "--workers", str(args.workers), "--max-inflight-per-worker", str(max_inflight)]
    flags += ["--host", "127.0.0.1", "--discovery", f"file://{tmp}/d", "--speedup-ratio", str(args.speedup)]
    if args.routers:
        flags += ["--router", "remote", "--routers", str(args.routers)]
    if side == "off":
        return [*flags, "--router-queue-size", "0"]
    policy = "fcfs" if side == "fcfs" else side
    return [*flags, "--router-queue-policy", policy, "--router-queue-timeout", str(args.queue_timeout)]


@contextlib.contextmanager
def serving(side: str, args: argparse.Namespace) -> Iterator[harness.Deployment]:
    """One `dyn serve` deployment for `side` in a temporary folder, stopped by its PID at the end."""
    with tempfile.TemporaryDirectory(prefix="dyn-rq-") as tmp:
        flags = serve_flags(side, tmp, args)
        with harness.serving(flags, Path(tmp) / "serve.log", timeout_s=60.0, min_instances=args.workers) as serve:
            yield serve


# ---------------------------------------------------------------------------------------------- load


def mixed(vocab: wl.Vocab, args: argparse.Namespace, seed: int) -> Iterator[wl.Conversation]:
    """Endless single-turn requests: `--long-fraction` of them long, the rest short; unique prompts."""
    rng = random.Random(seed)
    short = wl.synthetic(vocab, args.isl, 0, args.short_osl, 0, seed=seed)
    long = wl.synthetic(vocab, args.isl, 0, args.long_osl, 0, seed=seed + 1, offset=10_000_000)
    while True:
        yield next(long) if rng.random() < args.long_fraction else next(short)


async def sample_queue(url: str, peaks: list[float], stop: asyncio.Event) -> None:
    """The deepest `queued_requests` gauge seen, sampled each second until `stop`."""
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as http:
        while not stop.is_set():
            try:
                text = (await http.get("/metrics")).text
                found = re.findall(r"^dynamo_frontend_queued_requests\{[^}]*\} (\S+)$", text, re.M)
                peaks.append(max((float(v) for v in found), default=0.0))
            except Exception:  # a slow scrape under load: skip this sample
                pass
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass


async def run_load(
    url: str, load: LoadConfig, vocab: wl.Vocab, args: argparse.Namespace, headers: dict[str, str] | None, seed: int
) -> tuple[list[RequestRecord], float, str]:
    """One load phase; returns the records, the deepest queue sampled and the /metrics text after it."""
    connections = load.concurrency or 4096
    async with HttpClient(
        url, max_connections=connections, request_timeout=args.request_timeout, headers=headers
    ) as client:
        runner = LoadRunner(client, RequestBuilder(MODEL))
        peaks: list[float] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_queue(url, peaks, stop))
        try:
            limit = (load.duration_s or 0) + args.request_timeout + 30
            records = await asyncio.wait_for(runner.run(load, mixed(vocab, args, seed)), limit)
        finally:
            stop.set()
            await sampler
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        text = (await http.get("/metrics")).text
    return records, max(peaks, default=0.0), text


# ------------------------------------------------------------------------------------------- figures


def histogram_quantiles(text: str, name: str, qs: tuple[float, ...]) -> tuple[int, list[float]]:
    """The count of a Prometheus histogram and its quantiles, interpolated within buckets (ms)."""
    buckets: dict[float, float] = {}
    for m in re.finditer(rf"^{name}_bucket\{{([^}}]*)\}} (\S+)$", text, re.M):
        le = re.search(r'le="([^"]+)"', m.group(1))
        if le:
            bound = float(le.group(1))
            buckets[bound] = buckets.get(bound, 0.0) + float(m.group(2))
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    out = []
    for q in qs:
        if total == 0:
            out.append(math.nan)
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for bound in bounds:
            if buckets[bound] >= rank:
                if math.isinf(bound):
                    out.append(lower * 1e3)  # above the last finite bucket: its bound, as Prometheus does
                else:
                    share = (rank - below) / max(buckets[bound] - below, 1e-12)
                    out.append((lower + (bound - lower) * share) * 1e3)
                break
            lower, below = bound, buckets[bound]
    return int(total), out


def phase_row(
    side: str,
    repeat: int,
    records: list[RequestRecord],
    peak: float,
    text: str,
    vocab: wl.Vocab,
    args: argparse.Namespace,
    cpu_s: float,
) -> dict[str, Any]:
    slo = Slo(ttft=args.slo_ttft_ms, e2e=args.slo_e2e_ms)
    metrics = [request_metrics(r, vocab.count_tokens) for r in records]
    s = summarize(metrics, slo)
    good = sum(1 for m in metrics if meets_slo(m, slo))
    refused = sum(1 for r in records if r.status == 503)
    queued, (wait_p50, wait_p99) = histogram_quantiles(text, "dynamo_frontend_queue_wait_seconds", (0.5, 0.99))
    ttft, e2e = s.latency["ttft"], s.latency["e2e"]
    return {
        "side": side,
        "repeat": repeat,
        "sent": len(records),
        "offered_rps": len(records) / args.duration,
        "completed": s.num_completed,
        "refused_503": refused,
        "errors": s.num_failed - refused,
        "good": good,
        "goodput_rps": good / args.duration,
        "good_pct": 100 * good / max(len(records), 1),
        "throughput_rps": s.request_throughput,
        "ttft_p50_ms": ttft.p50,
        "ttft_p90_ms": ttft.p90,
        "ttft_p99_ms": ttft.p99,
        "e2e_p99_ms": e2e.p99,
        "queued": queued,
        "qwait_p50_ms": wait_p50,
        "qwait_p99_ms": wait_p99,
        "queue_peak": peak,
        "duration_s": s.duration_s,
        "cpu_loadgen_pct": 100 * cpu_s / max(s.duration_s, 1e-9),
        "error_kinds": {k: v for k, v in s.errors.items()},
    }


def side_means(rows: list[dict[str, Any]], sides: list[str]) -> list[dict[str, Any]]:
    """Per side: the mean of each figure over repeats, and goodput over `off`'s in the same repeat."""
    off = {r["repeat"]: r["goodput_rps"] for r in rows if r["side"] == "off"}
    out = []
    for side in sides:
        mine = [r for r in rows if r["side"] == side]
        mean = {k: sum(r[k] for r in mine) / len(mine) for k in mine[0] if isinstance(mine[0][k], (int, float))}
        ratios = [r["goodput_rps"] / off[r["repeat"]] for r in mine if off.get(r["repeat"])]
        mean.update(side=side, repeats=len(mine), goodput_vs_off=sum(ratios) / len(ratios) if ratios else math.nan)
        mean.pop("repeat", None)
        out.append(mean)
    return out


COLUMNS = (
    "side",
    "repeat",
    "offered_rps",
    "sent",
    "completed",
    "refused_503",
    "errors",
    "good",
    "goodput_rps",
    "good_pct",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "e2e_p99_ms",
    "qwait_p50_ms",
    "qwait_p99_ms",
    "queue_peak",
    "goodput_vs_off",
)


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    cells = [[_cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


# ---------------------------------------------------------------------------------------------- main


def measure_capacity(vocab: wl.Vocab, args: argparse.Namespace) -> float:
    slots = args.workers * args.max_inflight
    load = LoadConfig(concurrency=slots, duration_s=args.capacity_seconds, warmup=slots, seed=99)
    with serving("fcfs", args) as serve:
        records, _, _ = run_async(run_load(serve.url, load, vocab, args, None, seed=99))
    # completions in the steady part only: not the ramp (every slot starts at once) nor the drain
    start = min(r.start for r in records) + CAPACITY_SKIP_S
    stop = min(r.start for r in records) + args.capacity_seconds
    done = sum(1 for r in records if r.is_ok and start <= r.end <= stop)
    failed = sum(1 for r in records if not r.is_ok)
    capacity = float(done / (stop - start))
    print(
        f"capacity: {capacity:.2f} req/s closed loop at {slots} clients ({done} completed in the "
        f"{stop - start:.0f} s after the first {CAPACITY_SKIP_S:g} s; {failed} failed)",
        flush=True,
    )
    return capacity


def run_phase(side: str, repeat: int, rate: float, vocab: wl.Vocab, args: argparse.Namespace) -> dict[str, Any]:
    load = LoadConfig(request_rate=rate, arrival="poisson", duration_s=args.duration, seed=repeat)
    headers = {"x-dyn-deadline-ms": str(args.deadline_ms)} if side == "deadline" else None
    with serving(side, args) as serve:
        before = resource.getrusage(resource.RUSAGE_SELF)
        records, peak, text = run_async(run_load(serve.url, load, vocab, args, headers, seed=1000 + repeat))
        after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    row = phase_row(side, repeat, records, peak, text, vocab, args, cpu)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return row


def main() -> None:
    args = parse_args()
    sides = [s for s in args.sides.split(",") if s]
    if unknown := set(sides) - set(SIDES):
        raise SystemExit(f"--sides: unknown {sorted(unknown)} (choose from {', '.join(SIDES)})")
    if not args.capacity and args.capacity_seconds <= CAPACITY_SKIP_S:
        raise SystemExit(f"--capacity-seconds must be > {CAPACITY_SKIP_S:g} (the ramp, not counted)")
    load_before = harness.loadavg()
    vocab = wl.load_vocab(MODEL)
    capacity = args.capacity or measure_capacity(vocab, args)
    rate = args.overload * capacity
    print(
        f"offered load: {rate:.2f} req/s Poisson ({args.overload:g} x capacity), {args.duration:g} s per phase; "
        f"SLO: TTFT <= {args.slo_ttft_ms:g} ms, e2e <= {args.slo_e2e_ms:g} ms",
        flush=True,
    )
    rows = []
    for repeat in range(args.repeats):
        for side in sides if repeat % 2 == 0 else sides[::-1]:
            rows.append(run_phase(side, repeat, rate, vocab, args))
    means = side_means(rows, sides)
    print("\nper phase:")
    print_table(rows)
    print(f"\nmean over {args.repeats} repeat(s); goodput_vs_off = mean of per-repeat ratios to `off`:")
    print_table(means)
    document = {
        "args": vars(args),
        "capacity_rps": capacity,
        "offered_rps": rate,
        "rows": rows,
        "means": means,
    }
    harness.write_results("router_queue", document, args.json, loadavg_start=load_before)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated, of: " + ", ".join(SIDES))
    p.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per phase")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--overload", type=float, default=1.2, help="offered rate / measured capacity")
    p.add_argument("--capacity", type=float, default=0.0, help="req/s; 0: measure it first")
    p.add_argument("--capacity-seconds", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-inflight", type=int, default=8, help="--max-inflight-per-worker")
    p.add_argument("--routers", type=int, default=0, help="N > 0: the queue in N `dyn router` replicas")
    p.add_argument("--speedup", type=float, default=0.25, help="mocker --speedup-ratio")
    p.add_argument("--queue-timeout", type=float, default=0.5, help="--router-queue-timeout (dyn serve's default)")
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--short-osl", type=int, default=16)
    p.add_argument("--long-osl", type=int, default=128)
    p.add_argument("--long-fraction", type=float, default=0.2)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-e2e-ms", type=float, default=5000.0)
    p.add_argument("--deadline-ms", type=int, default=750, help="x-dyn-deadline-ms of the `deadline` side")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--json", default=str(harness.results_path("router_queue")))
    return p.parse_args()


if __name__ == "__main__":
    main()
