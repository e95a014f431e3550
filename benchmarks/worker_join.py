"""Time from a worker's ready line to its first request routed by an already-running frontend.

For each plane set (embedded; etcd + NATS started here on loopback) a frontend runs with no workers;
then, N times: start `dyn worker --engine mocker`, note when it prints its ready line, and send requests
until one is answered (the frontend returns 404 until it has discovered the worker); stop the worker
and wait until the frontend forgets it.

    python benchmarks/worker_join.py [--rounds 5] [--json benchmarks/out/worker_join.json]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import harness
import httpx

BODY = {"model": "smollm2", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
CLUSTER = {"DYN_CLUSTER_SECRET": secrets.token_hex(32)}
"""One request-plane secret for the frontend and the workers that join it."""


def one_join(url: str, planes: list[str]) -> float:
    argv = harness.dyn_argv("worker", "--engine", "mocker", "--speedup-ratio", "100", *planes)
    worker = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, **CLUSTER}
    )
    try:
        assert worker.stdout is not None
        for line in worker.stdout:
            if "dyn worker ready" in line:
                break
        ready = time.perf_counter()
        with httpx.Client(base_url=url, timeout=10) as http:
            while http.post("/v1/chat/completions", json=BODY).status_code != 200:
                time.sleep(0.005)
        return time.perf_counter() - ready
    finally:
        harness.stop_process(worker, 20.0)
        with httpx.Client(base_url=url, timeout=10) as http:
            while http.get("/health").status_code == 200:
                time.sleep(0.05)


def run(kind: str, rounds: int, root: Path) -> dict[str, object]:
    servers: list[harness.Server] = []
    root.mkdir(parents=True, exist_ok=True)
    if kind == "embedded":
        planes = ["--discovery", f"file://{root}/d", "--events", "embedded"]
    else:
        servers = [harness.start_etcd(root), harness.start_nats(root)]
        planes = ["--discovery", servers[0].url, "--events", servers[1].url]
    try:
        flags = ["--workers", "0", *planes]
        with harness.serving(flags, root / "serve.log", env=CLUSTER, min_instances=0) as frontend:
            joins = [one_join(frontend.url, planes) for _ in range(rounds)]
    finally:
        for server in servers:
            server.stop()
    return {"planes": kind, "rounds": rounds, "join_s": joins, "p50_s": statistics.median(joins), "max_s": max(joins)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=str(harness.results_path("worker_join")))
    args = parser.parse_args()
    load_start = harness.loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(kind, args.rounds, Path(tmp) / kind) for kind in ("embedded", "etcd-nats")]
    print("planes    | rounds | ready → first routed request p50 (s) | max (s) | bar")
    for row in rows:
        print(f"{row['planes']:<9} | {row['rounds']:>6} | {row['p50_s']:>36.3f} | {row['max_s']:>7.3f} | <= 1.0")
    harness.write_results("worker_join", rows, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
