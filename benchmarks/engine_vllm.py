"""`dyn serve --engine vllm` against vLLM's own OpenAI server: same model, same engine flags, same CPU.

Both servers run SmolLM2-135M-Instruct (the built-in GGUF exported once to an HF directory) with the same
vLLM engine arguments; each is loaded by `dyn bench` at every concurrency (synthetic prompts of --isl
tokens, --osl output tokens with ignore_eos, streaming chat). Servers alternate, vLLM first, for
--rounds rounds; ratios are dyn / vLLM per round and the table shows their medians, because a shared
machine drifts between minutes.

    python benchmarks/engine_vllm.py [--concurrency 1,8,16] [--isl 200] [--osl 64] [--rounds 2]
        [--json benchmarks/out/engine_vllm.json]

Bar: dyn output tokens/s >= 0.95x vLLM's own server at every concurrency (the framework must add almost
nothing on top of the engine). TTFT p50 is reported beside it (lower is better; ratio dyn / vLLM).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import harness
from dyn_engines.hf_export import hf_model_dir

from dynamo_cli.bench.report import flatten

ENGINE = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_num_seqs": 16,
    "block_size": 32,
    "kv_cache_memory_bytes": 1 << 30,
    "max_model_len": 4096,
}
"""The vLLM engine arguments both servers get (the CPU needs float32 and block sizes in multiples of 32)."""
SERVED_NAME = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server subprocess in its own session (stopped with its whole process group)."""

    def __init__(self, name: str, argv: list[str], url: str | None, ready: re.Pattern[str]) -> None:
        self.name, self.url, self.lines = name, url, []
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        self._ready = threading.Event()
        threading.Thread(target=self._pump, args=(ready,), daemon=True).start()

    def _pump(self, ready: re.Pattern[str]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            match = ready.search(line)
            if match:
                if match.groups():
                    self.url = match.group(1)
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float) -> float:
        started = time.monotonic()
        if not self._ready.wait(timeout) or self.proc.poll() is not None:
            tail = "\n".join(self.lines[-30:])
            self.stop()
            raise SystemExit(f"{self.name} did not become ready within {timeout:.0f} s:\n{tail}")
        return time.monotonic() - started

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_vllm(model: str) -> Server:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    for key, value in ENGINE.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return Server("vllm serve", argv, f"http://127.0.0.1:{port}", re.compile(r"Application startup complete"))


class DynServer:
    """`dyn serve --engine vllm` through the harness, with `Server`'s shape for the round loop."""

    def __init__(self, model: str) -> None:
        extra = {k: v for k, v in ENGINE.items() if k not in ("block_size", "max_model_len")}
        work = Path(tempfile.mkdtemp(prefix="dyn-bench-vllm-"))
        self.flags = ["--engine", "vllm", "--model", model, "--served-model-name", SERVED_NAME]
        self.flags += ["--block-size", str(ENGINE["block_size"]), "--context-length", str(ENGINE["max_model_len"])]
        self.flags += ["--extra-engine-args", json.dumps(extra), "--discovery", f"file://{work}/d"]
        self.log_path = work / "serve.log"
        self.url: str | None = None
        self.deployment: harness.Deployment | None = None

    def wait_ready(self, timeout: float) -> float:
        started = time.monotonic()
        self.deployment = harness.start_serve(self.flags, self.log_path, env={"HF_HUB_OFFLINE": "1"}, timeout_s=timeout)
        self.url = self.deployment.url
        return time.monotonic() - started

    def stop(self) -> None:
        if self.deployment is not None:
            self.deployment.stop(grace_s=60.0)


def start_dyn(model: str) -> DynServer:
    return DynServer(model)


def bench(url: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict[str, float]:
    num_requests = max(args.min_requests, concurrency * args.requests_per_slot)
    argv = [
        sys.executable,
        "-m",
        "dynamo_cli.cli.main",
        "bench",
        "--url",
        url,
        "--model",
        SERVED_NAME,
        "--tokenizer",
        "smollm2",
        "--concurrency",
        str(concurrency),
        "--num-requests",
        str(num_requests),
        "--warmup",
        str(concurrency),
        "--isl",
        str(args.isl),
        "--osl",
        str(args.osl),
        "--ignore-eos",
        "--seed",
        "7",
        "--no-progress",
        "--json",
        str(out),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"dyn bench failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return flatten(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--isl", type=int, default=200)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--requests-per-slot", type=int, default=3, help="measured requests = this x concurrency")
    parser.add_argument("--min-requests", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--json", default=str(harness.results_path("engine_vllm")))
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    load_start = harness.loadavg()
    model = hf_model_dir("smollm2")
    work = Path(tempfile.mkdtemp(prefix="engine-vllm-"))
    cells: list[dict[str, Any]] = []
    startups: dict[str, list[float]] = {"vllm": [], "dyn": []}
    for round_no in range(args.rounds):
        for name, start in (("vllm", start_vllm), ("dyn", start_dyn)):
            server: Server | DynServer = start(model)
            try:
                startups[name].append(server.wait_ready(args.ready_timeout))
                assert server.url is not None
                for c in levels:
                    figures = bench(server.url, c, args, work / f"{name}-{round_no}-{c}.json")
                    cell = {
                        "round": round_no,
                        "server": name,
                        "concurrency": c,
                        "output_tok_s": figures["output_token_throughput"],
                        "ttft_p50_ms": figures["ttft.p50"],
                        "itl_p50_ms": figures.get("itl.p50"),
                        "failed": figures.get("failed_requests", 0.0),
                    }
                    cells.append(cell)
                    print(
                        f"round {round_no} {name:4s} c={c:<3d} {cell['output_tok_s']:8.1f} out tok/s  "
                        f"TTFT p50 {cell['ttft_p50_ms']:8.1f} ms  ITL p50 {cell['itl_p50_ms'] or 0:6.1f} ms",
                        flush=True,
                    )
            finally:
                server.stop()
    rows = []
    for c in levels:
        ratios_tps, ratios_ttft = [], []
        for round_no in range(args.rounds):
            pair = {x["server"]: x for x in cells if x["round"] == round_no and x["concurrency"] == c}
            ratios_tps.append(pair["dyn"]["output_tok_s"] / pair["vllm"]["output_tok_s"])
            ratios_ttft.append(pair["dyn"]["ttft_p50_ms"] / pair["vllm"]["ttft_p50_ms"])

        def median(server: str, key: str, conc: int = c) -> float:
            return statistics.median(x[key] for x in cells if x["server"] == server and x["concurrency"] == conc)

        rows.append(
            {
                "concurrency": c,
                "vllm_tok_s": median("vllm", "output_tok_s"),
                "dyn_tok_s": median("dyn", "output_tok_s"),
                "tok_s_ratio": statistics.median(ratios_tps),
                "tok_s_ratios": ratios_tps,
                "vllm_ttft_p50_ms": median("vllm", "ttft_p50_ms"),
                "dyn_ttft_p50_ms": median("dyn", "ttft_p50_ms"),
                "ttft_ratio": statistics.median(ratios_ttft),
                "ttft_ratios": ratios_ttft,
            }
        )
    print(
        f"\n{'c':>3} | {'vLLM tok/s':>10} | {'dyn tok/s':>10} | {'dyn/vLLM':>8} | "
        f"{'vLLM TTFT p50':>13} | {'dyn TTFT p50':>12} | {'dyn/vLLM':>8} | bar >= 0.95"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>3} | {r['vllm_tok_s']:>10.1f} | {r['dyn_tok_s']:>10.1f} | "
            f"{r['tok_s_ratio']:>8.3f} | "
            f"{r['vllm_ttft_p50_ms']:>11.1f}ms | {r['dyn_ttft_p50_ms']:>10.1f}ms | {r['ttft_ratio']:>8.3f} | "
            f"{'met' if r['tok_s_ratio'] >= 0.95 else 'MISSED'}"
        )
    print(f"startup s: vLLM {startups['vllm']}, dyn {startups['dyn']}")
    document = {
        "args": vars(args),
        "engine_args": ENGINE,
        "rows": rows,
        "cells": cells,
        "startup_s": startups,
        "host": platform.node(),
        "cpus": os.cpu_count(),
    }
    harness.write_results("engine_vllm", document, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
