"""Time from a worker's ready line to its first request routed by an already-running frontend.

For each plane set (embedded; etcd + NATS started here on loopback) a frontend runs with no workers;
then, N times: start `dyn worker --engine mocker`, note when it prints its ready line, and send requests
until one is answered (the frontend returns 404 until it has discovered the worker); stop the worker
and wait until the frontend forgets it.

    python benchmarks/worker_join.py [--rounds 5] [--json benchmarks/out/worker_join.json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import start_dyn  # noqa: E402
from tests.planes import find_etcd, find_nats_server, start_etcd, start_nats  # noqa: E402

BODY = {"model": "smollm2", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
CLUSTER = {"DYN_CLUSTER_SECRET": secrets.token_hex(32)}
"""One request-plane secret for the frontend and the workers that join it."""


def one_join(url: str, planes: list[str]) -> float:
    argv = [sys.executable, "-m", "dynamo_cli.cli.main", "worker", "--engine", "mocker", "--speedup-ratio", "100"]
    argv += planes
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
        worker.terminate()
        worker.wait(20)
        with httpx.Client(base_url=url, timeout=10) as http:
            while http.get("/health").status_code == 200:
                time.sleep(0.05)


def run(kind: str, rounds: int, root: Path) -> dict[str, object]:
    servers: list[object] = []
    root.mkdir(parents=True, exist_ok=True)
    if kind == "embedded":
        planes = ["--discovery", f"file://{root}/d", "--events", "embedded"]
    else:
        etcd_bin, nats_bin = find_etcd(), find_nats_server()
        assert etcd_bin and nats_bin, "run .ci/install-planes.sh first"
        etcd, nats = start_etcd(etcd_bin, root), start_nats(nats_bin, root)
        servers = [etcd, nats]
        planes = ["--discovery", etcd.url, "--events", nats.url]
    frontend = start_dyn(["serve", "--workers", "0", "--port", "0", *planes], env=CLUSTER)
    try:
        joins = [one_join(frontend.url, planes) for _ in range(rounds)]
    finally:
        frontend.stop()
        for server in servers:
            server.stop()  # type: ignore[attr-defined]
    return {"planes": kind, "rounds": rounds, "join_s": joins, "p50_s": statistics.median(joins), "max_s": max(joins)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/out/worker_join.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(kind, args.rounds, Path(tmp) / kind) for kind in ("embedded", "etcd-nats")]
    print("planes    | rounds | ready → first routed request p50 (s) | max (s) | bar")
    for row in rows:
        print(f"{row['planes']:<9} | {row['rounds']:>6} | {row['p50_s']:>36.3f} | {row['max_s']:>7.3f} | <= 1.0")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
