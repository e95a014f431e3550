"""Mocker fidelity, live (issue 35): `dyn serve --engine mocker` against a running Dynamo 1.6.1 (its mocker and
frontend processes), the same load generator driving both, one side at a time, alternating by round.

Layouts: `agg1` (one worker), `agg2` (two), `disagg` (one prefill + one decode worker; dyn's default policy) and
`always` (dyn's `--disagg-policy always`; Dynamo's side is the same 1P+1D). Workloads: closed loop at each
`--concurrency`, unique prompts of each `--isl`, OSL 150 with ignore_eos, both mockers at their default timing and
KV sizes (`--speedup-ratio 1`), KV routing on both. Dynamo runs with file discovery, the TCP request plane and the
ZMQ event plane (no etcd or NATS), as its quickstart runs on one box.

Dynamo comes from a separate virtual environment (`--dynamo-python`), made as issue 35 says:

    python -m venv /tmp/dynvenv
    /tmp/dynvenv/bin/pip install --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
    /tmp/dynvenv/bin/pip install 'aiohttp>=3.14.3,<4' msgspec 'prometheus-client<1' pyzmq tqdm \\
        'transformers>=4.56' typing-extensions 'zstandard<1' 'kubernetes>=32.0.1,<33' 'redis<9' certifi \\
        'uvloop>=0.21' 'pydantic>=2.10.6,<=2.13.5'

(`aisimulate`, which the wheel names and the planner alone imports, is left out: it cannot be fetched here.)

    python benchmarks/investigations/mocker_live.py --dynamo-python /tmp/dynvenv/bin/python [--setups agg1,agg2,disagg]
        [--concurrency 4,16] [--isl 3000,500] [--rounds 2] [--seconds 25] [--ramp-up 0]
        [--json benchmarks/out/mocker_live.json]

It prints every run, then per cell the medians over rounds of each side and the ratio dyn / Dynamo, with
Dynamo's own spread (min–max over rounds) beside it. The load average is recorded at the start and the end:
timings are only valid on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (the one path insert: harness.py)
import disagg  # noqa: E402  (dyn's deployments and the dyn bench runs of benchmarks/disagg.py)
import harness  # noqa: E402
from dyn_engines.hf_export import hf_model_dir  # noqa: E402

SERVED = "smol"
"""The model name Dynamo's side serves under."""
LAYOUTS = ("agg1", "agg2", "disagg", "always")
FIGURES = (
    ("req/s", "request_throughput"),
    ("TTFT p50", "ttft.p50"),
    ("TTFT p90", "ttft.p90"),
    ("ITL p50", "itl.p50"),
    ("ITL p99", "itl.p99"),
)
TOLERANCE = 0.10


def dyn_flags(layout: str) -> list[str]:
    flags = ["--engine", "mocker", "--speedup-ratio", "1", "--router", "kv"]
    if layout.startswith("agg"):
        return [*flags, "--workers", layout.removeprefix("agg")]
    policy = "always" if layout == "always" else "adaptive"
    return [*flags, "--disagg", "--prefill-workers", "1", "--decode-workers", "1", "--disagg-policy", policy]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def dynamo(python: str, layout: str, tmp: Path, timeout_s: float = 120.0) -> Iterator[disagg.Side]:
    """Dynamo 1.6.1 in `layout`: its mocker workers and frontend as processes, up for the block, then stopped."""
    store = tmp / f"dynamo-{layout}.kv"
    store.mkdir()
    env = {**os.environ, "DYN_FILE_KV": str(store), "DYN_LOG": "warn"}
    planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    model = ["--model-path", hf_model_dir(disagg.MODEL), "--model-name", SERVED]
    workers: list[list[str]] = (
        [["--num-workers", layout.removeprefix("agg")]]
        if layout.startswith("agg")
        else [["--disaggregation-mode", "prefill"], ["--disaggregation-mode", "decode"]]
    )
    port = free_port()
    log = tmp / f"dynamo-{layout}.log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with log.open("wb") as out:
            for extra in workers:
                argv = [python, "-m", "dynamo.mocker", *model, *planes, *extra]
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env))
            frontend = [python, "-m", "dynamo.frontend", "--http-port", str(port), *planes, "--router-mode", "kv"]
            procs.append(subprocess.Popen(frontend, stdout=out, stderr=subprocess.STDOUT, env=env))
        side = disagg.Side(f"dynamo-{layout}", [], url=f"http://127.0.0.1:{port}", log=log)
        _wait_ready(side, procs, timeout_s)
        print(f"  {side.name}: {side.url}", flush=True)
        yield side
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _wait_ready(side: disagg.Side, procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Until a completion comes back (for disagg that needs both workers registered), or raise with the log."""
    body = {"model": SERVED, "prompt": "warm up", "max_tokens": 2}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        try:
            if httpx.post(f"{side.url}/v1/completions", json=body, timeout=10).status_code == 200:
                time.sleep(2.0)  # every worker registered (the second may trail the first)
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    log = side.log.read_text(errors="replace")[-3000:] if side.log else ""
    raise SystemExit(f"Dynamo ({side.name}) did not come up; log:\n{log}")


def cell_label(c: int, isl: int) -> str:
    return f"c{c} isl{isl}"


def spread(values: list[float]) -> str:
    finite = [v for v in values if v == v]
    return f"{min(finite):.4g}–{max(finite):.4g}" if finite else "nan"


def report(runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]]) -> list[dict[str, Any]]:
    """Per layout and cell: dyn / Dynamo of the medians over rounds, Dynamo's spread, and whether within the bar."""
    rows: list[dict[str, Any]] = []
    header = ["layout", "cell", *(f"{label} dyn / Dynamo (Dynamo's spread)" for label, _ in FIGURES)]
    table: list[list[Any]] = []
    for layout, cells in runs.items():
        for cell, sides in cells.items():
            ours, theirs = sides["dyn"], sides["dynamo"]
            row: dict[str, Any] = {"layout": layout, "cell": cell}
            shown: list[Any] = [layout, cell]
            for _, key in FIGURES:
                a = disagg.median([disagg.figure(r, key) for r in ours])
                b = disagg.median([disagg.figure(r, key) for r in theirs])
                values = [disagg.figure(r, key) for r in theirs]
                row[key] = {"dyn": a, "dynamo": b, "ratio": a / b if b else float("nan"), "dynamo_spread": values}
                shown.append(f"{a:.4g} / {b:.4g} = {a / b:.3f} ({spread(values)})")
            rows.append(row)
            table.append(shown)
    disagg.table("dyn / Dynamo 1.6.1, live, medians over rounds (ms, req/s)", header, table)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dynamo-python", required=True, help="a python with ai-dynamo 1.6.1 installed")
    p.add_argument("--setups", default="agg1,agg2,disagg")
    p.add_argument("--concurrency", default="4,16")
    p.add_argument("--isl", default="3000,500")
    p.add_argument("--osl", type=int, default=150)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=25.0)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--ramp-up", type=float, default=0.0, help="dyn bench --ramp-up (s), the same for both sides")
    p.add_argument("--json", default=str(harness.results_path("mocker_live")))
    args = p.parse_args()
    layouts = args.setups.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        raise SystemExit(f"unknown --setups {sorted(unknown)}; known: {', '.join(LAYOUTS)}")
    cells = [(int(c), int(i)) for c in args.concurrency.split(",") for i in args.isl.split(",")]
    load_start = harness.loadavg()
    runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for layout in layouts:
            ours = disagg.Side(layout, dyn_flags(layout))
            with disagg.deployed([ours], tmp), dynamo(args.dynamo_python, layout, tmp) as theirs:
                runs[layout] = {}
                for c, isl in cells:
                    label = cell_label(c, isl)
                    got: dict[str, list[dict[str, Any]]] = {"dyn": [], "dynamo": []}
                    for rnd in range(args.rounds):
                        order = [("dyn", ours), ("dynamo", theirs)]
                        for name, side in order if rnd % 2 == 0 else order[::-1]:
                            load = [
                                *("--isl", str(isl), "--osl", str(args.osl), "--concurrency", str(c)),
                                *("--duration", str(args.seconds), "--warmup", str(args.warmup)),
                                *("--ramp-up", str(args.ramp_up), "--seed", str(rnd)),
                            ]
                            if name == "dynamo":
                                load += ["--model", SERVED]
                            result = disagg.bench(side, tmp, f"{layout}-{label}-{name}-r{rnd}", load)
                            got[name].append(result["summary"])
                            disagg.show(f"{layout} {label} round {rnd} {name}", result)
                    runs[layout][label] = got
    rows = report(runs)
    results = {"args": vars(args), "cells": rows, "runs": runs}
    harness.write_results("mocker_live", results, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
