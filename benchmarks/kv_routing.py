"""KV-aware routing vs round-robin vs random: 4 mocker workers, shared system prompts, two cache regimes.

For each regime and router mode, one `dyn serve --engine mocker --workers 4 --router MODE --port 0` is
started (sequentially, each on its own file:// discovery dir) and sent an open-loop Poisson stream of
/v1/completions requests, each made of one of P distinct system prompts (`--prefix-tokens`, default
2,000 tokens; each starts with a distinct token, so two prompts share no block) plus a unique suffix
(`--suffix-tokens`, default 100), `max_tokens` 50 with `ignore_eos`. Prompts are token-id lists built
with the SmolLM2 tokenizer, so every request has an exact token count.

Regimes:
  (a) P = 20, default KV capacity (16,384 blocks per worker): every worker can hold every prompt.
  (b) cache pressure: P and `--num-gpu-blocks` such that the P prompts fit in the 4 workers' caches
      together but not in any one (default P = 40 x 31 blocks = 1,240 blocks vs 512 per worker).

`kv` is the router's default cost (`time`, routing/time_cost.py); `kv:w=W` is Dynamo's formula with
weight W (`kv:cost=dynamo` with the default w = 1). Regime b runs Dynamo's formula twice by default:
with its default overlap weight (w = 1) and with w = 4 (`--modes-b kv,kv:w=1,kv:w=4,round-robin,random`;
a mode `kv:w=W:t=T:noguard:cost=C` sets the kv knobs). Before
regime b, one worker alone is driven closed-loop (c = 32) to measure its saturated throughput on the
same workload; 4x that is the cache-blind capacity the offered rate is compared with.

Per mode: TTFT p50/p90/p99, e2e p50, throughput (req/s and output tok/s completed inside the measured
window), prefix-cache hit rate = sum(cached_tokens) / sum(prompt_tokens) from
`usage.prompt_tokens_details.cached_tokens`, and the share of the cacheable prefix tokens (the prompt's
full blocks that lie inside the system prompt) that hit. For kv mode also the router's own counters from
/metrics (`dynamo_router_counter`: hit / reachable / request blocks) and a summary of every decision's
`x-dyn-route` explanation. Worker busy-ness comes from the workers' published load (event plane subject
`namespace.dynamo.component.*.kv-metrics`): the time share in which a worker had a running or waiting
request (the mocker then runs passes back to back, as a GPU would), plus mean KV usage and queue length.

    python benchmarks/kv_routing.py [--regimes a,b] [--rate 30] [--seconds 50] [--warmup 10]
        [--modes-a kv,kv:w=1,round-robin,random] [--modes-b kv,kv:w=1,kv:w=4,round-robin,random]
        [--clients N]   # closed loop with N clients instead of --rate (benchmarks/kv_routing_matrix.py
                        # runs issue 15's whole cache x load matrix)
        [--json benchmarks/out/kv_routing.json]

Defaults take about 12 minutes (9 deployments of ~75 s plus a 30 s probe). Traffic is 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import resource
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import httpx
import msgspec

from dynamo_cli.bench.http import HttpClient, RequestRecord
from dynamo_cli.bench.sse import Response
from dynamo_cli.runtime.names import component_subject
from dynamo_cli.runtime.planes import open_discovery, open_event_bus
from dynamo_cli.wire import LoadMetrics

MODEL = "smollm2"
CORPUS = (
    "You are a careful assistant for a logistics company. Answer questions about shipments, customs forms, "
    "warehouse capacity, delivery windows and invoices. Always cite the policy section you rely on, prefer "
    "short numbered steps, ask for the tracking number when it is missing, never invent prices, and escalate "
    "to a human agent when a customer mentions damage, loss, legal action or a safety problem. Dates are in "
    "ISO format; weights in kilograms; volumes in cubic metres. The northern hub closes at 18:00 on weekdays "
    "and at noon on Saturdays. Refunds take five to seven business days after the return is scanned. "
    "Hazardous goods need form HZ-4 signed by the shipper and a certified carrier. Pallets over 1,200 kg "
    "require a forklift booking 48 hours ahead. International parcels above the de minimis value pay duty "
    "on arrival unless the sender chose delivered-duty-paid. Summaries must fit in three sentences."
)


# ------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class Workload:
    prefixes: list[list[int]]
    pool: list[int]
    suffix_tokens: int
    max_tokens: int
    cacheable_tokens: int
    """Prompt tokens in full blocks that lie wholly inside the system prompt (the most that can hit)."""


def build_workload(
    num_prefixes: int, prefix_tokens: int, suffix_tokens: int, max_tokens: int, block_size: int, seed: int
) -> Workload:
    from dynamo_cli.model.tokenizer import load_tokenizer

    tok = load_tokenizer(MODEL)
    pool = tok.encode(CORPUS)
    firsts = list(dict.fromkeys(pool))  # distinct ids, in order of appearance
    if len(firsts) < num_prefixes:
        firsts += [t for t in range(1000, 1000 + num_prefixes) if t not in set(firsts)]
    rng = random.Random(seed)
    prefixes = []
    for i in range(num_prefixes):
        body = [pool[(rng.randrange(len(pool)) + j) % len(pool)] for j in range(prefix_tokens - 1)]
        prefixes.append([firsts[i], *body])
    assert len({p[0] for p in prefixes}) == num_prefixes
    assert tok.decode(prefixes[0][:8])  # real tokens of the model's vocabulary
    return Workload(prefixes, pool, suffix_tokens, max_tokens, (prefix_tokens // block_size) * block_size)


def make_body(work: Workload, prefix: int, rng: random.Random) -> dict[str, Any]:
    suffix = [rng.choice(work.pool) for _ in range(work.suffix_tokens)]
    return {
        "model": MODEL,
        "prompt": work.prefixes[prefix] + suffix,
        "max_tokens": work.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }


# -------------------------------------------------------------------------------------------- client


@dataclass(slots=True)
class KvRecord(RequestRecord):
    cached_tokens: int | None = None
    worker: str | None = None
    route: str | None = None
    prefix: int = -1
    measured: bool = False


class KvClient(HttpClient):
    """The lean client, also keeping the worker header, the route explanation and cached_tokens."""

    def _fill(self, record: RequestRecord, response: Response, failure: str | None) -> None:
        super()._fill(record, response, failure)
        if not isinstance(record, KvRecord):
            return
        record.worker = response.headers.get("x-worker-instance-id")
        record.route = response.headers.get("x-dyn-route")
        for _, payload in reversed(response.events):
            if b'"usage"' in payload:
                usage = msgspec.json.decode(payload).get("usage") or {}
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                break


# ------------------------------------------------------------------------------------------- process


def start_serve(
    tmp: str,
    mode: str,
    args: argparse.Namespace,
    num_gpu_blocks: int | None,
    log_path: Path,
    workers: int | None = None,
    extra: tuple[str, ...] = (),
) -> harness.Deployment:
    """`dyn serve` of the mocker for `mode` (harness.start_serve), pinned as the mode says; with `extra` flags."""
    workers = workers or args.workers
    router, knobs = parse_mode(mode, args)
    flags = ["--engine", "mocker", "--workers", str(workers), "--router", router, "--host", "127.0.0.1"]
    flags += ["--discovery", f"file://{tmp}/d", "--speedup-ratio", str(args.speedup), "--block-size"]
    flags += [str(args.block_size), *extra]
    if num_gpu_blocks:
        flags += ["--num-gpu-blocks", str(num_gpu_blocks)]
    if router == "kv":
        flags += ["--kv-overlap-score-weight", str(knobs["w"]), "--router-temperature", str(knobs["t"])]
        if not knobs["guard"]:
            flags.append("--no-hot-spot-guard")
        if knobs["cost"]:
            flags += ["--router-cost", knobs["cost"]]
    # `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: PYTHONSAFEPATH drops it,
    # or a run started in one checkout would run that checkout's code in every mode
    env = {"PYTHONPATH": knobs["code"], "PYTHONSAFEPATH": "1"} if knobs["code"] else None
    serve = harness.start_serve(flags, log_path, env=env, timeout_s=90.0, min_instances=workers)
    pin(serve.pid, knobs["pin"])
    return serve


def serve_argv(serve: harness.Deployment, tmp: str) -> str:
    """The deployment's command line as the results record it (the temporary folder as TMP)."""
    return " ".join(["serve", *serve.flags]).replace(tmp, "TMP")


ALL_CPUS = sorted(os.sched_getaffinity(0))


def pin(serve_pid: int, frontend_alone: bool) -> None:
    """`pin`: the frontend (every thread of the serve process) on the first CPU, its workers and this load
    generator on the others, as when the frontend has cores of its own and the engines' work is on GPUs;
    else this load generator on every CPU again (a mode before may have pinned it)."""
    rest = set(ALL_CPUS[1:]) if frontend_alone and len(ALL_CPUS) > 1 else set(ALL_CPUS)
    os.sched_setaffinity(0, rest)  # this thread: the load generator's event loop (threads it starts inherit)
    if not frontend_alone or rest == set(ALL_CPUS):
        return
    for pid, cpus in [(serve_pid, {ALL_CPUS[0]}), *[(k, rest) for k in harness.children(serve_pid)]]:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), cpus)


def parse_mode(mode: str, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """`kv`, `kv:w=4`, `kv:w=2:t=0.1:noguard`, `kv:cost=dynamo`, `round-robin`, `random` -> router and kv
    knobs (`cost=` unset: the router's default cost); any mode may add `code=DIR`: its `dyn serve` runs the
    checkout in DIR (PYTHONPATH), to compare two versions of the code in one run, and `pin`: the frontend
    on a CPU of its own."""
    router, *parts = mode.split(":")
    knobs: dict[str, Any] = {
        "w": args.kv_overlap_score_weight,
        "t": args.router_temperature,
        "guard": args.hot_spot_guard,
        "cost": getattr(args, "router_cost", None),
        "code": None,
        "pin": False,
    }
    for part in parts:
        if part == "pin":
            knobs["pin"] = True
        elif part.startswith("code="):
            knobs["code"] = str(Path(part[5:]).resolve())
        elif part == "noguard":
            knobs["guard"] = False
        elif part.startswith(("w=", "t=")):
            knobs[part[0]] = float(part[2:])
            if part[0] == "w":
                knobs["cost"] = knobs["cost"] or "dynamo"  # w is the weight of Dynamo's formula
        elif part.startswith("cost="):
            knobs["cost"] = part[5:]
        else:
            raise SystemExit(f"mode {mode!r}: unknown knob {part!r} (use w=, t=, cost=, noguard, code=, pin)")
    return router, knobs


def cpu_snapshot(serve_pid: int) -> dict[str, float]:
    """CPU seconds so far of the frontend (the serve process), its workers, and this load generator."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "frontend": harness.cpu_seconds(serve_pid),
        "workers": sum(harness.cpu_seconds(k) for k in harness.children(serve_pid)),
        "loadgen": usage.ru_utime + usage.ru_stime,
    }


async def scrape_router(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10) as http:
        return router_counters((await http.get(f"{url}/metrics")).text)


def router_counters(metrics: str) -> dict[str, float]:
    """The kv router's counters in a /metrics page (none for other routers)."""
    found = re.finditer(r'^dynamo_router_counter\{[^}]*name="(\w+)"[^}]*\} (\S+)$', metrics, re.M)
    return {m.group(1): float(m.group(2)) for m in found}


def window_marks(url: str, serve_pid: int) -> tuple[dict[str, float], dict[str, float]]:
    """The router's counters and everyone's CPU so far, blocking: run in a thread, off the clients' loop."""
    with httpx.Client(timeout=10) as http:
        counters = router_counters(http.get(f"{url}/metrics").text)
    return counters, cpu_snapshot(serve_pid)


# ---------------------------------------------------------------------------------------------- load


async def watch_load(discovery_url: str, samples: list[tuple[float, LoadMetrics]], ready: asyncio.Event) -> None:
    discovery = open_discovery(discovery_url)
    await discovery.start()
    bus = open_event_bus("embedded", discovery)
    decode = msgspec.msgpack.Decoder(LoadMetrics).decode
    try:
        sub = await bus.subscribe(component_subject("dynamo", "*", "kv-metrics"))
        ready.set()
        async for _, payload in sub:
            samples.append((time.perf_counter(), decode(payload)))
    finally:
        await bus.close()
        await discovery.close()


def load_summary(samples: list[tuple[float, LoadMetrics]], a: float, b: float) -> dict[str, Any]:
    """Time-weighted per-worker busy share, KV usage, running and waiting over [a, b]."""
    by_worker: dict[int, list[tuple[float, LoadMetrics]]] = defaultdict(list)
    for t, m in samples:
        by_worker[m.worker_id].append((t, m))
    workers = {}
    for wid, rows in by_worker.items():
        rows.sort(key=lambda r: r[0])
        acc = {"busy": 0.0, "usage": 0.0, "running": 0.0, "waiting": 0.0, "span": 0.0}
        for (t0, m), (t1, _) in zip(rows, [*rows[1:], (b, rows[-1][1])], strict=True):
            lo, hi = max(t0, a), min(t1, b)
            if hi <= lo:
                continue
            dt = hi - lo
            acc["span"] += dt
            acc["busy"] += dt * (m.num_running + m.num_waiting > 0)
            acc["usage"] += dt * (m.active_blocks / m.total_blocks if m.total_blocks else 0.0)
            acc["running"] += dt * m.num_running
            acc["waiting"] += dt * m.num_waiting
        span = acc.pop("span") or float("nan")
        before = [m for t, m in rows if t <= a] or rows[:1]
        after = [m for t, m in rows if t <= b] or rows[-1:]
        computed = after[-1].num_prefill_tokens_computed - before[-1].num_prefill_tokens_computed
        cached = after[-1].num_prefill_tokens_cached - before[-1].num_prefill_tokens_cached
        workers[f"{wid:x}"] = {k: v / span for k, v in acc.items()} | {
            "prefill_tokens_computed": computed,
            "prefill_tokens_cached": cached,
            "max_waiting": max((m.num_waiting for t, m in rows if a <= t <= b), default=0),
        }
    vals = list(workers.values())
    mean = (lambda k: statistics.fmean(w[k] for w in vals)) if vals else (lambda k: float("nan"))
    comp = sum(w["prefill_tokens_computed"] for w in vals)
    cach = sum(w["prefill_tokens_cached"] for w in vals)
    return {
        "busy_mean": mean("busy"),
        "busy_min": min((w["busy"] for w in vals), default=float("nan")),
        "kv_usage_mean": mean("usage"),
        "running_mean": mean("running"),
        "waiting_mean": mean("waiting"),
        "max_waiting": max((w["max_waiting"] for w in vals), default=0),
        "worker_side_hit_rate": cach / (cach + comp) if cach + comp else float("nan"),
        "workers": workers,
    }


# ------------------------------------------------------------------------------------------------ run


async def run_mode(
    url: str, discovery_url: str, mode: str, work: Workload, args: argparse.Namespace, seed: int, serve_pid: int
) -> dict[str, Any]:
    """One deployment's window: open-loop arrivals at `args.rate`, or closed loop with `args.clients`."""
    samples: list[tuple[float, LoadMetrics]] = []
    ready = asyncio.Event()
    watcher = asyncio.get_running_loop().create_task(watch_load(discovery_url, samples, ready))
    await asyncio.wait_for(ready.wait(), 10)
    is_kv = mode.split(":")[0] == "kv"
    # explanations cost the kv side CPU round-robin does not pay; --no-explain measures without them
    headers = {"x-dyn-explain-route": "1"} if is_kv and getattr(args, "explain", True) else None
    records: list[KvRecord] = []
    tasks: set[asyncio.Task[Any]] = set()
    client = KvClient(url, max_connections=4096, idle_timeout=120, request_timeout=300, headers=headers)
    start = time.perf_counter()
    measure_at = start + args.warmup
    end_at = measure_at + args.seconds
    marks: dict[str, Any] = {}

    async def mark() -> None:  # at the window's start: the router's counters and everyone's CPU so far
        # The same for every mode, and in a thread: a scrape on the clients' loop (once kv only) stalled them
        # at the window's start, and the requests it held back left as one burst (a wave kept for seconds).
        await asyncio.sleep(max(0.0, measure_at - time.perf_counter()))
        marks["before"], marks["cpu"] = await asyncio.to_thread(window_marks, url, serve_pid)

    marker = asyncio.get_running_loop().create_task(mark())
    loop = closed_loop if getattr(args, "clients", 0) else open_loop
    await loop(client, work, args, seed, records, tasks, measure_at, end_at)
    await marker
    window_end = time.perf_counter()
    after, cpu_after = await asyncio.to_thread(window_marks, url, serve_pid)
    cpu = {k: (v - marks["cpu"][k]) / (window_end - measure_at) for k, v in cpu_after.items()}
    load = load_summary(samples, measure_at, window_end)
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=args.drain)
        for task in pending:
            task.cancel()
    client.close()
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    row = summarize(mode, records, work, measure_at, window_end, marks["before"], after, load, args)
    row.update({f"cpu_{k}": v for k, v in cpu.items()})  # cores used (1.0 = one core busy)
    return row


async def open_loop(
    client: KvClient,
    work: Workload,
    args: argparse.Namespace,
    seed: int,
    records: list[KvRecord],
    tasks: set[asyncio.Task[Any]],
    measure_at: float,
    end_at: float,
) -> None:
    """Poisson (or constant) arrivals at `args.rate` until `end_at`; the same sequence for every mode."""
    rng = random.Random(seed)
    next_at = time.perf_counter()
    while True:
        next_at += rng.expovariate(args.rate) if args.arrival == "poisson" else 1.0 / args.rate
        prefix = rng.randrange(len(work.prefixes))
        body = make_body(work, prefix, rng)
        if next_at >= end_at:
            break
        now = time.perf_counter()
        if next_at > now:
            await asyncio.sleep(next_at - now)
        record = KvRecord(
            prefix=prefix, measured=next_at >= measure_at, scheduled=next_at, input_tokens=len(body["prompt"])
        )
        records.append(record)
        task = asyncio.get_running_loop().create_task(client.stream("/v1/completions", body, record))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.sleep(max(0.0, end_at - time.perf_counter()))


async def closed_loop(
    client: KvClient,
    work: Workload,
    args: argparse.Namespace,
    seed: int,
    records: list[KvRecord],
    tasks: set[asyncio.Task[Any]],
    measure_at: float,
    end_at: float,
) -> None:
    """`args.clients` clients, each sending its next request when the last one ends, until `end_at`.
    Client i draws its prompts from its own seeded rng, so every mode gets the same per-client sequence."""

    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while (now := time.perf_counter()) < end_at:
            prefix = rng.randrange(len(work.prefixes))
            body = make_body(work, prefix, rng)
            record = KvRecord(
                prefix=prefix, measured=now >= measure_at, scheduled=now, input_tokens=len(body["prompt"])
            )
            records.append(record)
            await client.stream("/v1/completions", body, record)

    for i in range(args.clients):
        task = asyncio.get_running_loop().create_task(client_loop(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.sleep(max(0.0, end_at - time.perf_counter()))


async def run_capacity(url: str, work: Workload, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Closed loop at --probe-concurrency on ONE worker for --probe-seconds: its saturated throughput."""
    rng = random.Random(seed)
    records: list[KvRecord] = []
    client = KvClient(url, max_connections=args.probe_concurrency, idle_timeout=120, request_timeout=300)
    start = time.perf_counter()
    measure_at, end_at = start + args.probe_warmup, start + args.probe_warmup + args.probe_seconds

    async def slot() -> None:
        while time.perf_counter() < end_at:
            prefix = rng.randrange(len(work.prefixes))
            record = KvRecord(prefix=prefix, measured=time.perf_counter() >= measure_at)
            records.append(record)
            await client.stream("/v1/completions", make_body(work, prefix, rng), record)

    await asyncio.gather(*(slot() for _ in range(args.probe_concurrency)))
    client.close()
    done = [r for r in records if r.is_ok and measure_at <= r.end <= end_at]
    ok = [r for r in records if r.is_ok and r.measured]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    return {
        "concurrency": args.probe_concurrency,
        "req_per_s": len(done) / args.probe_seconds,
        "out_tok_per_s": sum(r.completion_tokens or 0 for r in done) / args.probe_seconds,
        "hit_rate": sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else float("nan"),
        "ttft_p50_ms": pct([r.ttft * 1000 for r in ok if r.ttft is not None], 50),
        "failed": sum(1 for r in records if not r.is_ok),
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def summarize(
    mode: str,
    records: list[KvRecord],
    work: Workload,
    a: float,
    b: float,
    before: dict[str, float],
    after: dict[str, float],
    load: dict[str, Any],
    args: argparse.Namespace,
) -> dict[str, Any]:
    measured = [r for r in records if r.measured]
    ok = [r for r in measured if r.is_ok and r.end > 0]
    ttft = [
        (r.ttft if r.ttft is not None else r.first_event - r.start) * 1000
        for r in ok
        if r.ttft is not None or r.first_event is not None
    ]
    e2e = [(r.end - r.start) * 1000 for r in ok]
    mid = (a + b) / 2
    halves: tuple[list[float], list[float]] = ([], [])
    for r in ok:
        if r.ttft is not None:
            halves[r.start >= mid].append(r.ttft * 1000)
    lag = [(r.start - r.scheduled) * 1000 for r in measured if r.start and r.scheduled]
    done_in_window = [r for r in records if r.is_ok and a <= r.end <= b]
    window = b - a
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    per_worker = Counter(r.worker for r in ok)
    prefixes_per_worker = defaultdict(set)
    for r in ok:
        prefixes_per_worker[r.worker].add(r.prefix)
    if args.records:
        out_records = [
            {
                "t": round(r.start - a, 4),
                "lag_ms": round((r.start - r.scheduled) * 1000, 2),
                "ttft_ms": round(r.ttft * 1000, 2) if r.ttft is not None else None,
                "e2e_ms": round((r.end - r.start) * 1000, 2),
                "worker": r.worker,
                "prefix": r.prefix,
                "cached": r.cached_tokens,
                "error": r.error,
                "route": r.route,
            }
            for r in measured
        ]
    out: dict[str, Any] = {
        "mode": mode,
        "sent": len(measured),
        "ok": len(ok),
        "failed": len(measured) - len(ok),
        "errors": dict(Counter((r.error or "")[:80] for r in measured if not r.is_ok).most_common(3)),
        "offered_req_per_s": len(measured) / window,
        "req_per_s": len(done_in_window) / window,
        "out_tok_per_s": sum(r.completion_tokens or 0 for r in done_in_window) / window,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p90_ms": pct(ttft, 90),
        "ttft_p99_ms": pct(ttft, 99),
        "ttft_ms": sorted(round(x, 2) for x in ttft),
        "e2e_p50_ms": pct(e2e, 50),
        "e2e_p90_ms": pct(e2e, 90),
        "ttft_p50_1st_half_ms": pct(halves[0], 50),
        "ttft_p50_2nd_half_ms": pct(halves[1], 50),
        "send_lag_p99_ms": pct(lag, 99),
        "hit_rate": cached / prompt if prompt else float("nan"),
        "cacheable_hit_share": cached / (work.cacheable_tokens * len(ok)) if ok else float("nan"),
        "requests_per_worker": sorted(per_worker.values(), reverse=True),
        "prefixes_per_worker": sorted((len(s) for s in prefixes_per_worker.values()), reverse=True),
        **{k: v for k, v in load.items() if k != "workers"},
        "load_per_worker": load["workers"],
    }
    if args.records:
        out["records"] = out_records
    if after:
        d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        out["router"] = d
        if d.get("num_request_blocks"):
            out["router_hit_blocks_rate"] = d["num_hit_blocks"] / d["num_request_blocks"]
            out["router_reachable_blocks_rate"] = d["num_reachable_hit_blocks"] / d["num_request_blocks"]
        out["explain"] = explain_summary(ok, work, args.block_size)
    return out


def explain_summary(ok: list[KvRecord], work: Workload, block_size: int) -> dict[str, Any]:
    """What the x-dyn-route explanations say: reasons, how often the best-cached worker lost, and why."""
    reasons: Counter[str] = Counter()
    lost = 0
    lost_examples: list[dict[str, Any]] = []
    margins = []
    prefix_blocks = work.cacheable_tokens // block_size
    missed = 0
    miss_reasons: Counter[str] = Counter()
    speeds: list[float] = []  # the time cost's prefill speed (tokens/s) as each explanation shows it
    for r in ok:
        if not r.route:
            continue
        route = json.loads(r.route)
        reasons[route["reason"]] += 1
        cands = route["candidates"]
        speeds += [c["prefill_blocks"] * block_size / c["prefill_s"] for c in cands[:1] if c.get("prefill_s")]
        chosen = next(c for c in cands if c["worker_id"] == route["worker_id"])
        best = max(c["overlap_blocks"] for c in cands)
        if route.get("margin") is not None:
            margins.append(route["margin"])
        if chosen["overlap_blocks"] < best:
            lost += 1
            if len(lost_examples) < 3:
                lost_examples.append(route)
        if (r.cached_tokens or 0) < work.cacheable_tokens:
            missed += 1
            kind = (
                "router chose a worker without the prefix"
                if chosen["overlap_blocks"] < prefix_blocks
                else ("router saw the prefix, the worker had evicted it")
            )
            if best < prefix_blocks:
                kind = "no worker had the prefix (cold or evicted everywhere)"
            miss_reasons[kind] += 1
    return {
        "reasons": dict(reasons),
        "decisions_best_cache_lost": lost,
        "margin_p50": pct(margins, 50),
        "requests_missing_prefix": missed,
        "miss_reasons": dict(miss_reasons),
        "lost_examples": lost_examples,
        "prefill_tps_first_last": [round(speeds[0]), round(speeds[-1])] if speeds else None,
    }


# ----------------------------------------------------------------------------------------------- main


def regime_settings(name: str, args: argparse.Namespace) -> tuple[int, int | None]:
    if name == "a":
        return args.prefixes_a, None
    return args.prefixes_b, args.num_gpu_blocks_b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regimes", default="a,b")
    p.add_argument(
        "--modes-a",
        default="kv,kv:w=1,round-robin,random",
        help="router modes of regime a; kv knobs as kv:w=4, kv:t=0.1, kv:noguard, kv:cost=dynamo",
    )
    p.add_argument("--modes-b", default="kv,kv:w=1,kv:w=4,round-robin,random", help="router modes of regime b")
    p.add_argument("--clients", type=int, default=0, help="closed loop with this many clients (0: open loop)")
    p.add_argument("--router-cost", default=None, help="cost of the kv modes without cost= (default: the router's)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seconds", type=float, default=50.0, help="measured window per mode")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of the same traffic before the window")
    p.add_argument("--drain", type=float, default=60.0, help="max seconds to wait for in-flight requests")
    p.add_argument("--rate", type=float, default=30.0, help="requests/s offered (regime b; a unless --rate-a)")
    p.add_argument("--rate-a", type=float, default=None)
    p.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    p.add_argument("--prefixes-a", type=int, default=20)
    p.add_argument("--prefixes-b", type=int, default=40)
    p.add_argument("--num-gpu-blocks-b", type=int, default=512)
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--suffix-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=50)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--speedup", type=float, default=1.0, help="mocker speedup; times are scaled back by it")
    p.add_argument("--kv-overlap-score-weight", type=float, default=1.0)
    p.add_argument("--router-temperature", type=float, default=0.0)
    p.add_argument("--no-hot-spot-guard", dest="hot_spot_guard", action="store_false")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--probe-regimes", default="b", help="regimes whose 1-worker capacity is probed first")
    p.add_argument("--probe-concurrency", type=int, default=32)
    p.add_argument("--probe-seconds", type=float, default=20.0)
    p.add_argument("--probe-warmup", type=float, default=5.0)
    p.add_argument("--json", default=str(harness.results_path("kv_routing")))
    p.add_argument("--records", action="store_true", help="keep every measured request in the JSON")
    p.add_argument("--no-explain", dest="explain", action="store_false", help="kv modes: no x-dyn-explain-route")
    args = p.parse_args()

    import uvloop

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results: dict[str, Any] = {
        "args": vars(args),
        "regimes": {},
        "started": started,
        "cpus": os.cpu_count(),
        "loadavg_start": harness.loadavg(),
    }
    for regime in args.regimes.split(","):
        num_prefixes, blocks = regime_settings(regime, args)
        work = build_workload(
            num_prefixes, args.prefix_tokens, args.suffix_tokens, args.max_tokens, args.block_size, args.seed
        )
        rate = args.rate_a if regime == "a" and args.rate_a else args.rate
        rargs = argparse.Namespace(**{**vars(args), "rate": rate})
        rows = []
        probe = None
        if regime in args.probe_regimes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                serve = start_serve(tmp, "round-robin", args, blocks, Path(tmp) / "serve.log", workers=1)
                try:
                    time.sleep(1.0)
                    probe = uvloop.run(run_capacity(serve.url, work, args, args.seed + 1))
                finally:
                    serve.stop()
                probe["serve_argv"] = serve_argv(serve, tmp)
            scale(probe, args.speedup)
            probe["cache_blind_capacity_req_per_s"] = probe["req_per_s"] * args.workers
            # both in speedup-1 units: the probe was scaled back above, the offered rate is divided here
            probe["offered_over_capacity"] = rate / args.speedup / probe["cache_blind_capacity_req_per_s"]
            print("capacity probe (1 worker, closed loop):", json.dumps(probe), flush=True)
        for mode in (args.modes_a if regime == "a" else args.modes_b).split(","):
            with tempfile.TemporaryDirectory() as tmp:
                serve = start_serve(tmp, mode, args, blocks, Path(tmp) / "serve.log")
                try:
                    time.sleep(1.0)  # let the frontend see all 4 workers' KV streams
                    row = uvloop.run(run_mode(serve.url, f"file://{tmp}/d", mode, work, rargs, args.seed, serve.pid))
                finally:
                    serve.stop()
                row["serve_argv"] = serve_argv(serve, tmp)
            scale(row, args.speedup)
            rows.append(row)
            print(
                json.dumps(
                    {k: v for k, v in row.items() if k not in ("load_per_worker", "explain", "records")}, default=str
                ),
                flush=True,
            )
        results["regimes"][regime] = {
            "num_prefixes": num_prefixes,
            "num_gpu_blocks": blocks or 16384,
            "rate": rate,
            "cacheable_tokens": work.cacheable_tokens,
            "prompt_tokens": args.prefix_tokens + args.suffix_tokens,
            "capacity_probe": probe,
            "rows": rows,
        }
    results["loadavg_end"] = harness.loadavg()
    results["bars"] = bars(results)
    print_tables(results)
    harness.write_results("kv_routing", results, args.json, loadavg_start=results["loadavg_start"])


def scale(row: dict[str, Any], speedup: float) -> None:
    """Times back to speedup-1 units (a speedup S run is S times faster than real time)."""
    if speedup == 1:
        return
    for key in list(row):
        if key.endswith("_ms"):
            row[key] *= speedup
        elif key in ("req_per_s", "out_tok_per_s", "offered_req_per_s"):
            row[key] /= speedup


def bars(results: dict[str, Any]) -> dict[str, Any]:
    """The regime-b bar for every kv variant: hit rate >= 90 %, rr TTFT p50 / kv TTFT p50 >= 3, busy >= 70 %."""
    reg = results["regimes"].get("b")
    if not reg:
        return {}
    rows = {r["mode"]: r for r in reg["rows"]}
    out: dict[str, Any] = {"min_time_busy_all_modes": min(r["busy_min"] for r in rows.values())}
    out["time_busy_ok"] = out["min_time_busy_all_modes"] >= 0.70
    if reg.get("capacity_probe"):
        out["offered_over_cache_blind_capacity"] = reg["capacity_probe"]["offered_over_capacity"]
    for mode, row in rows.items():
        if mode.split(":")[0] != "kv":
            continue
        bar: dict[str, Any] = {"hit_rate": row["hit_rate"], "hit_rate_ok": row["hit_rate"] >= 0.90}
        if "round-robin" in rows:
            bar["rr_over_kv_ttft_p50"] = rows["round-robin"]["ttft_p50_ms"] / row["ttft_p50_ms"]
            bar["ttft_ratio_ok"] = bar["rr_over_kv_ttft_p50"] >= 3
        if "random" in rows:
            bar["random_over_kv_ttft_p50"] = rows["random"]["ttft_p50_ms"] / row["ttft_p50_ms"]
        out[mode] = bar
    return out


def print_tables(results: dict[str, Any]) -> None:
    cols = [
        ("mode", "mode", "{}"),
        ("offered", "offered_req_per_s", "{:.1f}"),
        ("req/s", "req_per_s", "{:.1f}"),
        ("out tok/s", "out_tok_per_s", "{:.0f}"),
        ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
        ("TTFT p90", "ttft_p90_ms", "{:.0f}"),
        ("e2e p50", "e2e_p50_ms", "{:.0f}"),
        ("hit rate", "hit_rate", "{:.1%}"),
        ("prefix hit", "cacheable_hit_share", "{:.1%}"),
        ("busy", "busy_mean", "{:.0%}"),
        ("KV use", "kv_usage_mean", "{:.0%}"),
        ("running", "running_mean", "{:.1f}"),
        ("waiting", "waiting_mean", "{:.1f}"),
        ("fe CPU", "cpu_frontend", "{:.2f}"),
        ("wk CPU", "cpu_workers", "{:.2f}"),
        ("fail", "failed", "{}"),
    ]
    for name, reg in results["regimes"].items():
        print(
            f"\nregime ({name}): P={reg['num_prefixes']} prompts, {reg['num_gpu_blocks']} blocks/worker, "
            f"{reg['rate']} req/s offered"
        )
        if reg.get("capacity_probe"):
            cap = reg["capacity_probe"]
            print(
                f"cache-blind capacity: 1 worker saturates at {cap['req_per_s']:.1f} req/s (closed loop, "
                f"c={cap['concurrency']}, hit rate {cap['hit_rate']:.0%}) -> 4 workers "
                f"{cap['cache_blind_capacity_req_per_s']:.1f} "
                f"req/s; offered = {cap['offered_over_capacity']:.0%} of it"
            )
        print("| " + " | ".join(c[0] for c in cols) + " |")
        print("|" + "---|" * len(cols))
        for row in reg["rows"]:
            print("| " + " | ".join(fmt.format(row.get(key, float("nan"))) for _, key, fmt in cols) + " |")
        for row in reg["rows"]:
            if "router" in row:
                print(
                    f"kv router counters: hit blocks {row.get('router_hit_blocks_rate', float('nan')):.1%}, "
                    f"reachable {row.get('router_reachable_blocks_rate', float('nan')):.1%}; "
                    f"explain: {json.dumps({k: v for k, v in row['explain'].items() if k != 'lost_examples'})}"
                )
    if results.get("bars"):
        print("\nbars (regime b):", json.dumps(results["bars"]))


if __name__ == "__main__":
    main()
