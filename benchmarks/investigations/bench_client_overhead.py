"""CPU the `dyn bench` load generator spends per request, at a fixed request rate against a fast server.

The server (tests/bench/sse_server.py) runs in its own process, so `time.process_time()` of this process
counts only the client: scheduling, the HTTP/1.1 + SSE client, building bodies, decoding chunks. Each
cell sends `rate × seconds` requests open-loop (capped at 256 in flight) and reports CPU ms per request,
the achieved rate, and the p99 lag between a request's scheduled and actual send time.

    python benchmarks/investigations/bench_client_overhead.py [--rate 500] [--seconds 4]

The baseline cell drives the same server with httpx (aiter_lines), the usual Python choice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (the one path insert: harness.py)
import harness  # noqa: E402

from dynamo_cli.bench import workload as wl  # noqa: E402
from dynamo_cli.bench.http import HttpClient  # noqa: E402
from dynamo_cli.bench.load import LoadConfig, LoadRunner, RequestBuilder  # noqa: E402
from dynamo_cli.bench.metrics import percentile  # noqa: E402


def start_server() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, str(harness.ROOT / "tests/bench/sse_server.py"), "--ttft-ms", "0", "--gap-ms", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, "http://" + line.split()[1]


async def dyn_cell(url: str, rate: float, seconds: float, osl: int) -> dict[str, float]:
    vocab = wl.approximate_vocab("benchmark")
    config = LoadConfig(concurrency=256, request_rate=rate, num_requests=int(rate * seconds))
    async with HttpClient(url, max_connections=256) as client:
        runner = LoadRunner(client, RequestBuilder("test-model"))
        conversations = wl.synthetic(vocab, 64, 0, osl, 0)
        # warm up outside the measured window: connections, the word pool, first-call costs
        await runner.run(LoadConfig(concurrency=8, num_requests=200), conversations)
        t0, wall0 = os.times(), time.perf_counter()
        records = await runner.run(config, conversations)
        t1, wall = os.times(), time.perf_counter() - wall0
    errors = Counter(r.error for r in records if r.error)
    if errors:
        print(f"  errors ({client_label(osl)}): {dict(errors)}", file=sys.stderr)
    return _cell(
        records_ok=sum(r.is_ok for r in records),
        n=len(records),
        times=(t0, t1),
        wall=wall,
        lags=[r.start - r.scheduled for r in records if r.scheduled is not None],
    )


def client_label(osl: int) -> str:
    return f"dyn, osl {osl}"


class _FloorProtocol(asyncio.Protocol):
    """The least a client can do: write the request, wake when the chunked terminator arrives."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if data.endswith(b"0\r\n\r\n") and self.waiter is not None:
            self.waiter.set_result(None)


async def floor_cell(url: str, rate: float, seconds: float, osl: int) -> dict[str, float]:
    """No parsing, no records, no metrics: the event loop's and the kernel's share of a request."""
    host, port = url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    idle: list[_FloorProtocol] = []
    body = json.dumps(
        {"model": "test-model", "messages": [{"role": "user", "content": "x " * 64}], "max_tokens": osl, "stream": True}
    ).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    lags: list[float] = []

    async def one(at: float) -> None:
        lags.append(time.perf_counter() - at)
        conn = idle.pop() if idle else (await loop.create_connection(_FloorProtocol, host, int(port)))[1]
        conn.waiter = loop.create_future()
        conn.transport.write(request)
        await asyncio.wait_for(conn.waiter, 30)
        idle.append(conn)

    for _ in range(200):
        await one(time.perf_counter())
    n = int(rate * seconds)
    lags.clear()
    t0, wall0 = os.times(), time.perf_counter()
    next_at = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(n):
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            group.create_task(one(next_at))
            next_at += 1 / rate
    t1, wall = os.times(), time.perf_counter() - wall0
    for conn in idle:
        conn.transport.close()
    return _cell(records_ok=n, n=n, times=(t0, t1), wall=wall, lags=lags)


async def httpx_cell(url: str, rate: float, seconds: float, osl: int) -> dict[str, float]:
    import httpx

    n = int(rate * seconds)
    body = {
        "model": "test-model",
        "messages": [{"role": "user", "content": "x " * 64}],
        "max_tokens": osl,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ok = 0
    lags: list[float] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)

    async def one(client: httpx.AsyncClient, at: float) -> None:
        nonlocal ok
        lags.append(time.perf_counter() - at)
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    json.loads(line[5:])
        ok += 1

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        t0, wall0 = os.times(), time.perf_counter()
        next_at = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(n):
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                group.create_task(one(client, next_at))
                next_at += 1 / rate
        t1, wall = os.times(), time.perf_counter() - wall0
    return _cell(records_ok=ok, n=n, times=(t0, t1), wall=wall, lags=lags)


def _cell(records_ok: int, n: int, times: tuple[Any, Any], wall: float, lags: list[float]) -> dict[str, float]:
    lags.sort()
    user, system = times[1].user - times[0].user, times[1].system - times[0].system
    cpu = user + system
    return {
        "requests": n,
        "ok": records_ok,
        "cpu_ms_per_request": cpu / n * 1e3,
        "user_ms_per_request": user / n * 1e3,
        "sys_ms_per_request": system / n * 1e3,
        "achieved_rps": n / wall,
        "cpu_util": cpu / wall,
        "send_lag_p99_ms": percentile(lags, 99) * 1e3 if lags else float("nan"),
    }


def run_cell(client: str, loop: str, url: str, rate: float, seconds: float, osl: int) -> dict[str, float]:
    cell = {"dyn": dyn_cell, "httpx": httpx_cell, "floor": floor_cell}[client]
    coro = cell(url, rate, seconds, osl)
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=500)
    parser.add_argument("--seconds", type=float, default=4)
    parser.add_argument("--json", default=str(harness.results_path("bench_client_overhead")))
    parser.add_argument("--skip-httpx", action="store_true")
    parser.add_argument("--repeat", type=int, default=1, help="Run every cell this many times; keep the least CPU.")
    args = parser.parse_args()
    cells = [
        ("floor", "uvloop", 16),
        ("dyn", "uvloop", 16),
        ("dyn", "asyncio", 16),
        ("floor", "uvloop", 128),
        ("dyn", "uvloop", 128),
    ]
    if not args.skip_httpx:
        cells.append(("httpx", "uvloop", 16))
    load_start = harness.loadavg()
    proc, url = start_server()
    rows = []
    try:
        for client, loop, osl in cells:
            results = [run_cell(client, loop, url, args.rate, args.seconds, osl) for _ in range(args.repeat)]
            result = min(results, key=lambda r: r["cpu_ms_per_request"])
            rows.append({"client": client, "loop": loop, "osl": osl, "rate": args.rate, **result})
    finally:
        harness.stop_process(proc, 10.0)
    header = (
        f"{'client':7} {'loop':8} {'osl':>4} {'req':>6} {'ok':>6} {'CPU ms/req':>11} {'achieved/s':>11} "
        f"{'user':>6} {'sys':>6} {'CPU util':>9} {'lag p99 ms':>11}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['client']:7} {r['loop']:8} {r['osl']:>4} {r['requests']:>6} {r['ok']:>6} "
            f"{r['cpu_ms_per_request']:>11.3f} {r['achieved_rps']:>11.1f} {r['user_ms_per_request']:>6.3f} "
            f"{r['sys_ms_per_request']:>6.3f} {r['cpu_util']:>9.2f} "
            f"{r['send_lag_p99_ms']:>11.2f}"
        )
    document = {"python": platform.python_version(), "machine": platform.machine(), "rows": rows}
    harness.write_results("bench_client_overhead", document, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
