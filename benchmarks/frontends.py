"""Frontend scale-out (issue 36): `dyn serve --frontends N` for N in 1, 2, 4, round-robin and KV routing.

The mocker at `--speedup-ratio 1000000` (engine time ≈ 0) behind N frontend processes on one port, driven by the
lean load generator of benchmarks/overhead.py (streaming chat, a unique ~100-token prompt per request, a closed
loop of `--concurrency` connections, which the kernel spreads over the frontends). Per run: requests/s, TTFT and
ITL, and the CPU of the frontends (all N), of the workers and of the load generator (from /proc and getrusage), so
CPU per request and requests per frontend CPU-second compare the sides at equal CPU. With KV routing, the
frontends' views of the in-flight load are sampled on one kept-alive connection per frontend every 0.25 s (their
`/health`): the mean absolute difference between two frontends' totals, as a share of the mean total, is how far
apart the shared load views drift; after the run every view must be back to 0 (nothing left in flight).

    python benchmarks/frontends.py [--frontends 1,2,4] [--routers round-robin,kv] [--rounds 2] [--seconds 15]
        [--concurrency 64] [--max-tokens 16] [--json benchmarks/out/frontends.json]

Sides alternate round by round (the order of N reversed on odd rounds). The load average is recorded at the
start and the end: timings are only valid on an otherwise quiet machine. On this 2-core machine the load generator
takes about one core, so the frontends cannot show scaling here; the figure that carries is CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import httpx
import overhead  # the lean load generator of benchmarks/overhead.py

SAMPLE_S = 0.25


def serve_flags(tmp: str, frontends: int, router: str, workers: int) -> list[str]:
    return [
        *("--engine", "mocker", "--workers", str(workers), "--frontends", str(frontends), "--router", router),
        *("--speedup-ratio", "1000000", "--discovery", f"file://{tmp}/d-{frontends}-{router}"),
    ]


def tree(pid: int) -> dict[int, str]:
    """`pid` and its descendants, each as `frontend` (dyn serve) or `worker`."""
    found = {}
    for p in harness.process_tree(pid):
        with contextlib.suppress(OSError):
            args = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            found[p] = "frontend" if b"serve" in args else "worker"
    return found


def cpu_by_kind(procs: dict[int, str]) -> dict[str, float]:
    totals = {"frontend": 0.0, "worker": 0.0}
    for pid, kind in procs.items():
        with contextlib.suppress(OSError):
            totals[kind] += harness.cpu_seconds(pid)
    return totals


async def views(url: str, frontends: int, stop_at: asyncio.Event) -> list[list[int]]:
    """Every SAMPLE_S until `stop_at`: each frontend's total of requests in flight (one connection per frontend)."""
    clients: dict[str, httpx.AsyncClient] = {}
    spare: list[httpx.AsyncClient] = []
    samples: list[list[int]] = []
    try:
        for _ in range(20 * frontends):
            if len(clients) == frontends:
                break
            client = httpx.AsyncClient(base_url=url, timeout=10, limits=httpx.Limits(max_connections=1))
            frontend = (await client.get("/health")).json()["frontend"]
            if frontend in clients:
                spare.append(client)
            else:
                clients[frontend] = client
        while not stop_at.is_set():
            bodies = [(await c.get("/health")).json() for c in clients.values()]
            samples.append([sum(row.get("in_flight_requests", 0) for row in b["instances"]) for b in bodies])
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SAMPLE_S):
                    await stop_at.wait()
        await asyncio.sleep(1.0)  # the last ends reach every view
        bodies = [(await c.get("/health")).json() for c in clients.values()]
        samples.append([sum(row.get("in_flight_requests", 0) for row in b["instances"]) for b in bodies])
    finally:
        for client in [*spare, *clients.values()]:
            await client.aclose()
    return samples


def drift(samples: list[list[int]]) -> float:
    """Mean |a - b| over the pairs of frontends and the samples, over the mean total (NaN with one frontend)."""
    gaps = [abs(s[i] - s[j]) for s in samples[:-1] for i in range(len(s)) for j in range(i + 1, len(s))]
    mean = statistics.fmean(v for s in samples[:-1] for v in s) if samples[:-1] else 0.0
    return statistics.fmean(gaps) / mean if gaps and mean else float("nan")


async def measure(url: str, frontends: int, args: argparse.Namespace) -> tuple[list[Any], list[list[int]]]:
    stop_at = asyncio.Event()
    watcher = asyncio.create_task(views(url, frontends, stop_at)) if args.router_kv else None
    try:
        records = await overhead.run_level(url, args.concurrency, args.max_tokens, args.seconds)
    finally:
        stop_at.set()
    samples = await watcher if watcher is not None else []
    return records, samples


def run_one(tmp: str, frontends: int, router: str, args: argparse.Namespace) -> dict[str, Any]:
    flags, log = serve_flags(tmp, frontends, router, args.workers), Path(tmp) / f"serve-{frontends}-{router}.log"
    with harness.serving(flags, log, min_instances=args.workers) as serve:
        url = serve.url
        asyncio.run(overhead.run_level(url, args.concurrency, args.max_tokens, 2.0))  # warm up (tokenizers, JIT)
        procs = tree(serve.pid)
        before, self_before = cpu_by_kind(procs), resource.getrusage(resource.RUSAGE_SELF)
        wall0 = time.perf_counter()
        args.router_kv = router == "kv"
        records, samples = asyncio.run(measure(url, frontends, args))
        wall = time.perf_counter() - wall0
        after, self_after = cpu_by_kind(procs), resource.getrusage(resource.RUSAGE_SELF)
    cpu = {kind: after[kind] - before[kind] for kind in before}
    cpu["loadgen"] = (self_after.ru_utime + self_after.ru_stime) - (self_before.ru_utime + self_before.ru_stime)
    row = overhead.summarize(records, wall, cpu)
    ok = max(1.0, row["req_per_s"] * wall)
    row |= {
        "frontends": frontends,
        "router": router,
        "cpu_ms_per_req_frontends": cpu["frontend"] / ok * 1000,
        "req_per_frontend_cpu_s": ok / cpu["frontend"] if cpu["frontend"] else float("nan"),
        "view_drift": drift(samples) if samples else float("nan"),
        "left_in_flight": sum(samples[-1]) if samples else 0,
    }
    return row


COLUMNS = (
    ("router", "router", "{}"),
    ("N", "frontends", "{}"),
    ("req/s", "req_per_s", "{:,.0f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p99", "ttft_p99_ms", "{:.1f}"),
    ("CPU fe %", "cpu_frontend_pct", "{:.0f}"),
    ("CPU wk %", "cpu_worker_pct", "{:.0f}"),
    ("CPU gen %", "cpu_loadgen_pct", "{:.0f}"),
    ("fe ms/req", "cpu_ms_per_req_frontends", "{:.3f}"),
    ("req/fe-CPU-s", "req_per_frontend_cpu_s", "{:,.0f}"),
    ("view drift", "view_drift", "{:.3f}"),
    ("left", "left_in_flight", "{}"),
    ("failed", "failed", "{}"),
)


def show(rows: list[dict[str, Any]]) -> None:
    table = [[label for label, _, _ in COLUMNS]]
    table += [[fmt.format(row[key]) for _, key, fmt in COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    for n, r in enumerate(table):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frontends", default="1,2,4")
    p.add_argument("--routers", default="round-robin,kv")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", default=str(harness.results_path("frontends")))
    args = p.parse_args()
    counts = [int(n) for n in args.frontends.split(",")]
    load_start = harness.loadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for router in args.routers.split(","):
                for n in counts if rnd % 2 == 0 else counts[::-1]:
                    row = run_one(tmp, n, router, args) | {"round": rnd}
                    rows.append(row)
                    print(f"round {rnd}:", flush=True)
                    show([row])
    medians = []
    for router in args.routers.split(","):
        for n in counts:
            mine = [r for r in rows if r["router"] == router and r["frontends"] == n]
            medians.append(
                {k: (statistics.median(r[k] for r in mine) if isinstance(v, float) else v) for k, v in mine[0].items()}
                | {"failed": sum(r["failed"] for r in mine), "left_in_flight": max(r["left_in_flight"] for r in mine)}
            )
    print("\nmedians over rounds:")
    show(medians)
    results = {"args": vars(args), "rows": rows, "medians": medians}
    harness.write_results("frontends", results, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
