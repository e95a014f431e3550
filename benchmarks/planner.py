"""The SLA planner against static deployments on a real mocker deployment, then in `dyn plan simulate` (issue 14).

One trace, three sides, one after the other, each a fresh `dyn serve --engine mocker` on its own file://
discovery dir, loaded by `dyn bench --trace` (open loop, the trace's timestamps):

- `planner`: `dyn serve --workers 0` + `dyn plan run --connector local --mode agg` (it starts, stops and
  drains `dyn worker` processes); worker-seconds = the planner's worker processes, counted every 0.25 s
  from the first request sent to the last answer.
- `static peak` and `static mean`: `dyn serve --workers N`, N sized for the peak and the mean rate (one
  worker holds `agg_capacity` req/s at the targets × headroom); worker-seconds = N × the same span.

Per side: the fraction of requests meeting both the TTFT and the ITL target (ITL per request: (e2e − TTFT)
/ (tokens − 1)), worker-seconds, failed requests. Bar: planner ≥ 95 % with ≤ 65 % of the peak side's
worker-seconds and no failed request. Then the same trace through `dyn plan simulate` (the API, same
profile and planner settings, `--startup` = the planner side's measured time to its first worker): its
attainment within 5 points and its worker-seconds within 10 % of the real run. Last, the simulator's wall
time on a 24-hour synthetic trace (sin² from 5 % to 100 % of `--day-peak-rate`) with up to 128 workers.

Trace: Poisson arrivals, ISL `--isl` (2,000), OSL `--osl` (150), rate 5 → 40 → 5 req/s as
base + (peak − base)·sin²(π t / T) over `--minutes`. Workers are mockers with 4,096 KV blocks of 64
tokens (262,144 tokens, as Dynamo's mocker default of 16,384 × 16), where one holds ~7.5 req/s at TTFT
500 ms, ITL 40 ms × headroom 0.8: the peak is 6 workers' worth, the mean 3. The profile is `dyn plan
profile --engine mocker --speedup-ratio --profile-speedup` (2: the mocker's per-pass Python overhead,
multiplied back by the ratio, stays small), or `--profile FILE`.

    python benchmarks/planner.py                      # the full run: ~35 min (3 × 10 min + profile + day)
    python benchmarks/planner.py --minutes 1.5 --day-hours 1    # a check that the script works (~6 min)

The load average is printed and recorded at the start and the end: figures are only valid on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import harness
import httpx
from disagg import Side, bench, start, stop

from dynamo_cli.planner.planner import PlannerConfig
from dynamo_cli.planner.profile import Profile, load_profile
from dynamo_cli.planner.simulate import load_trace, rate_curve, run_simulation, simulate
from dynamo_cli.planner.simworker import SimRequest
from dynamo_cli.planner.sizing import Bounds, Targets, agg_capacity

SECRET_ENV = {"DYN_CLUSTER_SECRET": "5e" * 32}
DYN = [sys.executable, "-m", "dynamo_cli.cli.main"]


def curve(seconds: float, base: float, peak: float, step_s: float = 5.0) -> str:
    """`T:RATE,...` of base + (peak − base)·sin²(π t / seconds), piecewise constant every `step_s`."""
    points = [
        f"{t:g}:{base + (peak - base) * math.sin(math.pi * t / seconds) ** 2:.2f}"
        for t in (i * step_s for i in range(math.ceil(seconds / step_s)))
    ]
    return ",".join([*points, f"{seconds:g}:0"])


def write_trace(path: Path, requests: list[SimRequest]) -> None:
    """Mooncake JSONL, as `dyn bench --trace` and `dyn plan simulate --trace` read it."""
    path.write_text(
        "".join(
            json.dumps({"timestamp": round(r.arrival_s * 1000, 3), "input_length": r.isl, "output_length": r.osl})
            + "\n"
            for r in requests
        )
    )


def make_profile(args: argparse.Namespace, tmp: Path) -> Path:
    if args.profile:
        return Path(args.profile)
    path = tmp / "profile.json"
    started = time.monotonic()
    argv = [
        *DYN,
        "plan",
        "profile",
        "--engine",
        "mocker",
        "--out",
        str(path),
        "--speedup-ratio",
        str(args.profile_speedup),
        "--isls",
        "512,1024,2048,4096,8192",
        "--num-gpu-blocks",
        str(args.num_gpu_blocks),
    ]
    subprocess.run(argv, check=True, timeout=1800)
    print(f"  profile: {path} ({time.monotonic() - started:.0f} s at --speedup-ratio {args.profile_speedup})")
    return path


def sizes(args: argparse.Namespace, profile: Profile) -> tuple[float, int, int]:
    """(req/s one worker holds, workers for the peak, workers for the mean rate)."""
    per_worker = agg_capacity(profile, args.isl, args.osl, Targets(args.ttft, args.itl), args.headroom).rate
    mean = args.base_rate + (args.peak_rate - args.base_rate) / 2
    return per_worker, math.ceil(args.peak_rate / per_worker), math.ceil(mean / per_worker)


def attainment(result: dict[str, Any], ttft: float, itl: float) -> tuple[float, int, int]:
    """(fraction of all requests meeting both targets, requests, failed)."""
    rows = result["rows"]
    met = sum(
        1
        for r in rows
        if r["ok"] and (r["ttft_ms"] or math.inf) <= ttft and (r["itl_ms"] is None or r["itl_ms"] <= itl)
    )
    return met / max(len(rows), 1), len(rows), sum(1 for r in rows if not r["ok"])


def load(side: Side, tmp: Path, trace: Path, minutes: float) -> dict[str, Any]:
    return bench(side, tmp, "trace", ["--trace", str(trace), "--timeout", "120"], timeout_s=minutes * 60 + 900)


def serve_flags(args: argparse.Namespace, workers: int) -> list[str]:
    return [
        "--engine",
        "mocker",
        "--speedup-ratio",
        str(args.speedup_ratio),
        "--router",
        "round-robin",
        "--num-gpu-blocks",
        str(args.num_gpu_blocks),
        "--workers",
        str(workers),
    ]


def run_static(args: argparse.Namespace, tmp: Path, trace: Path, workers: int, name: str) -> dict[str, Any]:
    side = Side(name, serve_flags(args, workers), env=SECRET_ENV)
    try:
        start(side, tmp)
        started = time.monotonic()
        result = load(side, tmp, trace, args.minutes)
        span = time.monotonic() - started
    finally:
        stop(side)
    return summarize(name, result, args, workers * span, workers)


def summarize(
    name: str, result: dict[str, Any], args: argparse.Namespace, worker_s: float, most: int
) -> dict[str, Any]:
    fraction, count, failed = attainment(result, args.ttft, args.itl)
    row = {
        "side": name,
        "attainment": fraction,
        "requests": count,
        "failed": failed,
        "worker_seconds": worker_s,
        "most_workers": most,
    }
    print(
        f"  {name:>12}: SLO attainment {fraction:6.1%}, worker-seconds {worker_s:8.0f}, failed {failed}, "
        f"requests {count}, most workers {most}",
        flush=True,
    )
    return row


def children(pid: int) -> int:
    try:
        return len(Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    except OSError:
        return 0


class WorkerClock:
    """Integrates the planner's worker processes over time (a thread, sampling every 0.25 s)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.worker_s, self.most = pid, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WorkerClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.25):
            now, count = time.monotonic(), children(self.pid)
            self.worker_s += count * (now - last)
            self.most, last = max(self.most, count), now


def routable_workers(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(m.group(1)) for m in re.finditer(r"^dynamo_frontend_workers\{[^}]*\} (\S+)", text, re.M))


def planner_argv(args: argparse.Namespace, side: Side, tmp: Path, profile: Path) -> list[str]:
    return [
        *DYN,
        "plan",
        "run",
        "--profile",
        str(profile),
        "--ttft",
        str(args.ttft),
        "--itl",
        str(args.itl),
        "--mode",
        "agg",
        "--interval",
        str(args.interval),
        "--load-interval",
        str(args.load_interval),
        "--min-workers",
        "1",
        "--max-workers",
        str(args.max_workers),
        "--headroom",
        str(args.headroom),
        "--startup",
        str(args.startup),
        "--discovery",
        f"file://{tmp}/{side.name}.d",
        "--connector",
        "local",
        "--engine",
        "mocker",
        "--speedup-ratio",
        str(args.speedup_ratio),
        "--engine-arg",
        f"num_gpu_blocks={args.num_gpu_blocks}",
        "--duration",
        str(args.minutes * 60 + 600),
    ]


def run_planner(args: argparse.Namespace, tmp: Path, trace: Path, profile: Path) -> dict[str, Any]:
    side = Side("planner", serve_flags(args, 0), env=SECRET_ENV)
    log = (tmp / "plan.log").open("wb")
    planner: subprocess.Popen[bytes] | None = None
    try:
        start(side, tmp)
        launched = time.monotonic()
        planner = subprocess.Popen(
            planner_argv(args, side, tmp, profile),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SECRET_ENV},
        )
        while routable_workers(side.url) < 1:
            if planner.poll() is not None or time.monotonic() - launched > 120:
                raise SystemExit(f"the planner started no worker; log:\n{(tmp / 'plan.log').read_text()[-3000:]}")
            time.sleep(0.1)
        startup = time.monotonic() - launched
        with WorkerClock(planner.pid) as clock:
            result = load(side, tmp, trace, args.minutes)
    finally:
        if planner is not None and planner.poll() is None:
            planner.terminate()  # it drains and stops its workers
            planner.wait(60)
        log.close()
        stop(side)
    decisions = [
        line for line in (tmp / "plan.log").read_text(errors="replace").splitlines() if line.startswith("decision ")
    ]
    row = summarize("planner", result, args, clock.worker_s, clock.most)
    row.update(startup_s=startup, decisions=len(decisions), decision_log=decisions)
    print(f"  planner: first worker serving {startup:.1f} s after launch; {len(decisions)} decisions")
    return row


def planner_config(args: argparse.Namespace, max_workers: int) -> PlannerConfig:
    return PlannerConfig(
        targets=Targets(args.ttft, args.itl),
        bounds=Bounds(1, max_workers),
        mode="agg",
        interval_s=args.interval,
        load_interval_s=args.load_interval,
        headroom=args.headroom,
        startup_s=args.startup,
    )


def simulated(
    args: argparse.Namespace, trace: Path, profile: Profile, statics: list[int], startup: float
) -> dict[str, Any]:
    started = time.monotonic()
    results = run_simulation(
        load_trace(trace), profile, args.ttft, args.itl, statics, planner_config(args, args.max_workers), startup
    )
    wall = time.monotonic() - started
    rows = [
        {
            "side": r.policy,
            "attainment": r.attainment,
            "worker_seconds": r.worker_seconds,
            "most_workers": r.max_workers,
            "requests": r.num_requests,
        }
        for r in results
    ]
    for r in rows:
        print(
            f"  {'sim ' + r['side']:>12}: SLO attainment {r['attainment']:6.1%}, worker-seconds "
            f"{r['worker_seconds']:8.0f}, most workers {r['most_workers']}"
        )
    return {"rows": rows, "wall_s": wall, "startup_s": startup}


def day(args: argparse.Namespace, profile: Profile) -> dict[str, Any]:
    """The simulator's wall time on `--day-hours` of sin² traffic: the planner (up to 128 workers), static 128."""
    seconds = args.day_hours * 3600
    requests = rate_curve(
        curve(seconds, 0.05 * args.day_peak_rate, args.day_peak_rate, 60.0), args.isl, args.osl, seed=1
    )
    config = replace(planner_config(args, 128), startup_s=30.0)  # the day's workers take 30 s to serve
    walls = {}
    for name, kwargs in (("planner", {"planner": config, "startup_s": 30.0}), ("static 128", {"static_workers": 128})):
        started = time.monotonic()
        result = asyncio.run(simulate(requests, profile, args.ttft, args.itl, **kwargs))  # type: ignore[arg-type]
        walls[name] = time.monotonic() - started
        print(
            f"  day, {name}: {args.day_hours:g} h, {len(requests)} requests simulated in {walls[name]:.1f} s "
            f"({seconds / walls[name]:.0f}× real time); attainment {result.attainment:.1%}, worker-seconds "
            f"{result.worker_seconds:.0f}, most workers {result.max_workers}",
            flush=True,
        )
    return {"hours": args.day_hours, "requests": len(requests), "wall_s": walls}


def verdict(real: list[dict[str, Any]], sim: dict[str, Any]) -> dict[str, Any]:
    planner, peak = real[0], real[1]
    sim_planner = next(r for r in sim["rows"] if r["side"] == "planner")
    out = {
        "planner_attainment_ok": planner["attainment"] >= 0.95,
        "planner_worker_share_of_peak": planner["worker_seconds"] / peak["worker_seconds"],
        "no_failed": all(r["failed"] == 0 for r in real),
        "sim_attainment_points": 100 * (sim_planner["attainment"] - planner["attainment"]),
        "sim_worker_seconds_pct": 100 * (sim_planner["worker_seconds"] / planner["worker_seconds"] - 1),
    }
    print(
        f"\nbar: planner attainment {planner['attainment']:.1%} (>= 95 %), worker-seconds "
        f"{out['planner_worker_share_of_peak']:.0%} of the peak side (<= 65 %), failed "
        f"{sum(r['failed'] for r in real)} (0); simulate vs real: attainment {out['sim_attainment_points']:+.1f} "
        f"points (within 5), worker-seconds {out['sim_worker_seconds_pct']:+.1f} % (within 10)"
    )
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="length of the trace (every side runs it once)")
    p.add_argument("--base-rate", type=float, default=5.0, help="req/s at the start and the end")
    p.add_argument("--peak-rate", type=float, default=40.0, help="req/s in the middle")
    p.add_argument("--isl", type=int, default=2000)
    p.add_argument("--osl", type=int, default=150)
    p.add_argument("--ttft", type=float, default=500.0, help="TTFT target (ms)")
    p.add_argument("--itl", type=float, default=40.0, help="ITL target (ms)")
    p.add_argument("--interval", type=float, default=15.0, help="planner throughput step (s)")
    p.add_argument("--load-interval", type=float, default=2.0, help="planner burst check (s)")
    p.add_argument("--headroom", type=float, default=0.8)
    p.add_argument(
        "--startup",
        type=float,
        default=5.0,
        help="the planner's --startup: how long a mocker worker takes to serve (measured: ~3.3 s)",
    )
    p.add_argument("--max-workers", type=int, default=12)
    p.add_argument("--speedup-ratio", type=float, default=1.0, help="the deployments' mocker (1: real time)")
    p.add_argument("--num-gpu-blocks", type=int, default=4096, help="mocker KV blocks of 64 tokens")
    p.add_argument("--profile", default="", help="a profile JSON instead of profiling the mocker")
    p.add_argument("--profile-speedup", type=float, default=2.0)
    p.add_argument("--sides", default="planner,peak,mean")
    p.add_argument("--day-hours", type=float, default=24.0)
    p.add_argument("--day-peak-rate", type=float, default=60.0, help="req/s at the day's peak")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(harness.results_path("planner")))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    document: dict[str, Any] = {"args": vars(args)}
    load_start = harness.loadavg()
    print(f"load average at start: {load_start}  (timings are valid only on a quiet machine)", flush=True)
    with tempfile.TemporaryDirectory(prefix="dyn-planner-") as name:
        tmp = Path(name)
        profile_path = make_profile(args, tmp)
        profile = load_profile(profile_path)
        per_worker, peak, mean = sizes(args, profile)
        seconds = args.minutes * 60
        trace = tmp / "trace.jsonl"
        write_trace(trace, rate_curve(curve(seconds, args.base_rate, args.peak_rate), args.isl, args.osl, args.seed))
        print(
            f"  trace: {len(trace.read_text().splitlines())} requests over {seconds:g} s; one worker holds "
            f"{per_worker:.2f} req/s → peak side {peak} workers, mean side {mean}",
            flush=True,
        )
        real = []
        wanted = args.sides.split(",")
        for side in wanted:
            print(f"\n== {side}", flush=True)
            if side == "planner":
                real.append(run_planner(args, tmp, trace, profile_path))
            else:
                real.append(run_static(args, tmp, trace, peak if side == "peak" else mean, f"static {side}"))
        document["real"] = real
        startup = real[0].get("startup_s", 5.0) if wanted[0] == "planner" else 5.0
        print("\n== simulate", flush=True)
        document["simulate"] = simulated(args, trace, profile, [peak, mean], startup)
        if wanted[:2] == ["planner", "peak"]:
            document["verdict"] = verdict(real, document["simulate"])
        if args.day_hours > 0:
            print("\n== simulate a day", flush=True)
            document["day"] = day(args, profile)
    harness.write_results("planner", document, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
