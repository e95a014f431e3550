"""The frontend's CPU per request, kv against round-robin, split by part, in one process.

Issue 15: in the default-cache closed-loop cell of benchmarks/kv_routing_matrix.py the kv router takes
round-robin's decisions step for step, yet its frontend burns ~0.6-0.8 ms more CPU per request. This
replays that cell in virtual time (benchmarks/kv_routing_sim.py: the real `KvRoutingPolicy` over 4 real
mocker schedulers and their KV events) and times, with `time.process_time`, what a `dyn serve` frontend
runs per request on the way:

    route      building the `RouteRequest` (prompt + output ids) and `policy.select` (hashing, indexer,
               active overlaps, cost, load bookkeeping, the explanation)
    explain    the `x-dyn-route` header when the client asked (`--explain`, as kv_routing_matrix.py does)
    kv_ingest  decoding each KV event batch off the wire (msgpack) and `policy.apply_kv_events`
    load       decoding each worker's load report and `policy.apply_load` (both modes subscribe)
    first      `policy.on_first_token`;  finish  `policy.on_finish`

Per-chunk work other than these (decoding a chunk, the SSE text) is the same in both modes and left out.
`--profile` prints the kv run's cProfile (by own time). The `digest` column hashes every decision, so two
versions of the code can be shown to decide the same.

    # default cache, closed loop, 20 s, explain on, 3 runs:
    python benchmarks/investigations/frontend_cost.py
    python benchmarks/investigations/frontend_cost.py --no-explain --profile
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (the one path insert: harness.py)
import harness  # noqa: E402
import kv_routing_sim as sim  # noqa: E402

from dynamo_cli.frontend.headers import _hexid_headers  # noqa: E402
from dynamo_cli.kv.events import KvEventBatch  # noqa: E402
from dynamo_cli.routing.base import RouteDecision, RouteRequest  # noqa: E402
from dynamo_cli.routing.target import Target  # noqa: E402
from dynamo_cli.wire import LoadMetrics  # noqa: E402

PARTS = ("route", "explain", "kv_ingest", "load", "first", "finish")
_encode = msgspec.msgpack.Encoder().encode
_decode_batch = msgspec.msgpack.Decoder(KvEventBatch).decode
_decode_load = msgspec.msgpack.Decoder(LoadMetrics).decode


class Meter:
    """CPU seconds and calls per part."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.digest = hashlib.sha256()
        self.trace: list[tuple[float, str, Any]] = []
        """(virtual time, policy hook, its argument): the kv run's calls, replayed under cProfile."""

    def timed(self, part: str, fn: Callable[[], Any]) -> Any:
        clock = time.process_time
        start = clock()
        result = fn()
        self.cpu[part] += clock() - start
        self.calls[part] += 1
        return result


class TimedPolicy:
    """The policy as the frontend drives it: each hook timed, the wire decoding included."""

    def __init__(self, replay: sim.Replay, meter: Meter, explain: bool, subscribed: bool) -> None:
        self.policy, self.meter, self.explain, self.subscribed = replay.policy, meter, explain, subscribed
        self.replay = replay

    def _record(self, hook: str, argument: Any) -> None:
        self.meter.trace.append((self.replay.now, hook, argument))

    def select(self, request: RouteRequest, targets: Sequence[Target]) -> RouteDecision:
        def route() -> RouteDecision:  # core/dispatch.py `_choose`: the prompt plus what was generated so far
            return self.policy.select(RouteRequest(request.request_id, list(request.token_ids) + []), targets)

        self._record("select", (request.request_id, list(request.token_ids), list(targets)))
        decision: RouteDecision = self.meter.timed("route", route)
        if self.explain and decision.explanation:
            self.meter.timed("explain", lambda: msgspec.json.encode(_hexid_headers(decision.explanation)))
        rank = f"/{decision.target.rank}" if decision.target.rank else ""  # rank 0: the digest of before ranks
        self.meter.digest.update(f"{request.request_id}:{decision.worker_id}{rank};".encode())
        return decision

    def apply_kv_events(self, batch: KvEventBatch) -> None:
        if not self.subscribed:
            return  # a round-robin frontend does not subscribe to KV events
        payload = _encode(batch)  # the worker's side, not timed
        self._record("kv", payload)
        self.meter.timed("kv_ingest", lambda: self.policy.apply_kv_events(_decode_batch(payload)))

    def apply_load(self, metrics: LoadMetrics) -> None:
        payload = _encode(metrics)
        self._record("load", payload)
        self.meter.timed("load", lambda: self.policy.apply_load(_decode_load(payload)))

    def on_first_token(self, request_id: str) -> None:
        self._record("first", request_id)
        self.meter.timed("first", lambda: self.policy.on_first_token(request_id))

    def on_finish(self, request_id: str) -> None:
        self._record("finish", request_id)
        self.meter.timed("finish", lambda: self.policy.on_finish(request_id))


def measure(args: argparse.Namespace, mode: str) -> tuple[dict[str, Any], Meter]:
    """One replay of `mode`; CPU per request by part."""
    replay = sim.Replay(args, args.cache, mode, args.seed, sim.delays_of(args))
    is_kv = mode != "round-robin"
    meter = Meter()
    timed = replay.policy = TimedPolicy(replay, meter, args.explain and is_kv, is_kv)
    replay.handlers["kv"] = timed.apply_kv_events
    replay.run("closed", 0.0)
    requests = meter.calls["route"]
    per_request = {part: meter.cpu[part] / requests * 1e6 for part in PARTS}
    return {
        "mode": mode,
        "requests": requests,
        "calls": {part: meter.calls[part] for part in PARTS},
        "us_per_request": {**per_request, "total": sum(per_request.values())},
        "digest": meter.digest.hexdigest()[:16],
    }, meter


def profile_trace(args: argparse.Namespace, mode: str, trace: list[tuple[float, str, Any]]) -> None:
    """Replay a run's policy calls on a fresh policy under cProfile; print the frontend's own functions."""
    now = [0.0]
    policy = sim.make_policy(mode, args.block_size, args.seed, lambda: now[0])
    calls: dict[str, Callable[[Any], Any]] = {
        "select": lambda a: policy.select(RouteRequest(a[0], a[1]), a[2]),
        "kv": lambda a: policy.apply_kv_events(_decode_batch(a)),
        "load": lambda a: policy.apply_load(_decode_load(a)),
        "first": policy.on_first_token,
        "finish": policy.on_finish,
    }
    if args.explain:
        select = calls["select"]
        calls["select"] = lambda a: msgspec.json.encode(_hexid_headers(select(a).explanation))
    profile = cProfile.Profile()
    profile.enable()
    for at, hook, argument in trace:
        now[0] = at
        calls[hook](argument)
    profile.disable()
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats("dynamo_cli", 30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default="default", choices=sorted(sim.CACHES))
    p.add_argument("--modes", default="kv,round-robin")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--seconds", type=float, default=20.0, help="virtual seconds replayed")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode; each part's lowest CPU is shown")
    p.add_argument("--no-explain", dest="explain", action="store_false", help="no x-dyn-explain-route")
    p.add_argument("--profile", action="store_true", help="print the kv run's cProfile (own time)")
    p.add_argument("--json", default=str(harness.results_path("frontend_cost")))
    args = p.parse_args()
    defaults = {
        "workers": 4,
        "clients_per_worker": 8,
        "warmup": 0.0,
        "prefix_tokens": 2000,
        "suffix_tokens": 100,
        "max_tokens": 50,
        "block_size": 64,
        "trace": 0,
    }
    for name, value in defaults.items():
        setattr(args, name, value)
    rows = []
    load_start = harness.loadavg()
    print(f"load average {load_start[0]:.2f}; cache {args.cache}, closed loop, explain {args.explain}")
    print(f"{'mode':14} {'req':>6} " + " ".join(f"{part:>9}" for part in (*PARTS, "total")) + "  digest")
    for mode in args.modes.split(","):
        runs = [measure(args, mode) for _ in range(args.repeats)]
        row, meter = runs[0]
        us = row["us_per_request"]
        for part in PARTS:  # the least disturbed run of each part (the machine may be shared)
            us[part] = min(r["us_per_request"][part] for r, _ in runs)
        us["total"] = sum(us[part] for part in PARTS)
        rows.append(row)
        us = row["us_per_request"]
        print(
            f"{mode:14} {row['requests']:6d} "
            + " ".join(f"{us[k]:9.1f}" for k in (*PARTS, "total"))
            + f"  {row['digest']}"
        )
        if args.profile and mode != "round-robin":
            profile_trace(args, mode, meter.trace)
    harness.write_results("frontend_cost", {"args": vars(args), "rows": rows}, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
