"""Mocker fidelity in virtual time: dyn's mocker scheduler against Dynamo 1.6.1's compiled core, same workloads.

Both sides run in simulated time, no processes: dyn's `Scheduler` (engines/mocker, the scheduler and timing model
of `dyn worker --engine mocker`) under a small discrete-event loop, and Dynamo 1.6.1's mocker core through
`dynamo._core.run_mocker_trace_replay` (the `ai-dynamo-runtime` 1.6.1 wheel, offline replay) on a trace of the
same sessions. Workload: C closed-loop clients (one session each) with unique prompts of ISL tokens and OSL
output tokens; a client sends its next prompt `--turnaround-ms` after its last one ended. Streams start all at
once, or staggered 100 ms apart: at a fixed OSL the two patterns settle in two regimes (prompts in waves vs
spread; benchmarks/RESULTS.md, issue 35). Routing over two aggregated workers is round-robin on both sides
(Dynamo's `router_mode="round_robin"`; here a global counter in arrival order); 1P+1D sends every prompt to the
prefill worker, then to the decode worker with its KV, no transfer delay on either side (both defaults).

TTFT is what each system's client sees: dyn streams the prefill worker's token at once (core/dispatch.py
`_take_prefill`), Dynamo's replay counts the decode worker's first token; `dyn@decode` in the JSON is dyn's
TTFT at the decode worker's first token, the mocker-to-mocker comparison. ITL: per gap (every token after the
first) and per request ((last - first) / (OSL - 1)), p50 of each, p99 per gap.

    python benchmarks/mocker_fidelity.py                      # the matrix, about a minute
    python benchmarks/mocker_fidelity.py --setups agg2 --concurrency 16 --isl 3000
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import harness
import numpy as np
from dyn_engines.mocker.kv_manager import KvManager
from dyn_engines.mocker.scheduler import MockRequest, PassResult, Scheduler, SchedulerConfig

from dynamo_cli.timing import TimingModel

BLOCK_SIZE = 64
NUM_GPU_BLOCKS = 16384
"""Both mockers' defaults (Dynamo 1.6.1: `_normalize_mocker_config({})`)."""
SETUPS = ("agg1", "agg2", "disagg")
STARTS = {"once": 0.0, "stagger": 100.0}
"""Start pattern -> ms between the first requests of successive clients."""
METRICS = ("rps", "ttft_p50", "ttft_p90", "itl_gap_p50", "itl_req_p50", "itl_p99")
TOLERANCE = 0.10


@dataclass(frozen=True)
class Cell:
    """One workload of the matrix."""

    setup: str
    """agg1 | agg2 (round-robin) | disagg (1 prefill + 1 decode)."""
    concurrency: int
    isl: int
    osl: int
    start: str
    """once | stagger (STARTS)."""

    @property
    def name(self) -> str:
        return f"{self.setup} c{self.concurrency} isl{self.isl} {self.start}"


@dataclass
class Record:
    """One request as its client saw it, in virtual ms."""

    arrival: float
    first: float = math.nan
    """The client's first token (dyn disagg: the prefill worker's)."""
    decode_first: float = math.nan
    """Disagg: the decode worker's first token."""
    last: float = math.nan
    gaps: list[float] = field(default_factory=list)


##### dyn: its scheduler under a discrete-event loop #####


class DynReplay:
    """C sessions over dyn's mocker schedulers; `run()` returns every request's record."""

    def __init__(self, cell: Cell, turns: int, turnaround_ms: float, rules: dict[str, str]) -> None:
        self.cell, self.turns, self.turnaround = cell, turns, turnaround_ms
        roles = ["prefill", "decode"] if cell.setup == "disagg" else ["both"] * (2 if cell.setup == "agg2" else 1)
        self.workers = [self._scheduler(role == "prefill", rules) for role in roles]
        self.pending: list[PassResult | None] = [None] * len(roles)
        self.is_busy = [False] * len(roles)
        """A pass runs, or one starts once every event of this instant is in (as Dynamo's replay orders them)."""
        self.events: list[tuple[float, int, int, str, Any]] = []
        self.seq = itertools.count()
        self.records: dict[str, Record] = {}
        self.session_of: dict[str, int] = {}
        self.turn = [0] * cell.concurrency
        self.next_worker = 0

    @staticmethod
    def _scheduler(is_prefill_only: bool, rules: dict[str, str]) -> Scheduler:
        config = SchedulerConfig(is_prefill_only=is_prefill_only, **rules)  # type: ignore[arg-type]
        return Scheduler(KvManager(NUM_GPU_BLOCKS, BLOCK_SIZE), config, TimingModel())

    def run(self) -> list[Record]:
        gap = STARTS[self.cell.start]
        for session in range(self.cell.concurrency):
            self._push(session * gap, "send", session)
        while self.events:
            now, _, _, kind, payload = heapq.heappop(self.events)
            if kind == "send":
                self._send(now, payload)
            elif kind == "start":
                self._start_pass(now, payload)
            else:
                self._pass_end(now, payload)
        return list(self.records.values())

    def _push(self, at: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (at, kind == "start", next(self.seq), kind, payload))

    def _send(self, now: float, session: int) -> None:
        cell, number = self.cell, len(self.records)
        request_id = f"r{number}"
        self.records[request_id] = Record(arrival=now)
        self.session_of[request_id] = session
        self.turn[session] += 1
        prompt = range(number * cell.isl, (number + 1) * cell.isl)  # unique: no prefix is shared
        max_tokens = 1 if cell.setup == "disagg" else cell.osl
        worker = self.next_worker % len(self.workers) if cell.setup == "agg2" else 0
        self.next_worker += 1
        self._arrive(now, worker, MockRequest(request_id, prompt, max_tokens, BLOCK_SIZE, seed=number))

    def _arrive(self, now: float, worker: int, request: MockRequest) -> None:
        self.workers[worker].add(request)
        if not self.is_busy[worker]:
            self.is_busy[worker] = True
            self._push(now, "start", worker)

    def _start_pass(self, now: float, worker: int) -> None:
        result = self.workers[worker].step()
        self.pending[worker] = result
        self._push(now + result.duration_ms, "pass_end", worker)

    def _pass_end(self, now: float, worker: int) -> None:
        result, self.pending[worker] = self.pending[worker], None
        assert result is not None
        is_prefill = self.cell.setup == "disagg" and worker == 0
        for request in result.emitted:
            self._token(now, request, is_prefill)
        self.is_busy[worker] = self.workers[worker].has_work
        if self.is_busy[worker]:
            self._push(now, "start", worker)

    def _token(self, now: float, request: MockRequest, is_prefill: bool) -> None:
        record = self.records[request.request_id]
        if is_prefill:  # the client has its first token; the decode worker gets prompt + [it], KV computed
            record.first = record.last = now
            osl = self.cell.osl - 1
            self._arrive(now, 1, MockRequest(request.request_id, request.token_ids, osl, BLOCK_SIZE, is_prefilled=True))
            return
        if math.isnan(record.first):
            record.first = now
        elif math.isnan(record.decode_first) and request.is_prefilled:
            record.decode_first = now
        if not math.isnan(record.last):
            record.gaps.append(now - record.last)
        record.last = now
        session = self.session_of[request.request_id]
        if request.is_finished and self.turn[session] < self.turns:
            self._push(now + self.turnaround, "send", session)


##### Dynamo 1.6.1: its core's offline trace replay #####


def dynamo_core(path: str) -> Any | None:
    """`dynamo._core` from `path` (the unpacked ai-dynamo-runtime 1.6.1 wheel), or None if it is not there."""
    if not (Path(path) / "dynamo").is_dir():
        return None
    sys.path.insert(0, path)
    try:
        import dynamo._core as core  # type: ignore[import-not-found]
    except ImportError:
        return None
    return core


def write_trace(cell: Cell, turns: int, turnaround_ms: float, path: Path) -> None:
    """The same sessions as `DynReplay`, in Dynamo's mooncake trace format (unique block hashes per request)."""
    num_blocks = -(-cell.isl // BLOCK_SIZE)
    next_hash = itertools.count(1)
    with path.open("w") as out:
        for session in range(cell.concurrency):
            for turn in range(turns):
                row: dict[str, Any] = {"session_id": f"s{session}", "input_length": cell.isl}
                row |= {"output_length": cell.osl, "hash_ids": [next(next_hash) for _ in range(num_blocks)]}
                if turn == 0:
                    row["timestamp"] = session * STARTS[cell.start]
                else:
                    row["delay"] = turnaround_ms  # after the session's previous request ended
                out.write(json.dumps(row) + "\n")


def replay_dynamo(core: Any, cell: Cell, turns: int, turnaround_ms: float) -> tuple[list[Record], dict[str, Any]]:
    """Dynamo's records and its summary (whose per-gap ITLs the records lack)."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        write_trace(cell, turns, turnaround_ms, trace)
        kw: dict[str, Any] = dict(replay_mode="offline", router_mode="round_robin", trace_block_size=BLOCK_SIZE)
        kw["capture_per_request"] = True
        engine = {"block_size": BLOCK_SIZE}
        if cell.setup == "disagg":
            kw["prefill_engine_args"] = {"engine": {**engine, "worker_type": "prefill"}}
            kw["decode_engine_args"] = {"engine": {**engine, "worker_type": "decode"}}
            kw |= {"num_prefill_workers": 1, "num_decode_workers": 1}
        else:
            kw |= {"extra_engine_args": {"engine": engine}, "num_workers": 2 if cell.setup == "agg2" else 1}
        result = core.run_mocker_trace_replay([str(trace)], **kw)
    records = [
        Record(arrival=r["arrival_time_ms"], first=r["first_token_ms"], last=r["last_token_ms"])
        for r in result.per_request
    ]
    return records, result.summary


##### Figures #####


def figures(records: list[Record], osl: int, summary: dict[str, Any] | None = None) -> dict[str, float]:
    """The table's figures; per-gap ITLs from `summary` (Dynamo) when given, else from the records (dyn)."""
    ttft = np.array([r.first - r.arrival for r in records])
    per_request = np.array([(r.last - r.first) / (osl - 1) for r in records])
    if summary is not None:
        gap_p50, gap_p99 = summary["median_itl_ms"], summary["p99_itl_ms"]
    else:
        gaps = np.concatenate([r.gaps for r in records])
        gap_p50, gap_p99 = np.percentile(gaps, [50, 99])
    row = {"rps": len(records) / max(r.last for r in records) * 1000}
    row |= dict(zip(("ttft_p50", "ttft_p90"), np.percentile(ttft, [50, 90]), strict=True))
    row |= {"itl_gap_p50": gap_p50, "itl_req_p50": float(np.percentile(per_request, 50)), "itl_p99": gap_p99}
    return {key: float(value) for key, value in row.items()}


def decode_first_ttft(records: list[Record]) -> dict[str, float]:
    """dyn disagg: TTFT p50/p90 at the decode worker's first token (Dynamo's replay's definition)."""
    ttft = np.array([r.decode_first - r.arrival for r in records])
    return dict(zip(("ttft_p50", "ttft_p90"), (float(v) for v in np.percentile(ttft, [50, 90])), strict=True))


def run_cell(cell: Cell, args: argparse.Namespace, core: Any | None) -> dict[str, Any]:
    turns = max(1, args.requests // cell.concurrency)
    started = time.perf_counter()
    rules = dict(rule.split("=", 1) for rule in args.rule)
    records = DynReplay(cell, turns, args.turnaround_ms, rules).run()
    row: dict[str, Any] = {"cell": asdict(cell), "turns": turns, "dyn": figures(records, cell.osl)}
    if cell.setup == "disagg":
        row["dyn@decode"] = decode_first_ttft(records)
    row["dyn_cpu_s"] = time.perf_counter() - started
    if core is not None:
        theirs, summary = replay_dynamo(core, cell, turns, args.turnaround_ms)
        row["dynamo"] = figures(theirs, cell.osl, summary)
        row["ratio"] = {key: row["dyn"][key] / row["dynamo"][key] for key in METRICS}
        row["outside"] = [key for key in METRICS if abs(row["ratio"][key] - 1) > TOLERANCE]
    return row


def print_row(cell: Cell, row: dict[str, Any]) -> None:
    def line(label: str, values: dict[str, float], fmt: str) -> str:
        return f"{cell.name:28} {label:7} " + " ".join(format(values[key], fmt) for key in METRICS)

    print(line("dyn", row["dyn"], "9.2f"))
    if "dynamo" in row:
        print(line("Dynamo", row["dynamo"], "9.2f"))
        flags = "  ".join(f"{key} {row['ratio'][key]:.3f}" for key in row["outside"])
        print(line("ratio", row["ratio"], "9.3f") + (f"  OUTSIDE 10 %: {flags}" if flags else ""))
    if "dyn@decode" in row:
        at_decode = row["dyn@decode"]
        text = f"{'':28} dyn TTFT at the decode worker's first token: p50 {at_decode['ttft_p50']:.2f} p90"
        text += f" {at_decode['ttft_p90']:.2f}"
        if "dynamo" in row:
            ratios = [at_decode[key] / row["dynamo"][key] for key in ("ttft_p50", "ttft_p90")]
            text += f" (ratio {ratios[0]:.3f} / {ratios[1]:.3f})"
        print(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--concurrency", default="4,16")
    p.add_argument("--isl", default="3000,500")
    p.add_argument("--osl", type=int, default=150)
    p.add_argument("--starts", default=",".join(STARTS))
    p.add_argument("--requests", type=int, default=400, help="per cell: each client sends requests / C")
    p.add_argument("--turnaround-ms", type=float, default=20.0, help="a request's end -> its client's next")
    p.add_argument(
        "--rule", action="append", default=[], help="dyn's scheduler only, e.g. decode_kv_input=active_blocks"
    )
    p.add_argument("--dynamo-path", default="/tmp/dynsrc/rt", help="unpacked ai-dynamo-runtime 1.6.1 wheel")
    p.add_argument("--json", default=str(harness.results_path("mocker_fidelity")))
    args = p.parse_args()
    load_start = harness.loadavg()
    core = dynamo_core(args.dynamo_path)
    if core is None:
        print(f"Dynamo 1.6.1's core not found under {args.dynamo_path}: dyn only")
    cells = [
        Cell(setup, int(c), int(isl), args.osl, start)
        for setup in args.setups.split(",")
        for c in args.concurrency.split(",")
        for isl in args.isl.split(",")
        for start in args.starts.split(",")
    ]
    print(f"{'cell':28} {'':7} " + " ".join(f"{key:>9}" for key in METRICS))
    rows = []
    for cell in cells:
        rows.append(run_cell(cell, args, core))
        print_row(cell, rows[-1])
    if core is not None:
        outside = [f"{Cell(**row['cell']).name} ({', '.join(row['outside'])})" for row in rows if row["outside"]]
        print(f"{len(cells) - len(outside)} of {len(cells)} cells within 10 % on every figure; outside:")
        print("\n".join(f"  {text}" for text in outside) or "  none")
    out = {"args": vars(args), "has_dynamo": core is not None, "rows": rows}
    harness.write_results("mocker_fidelity", out, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
