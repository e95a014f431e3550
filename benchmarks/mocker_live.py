"""First tokens side by side (issue 47): `dyn serve --engine mocker` against a running Dynamo 1.6.1 (its mocker and
frontend processes), the same independent client (`replay_client.py`, aiohttp) driving both, alternating by round.

Both mockers run Dynamo's timing model at speedup 1 with the same KV blocks, block size and batch limits. Setups:

- `trace-kv`, `trace-rr`: 4 workers under cache pressure (`--blocks` each), open-loop replay of a window of Mooncake's
  FAST'25 conversation trace (`data/mooncake_conversation.jsonl`, its first 2,000 requests), lengths divided by
  `--length-scale` (512-token hash blocks become 64-token blocks, the mockers' block), time divided by `--speed`;
  KV routing or round-robin on both sides.
- `disagg`: 1 prefill + 1 decode worker, closed loop at `--concurrency`, unique prompts of `--isl`, OSL `--osl`
  (dyn's default conditional policy; Dynamo's prefill router).
- `agg2`: 2 workers, the same closed loop.
- `cpu-CxT` (`cpu-1x16`, `cpu-8x128`, `cpu-32x16`, `cpu-64x16`): CPU per request, frontend + worker. 1 worker, both
  mockers at speedup 1000 (the engine's time near zero), closed loop of C clients for `--seconds`, unique ~100-token
  prompts, T output tokens. `cpu_ms_req` is the CPU seconds of every process of the side (dyn serve and its
  children; Dynamo's frontend and mocker) over the round, per completed request.

Requests are chat completions of one user message (the model's default system prompt around it), streamed, with
`ignore_eos`. Prompts longer than the model's context are clipped in the trace, so both sides serve the same work.
Dynamo runs with file discovery, the TCP request plane and the ZMQ event plane (no etcd or NATS), as its quickstart
runs on one box; dyn with its embedded planes. Dynamo comes from a separate virtual environment (`--dynamo-python`):

    python -m venv /tmp/dynvenv
    /tmp/dynvenv/bin/pip install --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
    /tmp/dynvenv/bin/pip install 'aiohttp>=3.14.3,<4' msgspec 'prometheus-client<1' pyzmq tqdm \\
        'transformers>=4.56' typing-extensions 'zstandard<1' 'kubernetes>=32.0.1,<33' 'redis<9' certifi \\
        'uvloop>=0.21' 'pydantic>=2.10.6,<=2.13.5'

    python benchmarks/mocker_live.py --dynamo-python /tmp/dynvenv/bin/python [--setups trace-kv,trace-rr,disagg,agg2]
        [--rounds 3] [--seconds 60] [--speed 4] [--json benchmarks/out/mocker_live.json]

It prints every run, then per setup the medians over rounds of each side and the ratio dyn / Dynamo with both
sides' spreads, and an A/A pair (Dynamo's rounds against each other) as the noise floor. The load average is
recorded at the start and the end: timings are only valid on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import disagg
import harness
import httpx
import replay_client as rc
from dyn_engines.hf_export import hf_model_dir

SERVED = "smol"
"""The model name both sides serve under."""
TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation.jsonl"
CPU_CELLS = {"cpu-1x16": (1, 16), "cpu-8x128": (8, 128), "cpu-32x16": (32, 16), "cpu-64x16": (64, 16)}
"""CPU cells: (concurrency, output tokens)."""
SETUPS = ("trace-kv", "trace-rr", "disagg", "agg2", *CPU_CELLS)
FIGURES = (
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "itl_p99",
    "gap1_p50",
    "itl_later_p99",
    "e2e_p90",
    "req_s",
    "hit_rate",
    "cpu_ms_req",
)
CPU_ISL = 100
CPU_TOKENS_PER_S = 40_000
"""More output tokens a second than either side streams at speedup 1000: a cell's jobs outlast its `--seconds`."""
TRANSFER = {"kv_transfer_bandwidth": 64, "kv_bytes_per_token": 23040}
"""The modelled KV transfer, the same on both sides: 64 GB/s, SmolLM2-135M's KV (30 layers x 2 x 3 KV heads x 64 x 2
bytes; dyn's mocker and Dynamo's read the same from the model, but an unset bandwidth is no delay at all in both)."""
CONTEXT = 8192
"""dyn's mocker context; trace prompts are clipped below it (Dynamo's mocker has no limit)."""


def shape(setup: str, args: argparse.Namespace) -> dict[str, Any]:
    """Workers, router, KV blocks and mocker speedup of a setup, the same on both sides."""
    if setup.startswith("trace"):
        router = "kv" if setup == "trace-kv" else "round-robin"
        return {"workers": 4, "router": router, "blocks": args.blocks, "speedup": 1}
    if setup in CPU_CELLS:
        return {"workers": 1, "router": "round-robin", "blocks": 16384, "speedup": 1000}
    return {"workers": 2 if setup == "agg2" else 0, "router": "kv", "blocks": 16384, "speedup": 1}


def dyn_flags(setup: str, args: argparse.Namespace) -> list[str]:
    s = shape(setup, args)
    flags = ["--engine", "mocker", "--speedup-ratio", str(s["speedup"]), "--router", s["router"]]
    flags += ["--served-model-name", SERVED]
    flags += ["--num-gpu-blocks", str(s["blocks"])]
    flags += [arg for key, value in TRANSFER.items() for arg in ("--engine-arg", f"{key}={value}")]
    flags += args.dyn_flags.split()
    if s["workers"]:
        return [*flags, "--workers", str(s["workers"])]
    return [*flags, "--disagg", "--prefill-workers", "1", "--decode-workers", "1"]


@contextlib.contextmanager
def dynamo(
    python: str, setup: str, args: argparse.Namespace, tmp: Path, timeout_s: float = 120.0
) -> Iterator[tuple[str, list[int]]]:
    """Dynamo 1.6.1 in `setup`: its mocker workers and frontend as processes, up for the block (its URL and PIDs),
    then stopped."""
    s = shape(setup, args)
    store = tmp / f"dynamo-{setup}.kv"
    store.mkdir()
    env = {**os.environ, "DYN_FILE_KV": str(store), "DYN_LOG": "warn"}
    planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    model = ["--model-path", hf_model_dir(disagg.MODEL), "--model-name", SERVED]
    model += ["--num-gpu-blocks-override", str(s["blocks"]), "--speedup-ratio", str(s["speedup"])]
    model += [arg for key, value in TRANSFER.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
    workers = (
        [["--num-workers", str(s["workers"])]]
        if s["workers"]
        else [["--disaggregation-mode", "prefill"], ["--disaggregation-mode", "decode"]]
    )
    port = harness.free_port()
    log = tmp / f"dynamo-{setup}.log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with log.open("wb") as out:
            for extra in workers:
                argv = [python, "-m", "dynamo.mocker", *model, *planes, *extra]
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env))
            frontend = [python, "-m", "dynamo.frontend", "--http-port", str(port), *planes]
            procs.append(subprocess.Popen([*frontend, "--router-mode", s["router"]], stdout=out, stderr=out, env=env))
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, procs, log, timeout_s)
        print(f"  dynamo-{setup}: {url}", flush=True)
        yield url, [p.pid for p in procs]
    finally:
        for proc in procs:
            harness.stop_process(proc)


def _wait_ready(url: str, procs: list[subprocess.Popen[bytes]], log: Path, timeout_s: float) -> None:
    """Until a completion comes back (for disagg that needs both workers registered), or raise with the log."""
    body = {"model": SERVED, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        with contextlib.suppress(httpx.HTTPError):
            if httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).status_code == 200:
                time.sleep(3.0)  # every worker registered (the others may trail the first)
                return
        time.sleep(1.0)
    raise SystemExit(f"Dynamo did not come up; log:\n{log.read_text(errors='replace')[-3000:]}")


def jobs_for(setup: str, args: argparse.Namespace, words: rc.Words, rnd: int) -> list[rc.Job]:
    """The trace window (the same requests every round, with new words: every round starts with cold caches), or the
    closed loop's unique prompts (new each round)."""
    if setup.startswith("trace"):
        return rc.trace_jobs(
            TRACE,
            words,
            start_s=args.start,
            seconds=args.seconds,
            speed=args.speed,
            length_scale=args.length_scale,
            max_input=CONTEXT - args.max_output - 64,
            max_output=args.max_output,
            salt=rnd,
        )
    if setup in CPU_CELLS:
        concurrency, osl = CPU_CELLS[setup]
        return rc.unique_jobs(words, int(args.seconds * CPU_TOKENS_PER_S / osl) + concurrency, CPU_ISL, osl, seed=rnd)
    per_client = max(4, int(args.seconds * 2))
    return rc.unique_jobs(words, args.concurrency * per_client, args.isl, args.osl, seed=rnd)


def warm(url: str, words: rc.Words) -> None:
    """A few requests that share nothing with the load (connections, first-request paths)."""
    jobs = rc.unique_jobs(words, 8, 64, 4, seed=999)
    asyncio.run(rc.closed(url, SERVED, jobs, concurrency=4, warmup=0))


def run(setup: str, url: str, pids: list[int], jobs: list[rc.Job], args: argparse.Namespace) -> dict[str, Any]:
    """One round on one side; `pids`: the side's processes, whose CPU is counted per request."""
    tree = [q for pid in pids for q in harness.process_tree(pid)]
    cpu = sum(map(harness.cpu_seconds, tree))
    started = time.perf_counter()
    if setup.startswith("trace"):
        records = asyncio.run(rc.replay(url, SERVED, jobs))
    elif setup in CPU_CELLS:
        concurrency = CPU_CELLS[setup][0]
        records = asyncio.run(rc.closed(url, SERVED, jobs, concurrency, warmup=0, seconds=args.seconds))
    else:
        records = asyncio.run(rc.closed(url, SERVED, jobs, args.concurrency, warmup=args.concurrency))
    wall = time.perf_counter() - started
    cpu = sum(map(harness.cpu_seconds, tree)) - cpu
    summary = rc.summary(records, wall)
    done = summary["requests"] - summary["errors"]
    summary["cpu_ms_req"] = cpu / done * 1e3 if done else float("nan")
    return {"summary": summary, "records": [] if setup in CPU_CELLS else rc.rows(records)}


def median(values: list[float]) -> float:
    return disagg.median([v for v in values if v == v])


def report(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Per setup: dyn / Dynamo of the medians over rounds, each side's spread, and Dynamo's A/A (round 0 / 1)."""
    out: list[dict[str, Any]] = []
    table: list[list[Any]] = []
    for setup, sides in runs.items():
        row: dict[str, Any] = {"setup": setup}
        shown: list[Any] = [setup]
        for key in FIGURES:
            ours = [r[key] for r in sides["dyn"]]
            theirs = [r[key] for r in sides["dynamo"]]
            a, b = median(ours), median(theirs)
            aa = theirs[0] / theirs[1] if len(theirs) > 1 and theirs[1] else float("nan")
            row[key] = {"dyn": ours, "dynamo": theirs, "ratio": a / b if b else float("nan"), "aa": aa}
            shown.append(f"{a:.4g}/{b:.4g}={a / b:.2f} (aa {aa:.2f})" if b else f"{a:.4g}/-")
        out.append(row)
        table.append(shown)
    disagg.table("dyn / Dynamo 1.6.1: medians over rounds (ms, req/s), Dynamo's A/A", ["setup", *FIGURES], table)
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dynamo-python", required=True, help="a python with ai-dynamo 1.6.1 installed")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=60.0, help="trace window / closed-loop length (replayed s)")
    p.add_argument("--start", type=float, default=0.0, help="where the trace window starts (replayed s)")
    p.add_argument("--speed", type=float, default=4.0, help="trace time divided by this")
    p.add_argument("--length-scale", type=int, default=8, help="trace lengths divided by this")
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--blocks", type=int, default=2048, help="KV blocks per worker in the trace setups")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--isl", type=int, default=3000)
    p.add_argument("--osl", type=int, default=150)
    p.add_argument("--dyn-flags", default="", help="more `dyn serve` flags, e.g. '--disagg-first-token with-decode'")
    p.add_argument("--only", choices=("both", "dyn", "dynamo"), default="both", help="profile one side alone")
    p.add_argument("--json", default=str(harness.results_path("mocker_live")))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    setups = args.setups.split(",")
    if unknown := set(setups) - set(SETUPS):
        raise SystemExit(f"unknown --setups {sorted(unknown)}; known: {', '.join(SETUPS)}")
    words = rc.Words(Path(hf_model_dir(disagg.MODEL)) / "tokenizer.json")
    load_start = harness.loadavg()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    records: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for setup in setups:
            ours = disagg.Side(setup, dyn_flags(setup, args))
            with contextlib.ExitStack() as stack:
                urls: dict[str, tuple[str, list[int]]] = {}
                if args.only in ("both", "dyn"):
                    stack.enter_context(disagg.deployed([ours], tmp))
                    assert ours.deployment is not None
                    urls["dyn"] = ours.url, [ours.deployment.pid]
                if args.only in ("both", "dynamo"):
                    urls["dynamo"] = stack.enter_context(dynamo(args.dynamo_python, setup, args, tmp))
                for url, _ in urls.values():
                    warm(url, words)
                runs[setup] = {name: [] for name in ("dyn", "dynamo")}
                for rnd in range(args.rounds):
                    jobs = jobs_for(setup, args, words, rnd)
                    order = list(urls.items())
                    for name, (url, pids) in order if rnd % 2 == 0 else order[::-1]:
                        result = run(setup, url, pids, jobs, args)
                        runs[setup][name].append(result["summary"])
                        records[f"{setup}-{name}-r{rnd}"] = result["records"]
                        figures = "  ".join(f"{k} {v:.4g}" for k, v in result["summary"].items())
                        print(f"{setup} round {rnd} {name}: {figures}", flush=True)
    rows = report(runs) if args.only == "both" else []
    results = {"args": vars(args), "setups": rows, "runs": runs, "records": records}
    harness.write_results("mocker_live", results, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
