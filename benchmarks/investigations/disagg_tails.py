"""Where the disaggregated ITL tail comes from (issue 35, item 2): the mocker workload of benchmarks/disagg.py part 1
(ISL 3,000, OSL 150, closed loop at concurrency 16, `--speedup-ratio 1`) on `agg` (2 workers), `disagg` (1P+1D,
default policy) and `always` (1P+1D, `--disagg-policy always`), and the same with the mocker's rules before
issue 35 (`always-old`, `agg-old`), alternating by round, with every worker's system server on so its engine
counters are read around each run.

For each run it prints dyn bench's figures and, to say where a slow request lost its time:

- per worker (the engine's counters over the run): passes, decode-only passes, prompt tokens computed (a decode
  worker computing any is prefilling locally: a ~66 ms stall for every stream on it), first tokens, and the live
  path's lateness per pass: (wall − modeled seconds of the passes) / passes;
- from the per-request chunk times (dyn bench --jsonl): every gap longer than `--slow-gap` ms, and how many of the
  streams open at that moment were inside a long gap too. A gap most streams share is the worker pausing every
  stream at once (a prefill pass on the decode worker, its event loop late); a gap few share is one stream's own
  path (the frontend's or the load generator's event loop, the request plane).

    python benchmarks/investigations/disagg_tails.py [--repeats 2] [--seconds 40] [--ramp-up 0]
        [--json benchmarks/out/disagg_tails.json]

The load average is recorded at the start and the end: timings are only valid on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import bisect
import socket
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (the one path insert: harness.py)
import disagg  # noqa: E402  (the deployments and dyn bench runs of benchmarks/disagg.py)
import harness  # noqa: E402

COUNTERS = (
    "forward_passes",
    "decode_only_passes",
    "prefill_tokens",
    "first_tokens",
    "pass_seconds",
    "pass_wall_seconds",
    "preemptions",
)


CAUGHT_UP_MS = 2.0
"""A gap this short after a long one: the two tokens arrived together."""
NEAR_S = 0.015
"""A long gap that begins this soon after the load generator sent a request is counted as following it."""
OLD_RULES = [
    *("--engine-arg", "prefilled_admission=prompt"),
    *("--engine-arg", "decode_kv_input=active_blocks"),
    *("--engine-arg", "kv_transfer_bandwidth=64"),
]
"""The mocker's scheduling before issue 35: a transferred prompt charged to the token budget, decode time from the
blocks referenced, a 64 GB/s simulated KV transfer."""


def free_base(span: int) -> int:
    """A port P with P .. P+span-1 free now (the system ports `dyn serve --system-port P` gives its workers)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + span < 65535 and all(_is_free(base + i) for i in range(span)):
            return base


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def counters(port: int) -> dict[str, float]:
    """The engine counters of the worker whose system server is on `port`."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("dynamo_component_engine_").removesuffix("_total")
            if sample.name.startswith("dynamo_component_engine_") and name in COUNTERS:
                found[name] = sample.value
    return found


def worker_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    passes = d["forward_passes"] or float("nan")
    d["late_ms_per_pass"] = (d["pass_wall_seconds"] - d["pass_seconds"]) / passes * 1e3
    d["modeled_ms_per_pass"] = d["pass_seconds"] / passes * 1e3
    return d


def long_gaps(rows: list[dict[str, Any]], slow_ms: float) -> dict[str, float]:
    """The long chunk gaps of a run, and how many of the streams open at each one's middle were in one too."""
    streams = []  # (start_s, end_s, [(gap_start_s, gap_end_s)])
    caught_up = 0
    for row in rows:
        if not row["ok"] or len(row["chunk_ms"]) < 3:
            continue
        times = [row["start_s"] + t / 1e3 for t in row["chunk_ms"]]
        gaps = [(a, b) for a, b in zip(times[1:], times[2:], strict=False) if (b - a) * 1e3 > slow_ms]
        caught_up += sum(  # a long gap then a near-zero one: two passes' tokens delivered together, not a stall
            1
            for a, b, c in zip(times[1:], times[2:], times[3:], strict=False)
            if (b - a) * 1e3 > slow_ms and (c - b) * 1e3 < CAUGHT_UP_MS
        )
        streams.append((times[1], times[-1], gaps))  # decode phase: after the first token
    starts = sorted(row["start_s"] for row in rows)
    firsts = sorted(row["start_s"] + row["chunk_ms"][0] / 1e3 for row in rows if row["chunk_ms"])
    near, near_first, num_gaps = 0, 0, 0
    for _, _, gaps in streams:  # gaps that begin within NEAR_S after a request was sent / got its first token
        for a, _ in gaps:
            num_gaps += 1
            near += _follows(a, starts)
            near_first += _follows(a, firsts)
    span = (max(r["end_s"] for r in rows) - min(starts)) if rows else 0.0
    chance = min(1.0, len(starts) * NEAR_S / span) if span else 0.0  # that share of the run lies so near one
    shares = []
    for _, _, gaps in streams:
        for a, b in gaps:
            middle = (a + b) / 2
            open_ = [s for s in streams if s[0] <= middle <= s[1]]
            within = sum(1 for s in open_ if any(ga <= middle <= gb for ga, gb in s[2]))
            shares.append(within / len(open_))
    num = len(shares)
    return {
        "long_gaps": num,
        "shared_most": sum(1 for s in shares if s >= 0.5) / num if num else 0.0,
        "shared_median": statistics.median(shares) if shares else 0.0,
        "then_caught_up": caught_up / num_gaps if num_gaps else 0.0,
        "after_a_send": near / num_gaps if num_gaps else 0.0,
        "after_a_first_token": near_first / num_gaps if num_gaps else 0.0,
        "after_a_send_by_chance": chance,
    }


def _follows(moment: float, times: list[float]) -> bool:
    """Whether `moment` lies within NEAR_S after one of the sorted `times`."""
    i = bisect.bisect_right(times, moment)
    return i > 0 and moment - times[i - 1] <= NEAR_S


def run_side(side: disagg.Side, base: int, workers: int, tmp: Path, tag: str, load: list[str], slow: float) -> dict:
    before = [counters(base + i) for i in range(workers)]
    result = disagg.bench_routed(side, tmp, tag, load)
    after = [counters(base + i) for i in range(workers)]
    result["workers"] = [worker_delta(b, a) for b, a in zip(before, after, strict=True)]
    result["gaps"] = long_gaps(result["rows"], slow)
    del result["rows"]
    return result


def show(label: str, result: dict[str, Any], roles: list[str]) -> None:
    disagg.show(label, result)
    g = result["gaps"]
    print(
        f"    gaps > slow: {g['long_gaps']:.0f}, then a gap < {CAUGHT_UP_MS:g} ms (caught up): "
        f"{g['then_caught_up']:.0%}, shared by most open streams: {g['shared_most']:.0%}, begin within "
        f"{NEAR_S * 1e3:.0f} ms after a request was sent: {g['after_a_send']:.0%} (by chance: "
        f"{g['after_a_send_by_chance']:.0%}), after a first token (the handoff to the decode worker): "
        f"{g['after_a_first_token']:.0%}",
        flush=True,
    )
    for role, w in zip(roles, result["workers"], strict=True):
        print(
            f"    {role}: passes {w['forward_passes']:.0f} (decode-only {w['decode_only_passes']:.0f}), prompt tokens "
            f"{w['prefill_tokens']:.0f}, modeled {w['modeled_ms_per_pass']:.2f} ms/pass, late "
            f"{w['late_ms_per_pass']:.2f} ms/pass, preemptions {w['preemptions']:.0f}",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--ramp-up", type=float, default=0.0, help="dyn bench --ramp-up (s)")
    p.add_argument("--slow-gap", type=float, default=12.0, help="a chunk gap longer than this is long (ms)")
    p.add_argument("--sides", default="agg,disagg,always")
    p.add_argument("--json", default=str(harness.results_path("disagg_tails")))
    args = p.parse_args()
    args.speedup_ratio, args.router = 1.0, "kv"
    load_start = harness.loadavg()
    layouts = {  # side -> (dyn serve flags, worker roles in --system-port order: decode workers, then prefill)
        "agg": (disagg.mocker_flags(args, None), ["worker 0", "worker 1"]),
        "disagg": (disagg.mocker_flags(args, "adaptive"), ["decode", "prefill"]),
        "always": (disagg.mocker_flags(args, "always"), ["decode", "prefill"]),
        # the mocker's rules before issue 35 (docs/mocker.md): what the earlier figures were measured with
        "always-old": ([*disagg.mocker_flags(args, "always"), *OLD_RULES], ["decode", "prefill"]),
        "agg-old": ([*disagg.mocker_flags(args, None), *OLD_RULES], ["worker 0", "worker 1"]),
    }
    names = args.sides.split(",")
    bases = {name: free_base(3) for name in names}
    sides = [disagg.Side(n, [*layouts[n][0], "--system-port", str(bases[n])]) for n in names]
    load = ["--isl", "3000", "--osl", "150", "--concurrency", "16", "--duration", str(args.seconds)]
    load += ["--warmup", str(args.warmup), "--ramp-up", str(args.ramp_up)]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp, disagg.deployed(sides, Path(tmp)):
        for rnd in range(args.repeats):
            for side in sides:
                roles = layouts[side.name][1]
                result = run_side(
                    side, bases[side.name], len(roles), Path(tmp), f"r{rnd}", [*load, "--seed", str(rnd)], args.slow_gap
                )
                runs[side.name].append(result)
                show(f"round {rnd} {side.name}", result, roles)
    harness.write_results("disagg_tails", {"args": vars(args), "runs": runs}, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
