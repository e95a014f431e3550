"""What the mocker's own timing model predicts for benchmarks/disagg.py, with no process, socket or clock.

The mocker's pure scheduler (`dyn_engines.mocker.scheduler.Scheduler`, vLLM-style passes with an 8,192-token
budget and chunked prefill) and its polynomial timing model are driven by a discrete-event loop: a pass
starts when its engine has work, lasts `pass_ms` of simulated time, and emits its tokens at its end, as
the engine's step loop does. A remote prefill emits the first token on the prefill engine; the request
then joins the decode engine after the modelled KV transfer (bytes / 64 GB/s) with `is_prefilled`, so
the decode engine computes none of its prompt. Frontend, network and event-loop costs are left out: the
gap between these figures and a measured run is what the real system adds.

  closed: ISL 3,000, OSL 150, concurrency 16 (part 1): agg (2 engines, least-loaded) vs 1P+1D always.
  mixed:  half ISL 100, half 3,000, OSL 150, Poisson (part 2): agg, always, isl, adaptive; goodput.

    python benchmarks/disagg_model.py [--seconds 120] [--rates 16,24,32,40] [--slo 'ttft=1000 itl=25']
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections.abc import Callable
from typing import Any

import harness
from dyn_engines.mocker.kv_manager import KvManager
from dyn_engines.mocker.scheduler import MockRequest, Scheduler, SchedulerConfig

from dynamo_cli.core.disagg import STALL_WEIGHT
from dynamo_cli.timing import TimingModel

BLOCK_SIZE, NUM_BLOCKS, OSL, KV_BYTES_PER_TOKEN, BANDWIDTH = 64, 16384, 150, 131072, 64e9
MAX_LOCAL_PREFILL = 512


class Engine:
    """One simulated worker: a scheduler and whether a pass is under way."""

    def __init__(self, is_prefill: bool = False) -> None:
        config = SchedulerConfig(is_prefill_only=is_prefill)
        self.scheduler = Scheduler(KvManager(NUM_BLOCKS, BLOCK_SIZE), config, TimingModel())
        self.is_busy = False

    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)


class Cluster:
    """Two engines (agg: both full; otherwise prefill + decode) and the events between them."""

    def __init__(self, mode: str, seed: int = 0) -> None:
        self.mode = mode
        self.engines = [Engine(), Engine()] if mode == "agg" else [Engine(is_prefill=True), Engine()]
        self.events: list[tuple[float, int, str, Any]] = []
        self.times: dict[str, tuple[float, list[float]]] = {}  # request -> (start, token times)
        self.done: list[tuple[float, list[float]]] = []
        self.rng = random.Random(seed)
        self.seq = 0
        self.on_done: Callable[[float], None] = lambda now: None

    def push(self, at: float, kind: str, item: Any) -> None:
        self.seq += 1  # ties break in push order, never on the items
        heapq.heappush(self.events, (at, self.seq, kind, item))

    def arrive(self, now: float, isl: int) -> None:
        request_id = f"r{len(self.times)}"
        tokens = [self.rng.randrange(1, 40_000) for _ in range(isl)]
        self.times[request_id] = (now, [])
        if self.mode == "agg":
            engine, remote = min(self.engines, key=Engine.load), False
        else:
            remote = self.is_prefill_remote(isl)
            engine = self.engines[0] if remote else self.engines[1]
        engine.scheduler.add(MockRequest(request_id, tokens, 1 if remote else OSL, BLOCK_SIZE))
        self.kick(engine, now)

    def is_prefill_remote(self, isl: int) -> bool:
        """dynamo_cli.core.disagg.decide for one prefill and one decode worker, from the schedulers' queues."""
        if self.mode == "always":
            return True
        if isl <= MAX_LOCAL_PREFILL:
            return False
        prefill, decode = (e.scheduler for e in self.engines)
        local_cost = decode.num_prompt_tokens_left() + isl * (1 + STALL_WEIGHT * len(decode.running))
        return self.mode == "isl" or prefill.num_prompt_tokens_left() <= local_cost

    def kick(self, engine: Engine, now: float) -> None:
        if not engine.is_busy and engine.scheduler.has_work:
            result = engine.scheduler.step()
            engine.is_busy = True
            self.push(now + result.duration_ms / 1e3, "pass", (engine, result))

    def run(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            now, _, kind, item = heapq.heappop(self.events)
            if kind == "arrive":
                self.arrive(now, item)
            elif kind == "pass":
                self.end_pass(now, *item)
            else:  # "import": a remotely prefilled request reaches the decode engine
                decode = self.engines[1]
                request = MockRequest(item.request_id, item.token_ids, OSL - 1, BLOCK_SIZE, is_prefilled=True)
                decode.scheduler.add(request)
                self.kick(decode, now)

    def end_pass(self, now: float, engine: Engine, result: Any) -> None:
        engine.is_busy = False
        for request in result.emitted:
            start, times = self.times[request.request_id]
            times.append(now)
            if self.mode != "agg" and engine is self.engines[0]:
                self.push(now + (len(request.token_ids) - 1) * KV_BYTES_PER_TOKEN / BANDWIDTH, "import", request)
            elif len(times) >= OSL:
                self.done.append((start, times))
                self.on_done(now)
        self.kick(engine, now)


def figures(
    done: list[tuple[float, list[float]]], after: float, span: float, slo: tuple[float, float]
) -> dict[str, float]:
    """req/s, TTFT and ITL percentiles (ms), chunk-gap p99 and goodput of requests started after `after`."""
    kept = [(s, t) for s, t in done if s >= after]
    ttft = sorted((t[0] - s) * 1e3 for s, t in kept)
    itl = sorted((t[-1] - t[0]) / (len(t) - 1) * 1e3 for _, t in kept)
    gaps = sorted((b - a) * 1e3 for _, t in kept for a, b in zip(t, t[1:], strict=False))
    good = sum(1 for s, t in kept if (t[0] - s) * 1e3 <= slo[0] and (t[-1] - t[0]) / (len(t) - 1) * 1e3 <= slo[1])

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    return {
        "req/s": len(kept) / span,
        "TTFT p50": pct(ttft, 0.5),
        "TTFT p99": pct(ttft, 0.99),
        "ITL p50": pct(itl, 0.5),
        "ITL p99": pct(itl, 0.99),
        "gap p99": pct(gaps, 0.99),
        "goodput": good / span,
    }


def closed(mode: str, seconds: float, slo: tuple[float, float]) -> dict[str, float]:
    """Concurrency 16 of ISL 3,000 prompts; a finished request is replaced at once. First 10 s dropped."""
    cluster = Cluster(mode)
    cluster.on_done = lambda now: cluster.arrive(now, 3000)
    for _ in range(16):
        cluster.arrive(0.0, 3000)
    cluster.run(seconds)
    return figures(cluster.done, 10.0, seconds - 10.0 - 2.0, slo)


def mixed(mode: str, rate: float, seconds: float, slo: tuple[float, float]) -> dict[str, float]:
    """Poisson arrivals at `rate`, half ISL 100 and half 3,000; requests started in the first 5 s dropped."""
    cluster, arrivals, now = Cluster(mode), random.Random(1), 0.0
    while now < seconds:
        now += arrivals.expovariate(rate)
        cluster.push(now, "arrive", arrivals.choice([100, 3000]))
    cluster.run(float("inf"))
    return figures(cluster.done, 5.0, seconds - 5.0, slo)


def show(label: str, row: dict[str, float]) -> None:
    print(f"  {label:18s} " + "  ".join(f"{k} {v:8.2f}" for k, v in row.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="simulated seconds per run")
    parser.add_argument("--rates", default="16,24,32,40")
    parser.add_argument("--slo", default="ttft=1000 itl=25", help="ms")
    parser.add_argument("--json", default=str(harness.results_path("disagg_model")))
    args = parser.parse_args()
    load_start = harness.loadavg()
    values = dict(item.split("=") for item in args.slo.split())
    slo = (float(values["ttft"]), float(values["itl"]))
    print("closed loop: ISL 3000, OSL 150, c=16")
    rows = {mode: closed(mode, args.seconds, slo) for mode in ("agg", "always")}
    for mode, row in rows.items():
        show(mode, row)
    show("always/agg", {k: rows["always"][k] / rows["agg"][k] for k in rows["agg"]})
    print(f"mixed: half ISL 100, half 3000, OSL 150, Poisson; goodput: TTFT <= {slo[0]:g} ms, ITL <= {slo[1]:g} ms")
    mixes = []
    for rate in (float(r) for r in args.rates.split(",")):
        for mode in ("agg", "always", "isl", "adaptive"):
            figures = mixed(mode, rate, args.seconds, slo)
            show(f"{rate:g} req/s {mode}", figures)
            mixes.append({"rate": rate, "mode": mode, **figures})
    results = {"args": vars(args), "closed": rows, "mixed": mixes}
    harness.write_results("disagg_model", results, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
