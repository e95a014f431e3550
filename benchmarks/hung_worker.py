"""How long a hung worker holds requests: SIGSTOP one of three mocker workers under 24 streams, then send 8 more.

The issue's scenario (issue 34): a worker alive, registered and producing nothing. Per `--stall-timeout` (0: no
deadline, the behaviour before it), measured from the SIGSTOP: when the last of the 24 streams ended and how many
completed, how many of the 8 requests sent 2 s later were held by the stopped worker (served by it, per
`x-worker-instance-id`, or never completed: only it could hold them) and how long the slowest of them took,
and, after SIGCONT, how long until the worker served again.

    python benchmarks/hung_worker.py [--stall 0,10,2] [--json benchmarks/out/hung_worker.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import harness
import httpx

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "count"}], "ignore_eos": True}
CUTOFF_S = 45.0
"""A request still open this long after the SIGSTOP counts as stuck."""


def serve_flags(stall: float, tmp: str) -> list[str]:
    flags = ["--engine", "mocker", "--workers", "3", "--discovery", f"file://{tmp}/d"]
    return [*flags, "--stall-timeout", str(stall), "--lease-ttl", "60"]


def ask(url: str, max_tokens: int, started: float) -> tuple[float, str, bool]:
    """(seconds after `started` it ended, the worker that served it, whether it completed)."""
    try:
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": max_tokens, "stream": True},
            timeout=CUTOFF_S,
        ) as reply:  # fmt: skip
            text = "".join(reply.iter_text())
            worker = reply.headers.get("x-worker-instance-id", "")
    except httpx.HTTPError:
        return time.monotonic() - started, "", False
    return time.monotonic() - started, worker, text.rstrip().endswith("data: [DONE]") and '"error"' not in text


def served_by(url: str) -> str:
    reply = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 2}, timeout=10)
    return reply.headers.get("x-worker-instance-id", "")


def pid_to_instance(url: str, serve: int) -> dict[str, int]:
    """Instance id (hex) -> pid, from /health's instances and each worker's pid via its request-plane address."""
    instances = httpx.get(f"{url}/health", timeout=5).json()["instances"]
    ports = {i["address"].rsplit(":", 1)[1]: i["instance_id"] for i in instances}
    found = {}
    listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    for pid in harness.children(serve):
        for line in listening:
            if f"pid={pid}," in line:
                port = line.split()[3].rsplit(":", 1)[1]
                if port in ports:
                    found[ports[port]] = pid
    return found


def run(stall: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        with harness.serving(serve_flags(stall, tmp), Path(tmp) / "serve.log", min_instances=3) as serve:
            url = serve.url
            by_id = pid_to_instance(url, serve.pid)
            stopped_id, stopped_pid = next(iter(by_id.items()))
            with concurrent.futures.ThreadPoolExecutor(32) as pool:
                streams = [pool.submit(ask, url, 2000, time.monotonic()) for _ in range(24)]
                time.sleep(1.0)
                os.kill(stopped_pid, signal.SIGSTOP)
                t0 = time.monotonic()
                time.sleep(2.0)
                late = [pool.submit(ask, url, 50, t0) for _ in range(8)]
                done = [f.result() for f in streams]
                after = [f.result() for f in late]
            os.kill(stopped_pid, signal.SIGCONT)
            t1 = time.monotonic()
            back = None
            while time.monotonic() - t1 < 30:
                if served_by(url) == stopped_id:
                    back = time.monotonic() - t1
                    break
                time.sleep(0.1)
            return {
                "stall_timeout_s": stall,
                "streams_completed": sum(ok for _, _, ok in done),
                "last_stream_end_s": round(max(t for t, _, _ in done) - 1.0, 1),
                "late_held_by_stopped": sum(w == stopped_id or not ok for _, w, ok in after),
                "late_completed": sum(ok for _, _, ok in after),
                "late_slowest_s": round(max(t for t, _, _ in after), 1),
                "served_again_after_sigcont_s": round(back, 2) if back is not None else None,
            }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stall", default="0,10,2", help="stall timeouts to try (s; 0: no deadline)")
    parser.add_argument("--json", default=str(harness.results_path("hung_worker")))
    args = parser.parse_args()
    load_start = harness.loadavg()
    rows = [run(float(s)) for s in args.stall.split(",")]
    print(
        "| --stall-timeout | streams completed /24 | last stream ended (s) | late held by the stopped worker /8 "
        "| late completed /8 | slowest late (s) | served again after SIGCONT (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(" | ".join(["", *(str(v) for v in r.values()), ""]).strip())
    harness.write_results("hung_worker", {"rows": rows}, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
