"""The planner on linear ramps of the request rate, against an oracle and the peak pool (issue 35, item 5).

Virtual time only (`dyn plan simulate`'s model, no processes): each case is a Poisson trace, replayed by the
planner (this checkout's, and with `--before FILE` another planner.py too), by the oracle (the planner's
sizing, knowing the curve: each worker starts a startup before the rate needs it) and by the static pool
sized for the peak rate. Printed per case: SLO attainment (both targets; mean over `--seeds`, worst in
brackets) and worker-seconds as a share of the peak pool's.

Ramps: 5 req/s for a minute, then 5 → 40 → 5 req/s, up and down at the same slope, for each `--startups`
value at 0.5×, 1× and 2× the slope a single worker's start-up can follow (`sizing.max_ramp_slope`: half of
one worker's rate, `agg_capacity` at the ISL/OSL and the targets × headroom, per startup; 2× is one worker's
rate per startup). Then the step and sin² curves of RESULTS.md's planner sections.

    python benchmarks/planner_ramps.py --profile /tmp/profile.json
    python benchmarks/planner_ramps.py --profile /tmp/profile.json --before /tmp/old_planner.py
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import harness

from dynamo_cli.planner import simulate as sim
from dynamo_cli.planner.planner import PlannerConfig
from dynamo_cli.planner.profile import Profile, load_profile
from dynamo_cli.planner.sizing import Bounds, Targets, agg_capacity, max_ramp_slope

BASE, PEAK = 5.0, 40.0
LEAD_IN_S = 60.0
"""The steady rate before each ramp: the planner starts a ramp having seen a minute of its base."""


def ramp(slope: float) -> str:
    """5 req/s for a minute, then up to 40 and back to 5 at `slope` req/s per second (`--rate-curve ... --linear`)."""
    up = (PEAK - BASE) / slope
    return f"0:{BASE:g},{LEAD_IN_S:g}:{BASE:g},{LEAD_IN_S + up:.1f}:{PEAK:g},{LEAD_IN_S + 2 * up:.1f}:{BASE:g}"


def sin2(seconds: float, base: float, peak: float) -> str:
    points = [
        f"{t}:{base + (peak - base) * math.sin(math.pi * t / seconds) ** 2:.2f}" for t in range(0, int(seconds), 5)
    ]
    return ",".join([*points, f"{seconds:g}:0"])


STEPS = {
    "issue 35's ramp 5→40→5, 300 s up (linear)": "0:5,300:40,600:5",
    "issue 35's ramp 5→40→5, 600 s up (linear)": "0:5,600:40,1200:5",
    "step 5/40/5, 300 s each": "0:5,300:40,600:5,900:0",
    "step 5/40/5, 600 s each": "0:5,600:40,1200:5,1800:0",
    "step 40 from 200 to 400 s": "0:5,200:40,400:5,600:0",
    "stairs 5,15,25,40,15,5 (2 min each)": "0:5,120:15,240:25,360:40,480:15,600:5,720:0",
    "sin² 5→40→5, 10 min": sin2(600, 5, 40),
    "sin² 3→30→3, 20 min": sin2(1200, 3, 30),
}


@contextmanager
def planner_from(path: Path | None) -> Iterator[None]:
    """Run the simulator with the Planner class of another planner.py (None: this checkout's)."""
    if path is None:
        yield
        return
    spec = importlib.util.spec_from_file_location("dynamo_cli.planner._before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    own = sim.Planner
    sim.Planner = module.Planner
    try:
        yield
    finally:
        sim.Planner = own


def run_case(
    args: argparse.Namespace, profile: Profile, spec: str, linear: bool, startup: float
) -> dict[str, tuple[float, float, float]]:
    """policy → (mean attainment, worst attainment, mean worker-seconds / peak pool's)."""
    config = PlannerConfig(targets=Targets(args.ttft, args.itl), bounds=Bounds(1, 128), mode="agg", startup_s=startup)
    peak_rate = max(float(part.split(":")[1]) for part in spec.split(","))
    capacity = agg_capacity(profile, args.isl, args.osl, config.targets, config.headroom).rate
    rates = sim.curve_rates(spec, args.isl, args.osl, linear)
    out: dict[str, list[tuple[float, float]]] = {}
    for seed in range(args.seeds):
        requests = sim.rate_curve(spec, args.isl, args.osl, seed, linear)
        peak = asyncio.run(
            sim.simulate(requests, profile, args.ttft, args.itl, static_workers=math.ceil(peak_rate / capacity))
        )
        sides = [("before", args.before, False)] if args.before else []
        for name, path, oracle in [*sides, ("after", None, False), ("oracle", None, True)]:
            with planner_from(path):
                result = asyncio.run(
                    sim.simulate(
                        requests,
                        profile,
                        args.ttft,
                        args.itl,
                        planner=config,
                        startup_s=startup,
                        oracle=oracle,
                        rates=rates,
                    )
                )
            out.setdefault(name, []).append((result.attainment, result.worker_seconds / peak.worker_seconds))
    return {
        name: (sum(a for a, _ in v) / len(v), min(a for a, _ in v), sum(w for _, w in v) / len(v))
        for name, v in out.items()
    }


def cells(result: dict[str, tuple[float, float, float]]) -> str:
    return " | ".join(f"{m:.1%} ({w:.1%}), {ws:.0%}" for m, w, ws in result.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, required=True, help="from `dyn plan profile --engine mocker`")
    parser.add_argument("--before", type=Path, default=None, help="another planner.py to compare")
    parser.add_argument("--startups", default="30,60,120")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--ttft", type=float, default=500.0)
    parser.add_argument("--itl", type=float, default=40.0)
    parser.add_argument("--isl", type=int, default=2000)
    parser.add_argument("--osl", type=int, default=150)
    parser.add_argument("--no-steps", action="store_true", help="ramps only")
    parser.add_argument("--json", default=str(harness.results_path("planner_ramps")))
    args = parser.parse_args()
    load_start = harness.loadavg()
    rows: list[dict[str, Any]] = []
    profile = load_profile(args.profile)
    targets = Targets(args.ttft, args.itl)
    capacity = agg_capacity(profile, args.isl, args.osl, targets, 0.8).rate
    print(f"load average at start: {load_start[0]:.2f}; one worker holds {capacity:.2f} req/s", flush=True)
    sides = ("before | " if args.before else "") + "after | oracle"
    print(f"| case | startup | slope | {sides} |")
    started = time.monotonic()
    for startup in (float(s) for s in args.startups.split(",")):
        bound = max_ramp_slope(profile, args.isl, args.osl, targets, 0.8, startup)
        for factor in (0.5, 1.0, 2.0):
            slope = factor * bound
            result = run_case(args, profile, ramp(slope), True, startup)
            case = f"ramp, {(PEAK - BASE) / slope:.0f} s up | {startup:g} s | {factor:g}× ({slope:.3f}/s)"
            print(f"| {case} | {cells(result)} |", flush=True)
            rows.append({"case": case, "startup_s": startup, "slope_factor": factor, "sides": result})
    if not args.no_steps:
        for name, spec in STEPS.items():
            for startup in (30.0, 5.0):
                result = run_case(args, profile, spec, "(linear)" in name, startup)
                print(f"| {name} | {startup:g} s | – | {cells(result)} |", flush=True)
                rows.append({"case": name, "startup_s": startup, "sides": result})
    print(f"{time.monotonic() - started:.0f} s")
    harness.write_results("planner_ramps", {"args": vars(args), "rows": rows}, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
