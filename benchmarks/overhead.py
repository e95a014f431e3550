"""Framework overhead: `dyn serve --engine mocker` with engine time ~0, streaming chat, 1 worker.

For each (max_tokens, concurrency) the lean load generator runs for --seconds and the table shows
requests/s, output tokens/s, TTFT and ITL percentiles, and the CPU used by the frontend, the worker
and the load generator (from /proc and getrusage), plus CPU ms per request of frontend + worker.
A last phase measures TTFT at concurrency 1 with an ordinary client (httpx), as a user would see it.

    python benchmarks/overhead.py [--seconds 20] [--json benchmarks/out/overhead.json]

`--ab DIR` compares this checkout with another (DIR: a checkout of an earlier commit, with a `dyn_engines`
link to its `engines/` when its engines install under that name here): each round runs the same levels on
DIR, on this checkout, and on this checkout again (the A/A pair: the noise floor), alternating, each side's
`dyn serve` from its own code (PYTHONPATH=side, PYTHONSAFEPATH); the table gives main/base and main/main.

    python benchmarks/overhead.py --ab ../base --rounds 3 --seconds 15 --concurrency 64 --max-tokens 16

`--traced` adds a fourth side per round: this checkout with tracing on (`DYN_OTLP_ENDPOINT` at a loopback
collector this script runs, which accepts and drops the spans; ratio 1.0), and the table adds traced/main: what
tracing every request costs.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness
import httpx

from dynamo_cli.bench.http import HttpClient, RequestRecord

PROMPT = " ".join(["The quick brown fox jumps over the lazy dog while the cat watches."] * 7)  # ~100 tokens


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


async def run_level(url: str, concurrency: int, max_tokens: int, seconds: float) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    counter = iter(range(1 << 62))

    def body() -> dict[str, object]:
        # a unique prompt per request: the frontend really tokenizes every one (no cache hit on the user turn)
        content = f"Request {next(counter)}: {PROMPT}"
        return {
            "model": "smollm2",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "stream_options": {"include_usage": True},
        }

    deadline = time.perf_counter() + seconds
    async with HttpClient(url, max_connections=concurrency) as client:

        async def loop() -> None:
            while time.perf_counter() < deadline:
                records.append(await client.stream_chat(body()))

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return records


def summarize(records: list[RequestRecord], wall: float, cpu: dict[str, float]) -> dict[str, float]:
    ok = [r for r in records if r.is_ok]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    itl = [(r.end - r.chunk_times[0]) / (len(r.chunk_times) - 1) * 1000 for r in ok if len(r.chunk_times) > 1]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    n = max(1, len(ok))
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "req_per_s": len(ok) / wall,
        "out_tok_per_s": tokens / wall,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50),
        "itl_p99_ms": pct(itl, 99),
        "cpu_frontend_pct": cpu["frontend"] / wall * 100,
        "cpu_worker_pct": cpu["worker"] / wall * 100,
        "cpu_loadgen_pct": cpu["loadgen"] / wall * 100,
        "cpu_ms_per_req_fe_worker": (cpu["frontend"] + cpu["worker"]) / n * 1000,
    }


def serve_flags(tmp: str, http_server: str) -> list[str]:
    flags = ["--engine", "mocker", "--workers", "1", "--speedup-ratio", "1000000", "--discovery", f"file://{tmp}/d"]
    return [*flags, "--http-server", http_server]


async def ordinary_client_ttft(url: str, n: int = 50) -> float:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "stream": True}
    ttfts = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for _ in range(n):
            start = time.perf_counter()
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                seen = False
                async for line in r.aiter_lines():
                    if not seen and '"content":"' in line and '"content":""' not in line:
                        ttfts.append((time.perf_counter() - start) * 1000)
                        seen = True
    return statistics.median(ttfts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--max-tokens", default="16,128")
    parser.add_argument("--json", default=str(harness.results_path("overhead")))
    parser.add_argument("--http-server", default="uvicorn", choices=["uvicorn", "hypercorn"])
    parser.add_argument("--ab", default=None, help="another checkout to compare with, alternating (see above)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--traced", action="store_true", help="with --ab: a side with tracing on (see above)")
    args = parser.parse_args()
    if args.ab is not None:
        return compare(args)
    load_start = harness.loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        with harness.serving(serve_flags(tmp, args.http_server), Path(tmp) / "serve.log") as serve:
            rows = run_all(serve.pid, serve.url, args)
            rows.append(
                {
                    "max_tokens": 16,
                    "concurrency": 1,
                    "client": "httpx",
                    "ttft_p50_ms": asyncio.run(ordinary_client_ttft(serve.url)),
                }
            )
    print_table(rows)
    harness.write_results("overhead", {"rows": rows, "seconds": args.seconds}, args.json, loadavg_start=load_start)


def run_all(serve_pid: int, url: str, args: argparse.Namespace) -> list[dict[str, object]]:
    import uvloop

    worker_pid = harness.children(serve_pid)[0]
    rows: list[dict[str, object]] = []
    uvloop.run(run_level(url, 4, 16, 2.0))  # warm-up
    for max_tokens in [int(x) for x in args.max_tokens.split(",")]:
        for concurrency in [int(x) for x in args.concurrency.split(",")]:
            before = (
                harness.cpu_seconds(serve_pid),
                harness.cpu_seconds(worker_pid),
                resource.getrusage(resource.RUSAGE_SELF),
            )
            start = time.perf_counter()
            records = uvloop.run(run_level(url, concurrency, max_tokens, args.seconds))
            wall = time.perf_counter() - start
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu = {
                "frontend": harness.cpu_seconds(serve_pid) - before[0],
                "worker": harness.cpu_seconds(worker_pid) - before[1],
                "loadgen": usage.ru_utime + usage.ru_stime - before[2].ru_utime - before[2].ru_stime,
            }
            row = {
                "max_tokens": max_tokens,
                "concurrency": concurrency,
                "client": "lean",
                "server": args.http_server,
                **summarize(records, wall, cpu),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    cols = [
        "max_tokens",
        "concurrency",
        "client",
        "req_per_s",
        "out_tok_per_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "cpu_frontend_pct",
        "cpu_worker_pct",
        "cpu_loadgen_pct",
        "cpu_ms_per_req_fe_worker",
        "failed",
    ]
    harness.print_table(rows, cols)


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that accepts every export and keeps nothing (the spans' cost is the sender's)."""

    spans_bytes = 0

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        _Collector.spans_bytes += len(self.rfile.read(int(self.headers.get("content-length", 0))))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def compare(args: argparse.Namespace) -> None:
    """Rounds of base, main, main (A/A) (and main traced), each `overhead.py` run by its own checkout; the ratios
    per round."""
    here = Path(__file__).resolve().parents[1]
    sides = {"base": Path(args.ab).resolve(), "main": here, "main2": here}
    extra_env: dict[str, dict[str, str]] = {}
    collector = None
    if args.traced:
        collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
        threading.Thread(target=collector.serve_forever, daemon=True).start()
        sides["traced"] = here
        url = f"http://127.0.0.1:{collector.server_address[1]}"
        extra_env["traced"] = {"DYN_OTLP_ENDPOINT": url, "DYN_TRACE_SAMPLE_RATIO": "1.0"}
    load_start = harness.loadavg()
    level = ["--seconds", str(args.seconds), "--concurrency", args.concurrency, "--max-tokens", args.max_tokens]
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(1, args.rounds + 1):
            for side, root in sides.items():
                out = Path(tmp) / f"{side}-{round_}.json"
                # the side's own code, and its benchmarks/ for `import harness` (PYTHONSAFEPATH drops the script's dir)
                path = os.pathsep.join((str(root), str(root / "benchmarks")))
                env = {**os.environ, "PYTHONPATH": path, "PYTHONSAFEPATH": "1", **extra_env.get(side, {})}
                script = root / "benchmarks" / "overhead.py"
                subprocess.run([sys.executable, str(script), *level, "--json", str(out)], cwd=root, env=env, check=True)
                for row in harness.read_results(out)["rows"]:
                    if row["client"] == "lean":
                        results.append({"round": round_, "side": side, **row})
    if collector is not None:
        collector.shutdown()
        print(f"collector received {_Collector.spans_bytes / 1e6:.1f} MB of spans")
    print_ratios(results, sides, args.rounds)
    harness.write_results("overhead", {"ab": str(sides["base"]), "rows": results}, args.json, loadavg_start=load_start)


def print_ratios(results: list[dict[str, object]], sides: dict[str, Path], rounds: int) -> None:
    traced = "traced" in sides
    print(
        f"{'round':>5} {'mt':>4} {'conc':>4} {'base r/s':>9} {'main r/s':>9} {'main/base':>9} {'main/main':>9} "
        f"{'base ms/r':>9} {'main ms/r':>9} {'main/base':>9} {'main/main':>9}"
        + (f" {'trc r/s':>8} {'trc ms/r':>8} {'trc/main':>8} {'trc/main':>8}" if traced else "")
    )
    for round_ in range(1, rounds + 1):
        keys = {(r["max_tokens"], r["concurrency"]) for r in results if r["round"] == round_}
        for key in sorted(keys):  # type: ignore[type-var]
            by = {r["side"]: r for r in results if r["round"] == round_ and (r["max_tokens"], r["concurrency"]) == key}
            rps = {side: float(by[side]["req_per_s"]) for side in sides}  # type: ignore[arg-type]
            cpu = {side: float(by[side]["cpu_ms_per_req_fe_worker"]) for side in sides}  # type: ignore[arg-type]
            line = (
                f"{round_:>5} {key[0]:>4} {key[1]:>4} {rps['base']:>9.0f} {rps['main']:>9.0f} "
                f"{rps['main'] / rps['base']:>9.3f} {rps['main'] / rps['main2']:>9.3f} {cpu['base']:>9.3f} "
                f"{cpu['main']:>9.3f} {cpu['main'] / cpu['base']:>9.3f} {cpu['main'] / cpu['main2']:>9.3f}"
            )
            if traced:
                line += (
                    f" {rps['traced']:>8.0f} {cpu['traced']:>8.3f} {rps['traced'] / rps['main']:>8.3f}"
                    f" {cpu['traced'] / cpu['main']:>8.3f}"
                )
            print(line)


if __name__ == "__main__":
    main()
