"""A simulated worker in virtual time: its data-parallel ranks, each the mocker's scheduler reduced to its events.

NOTE: a rank's pass prefills up to 8192 prompt tokens while every running request decodes one token, and lasts what
the mocker's timing model (dynamo_cli/timing.py) gives that pass at the rank's KV usage; stretches of pure decode are
jumped over to the next finish, so the cost is a few events per request, not one per pass. A worker of R ranks is R
such schedulers, each with a KV cache of its own (as the mocker's `data_parallel_size`), its requests dealt to them
in turn (a round-robin router over (worker, rank) targets), so R ranks serve R times one rank's load.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from dynamo_cli.timing import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, TimingModel


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a trace."""

    arrival_s: float
    """Arrival time from the start of the trace."""
    isl: int
    """Prompt tokens."""
    osl: int
    """Output tokens."""


@dataclass(slots=True)
class _Running:
    finish_pass: int
    request: SimRequest
    first_token_s: float


@dataclass(slots=True)
class SimRank:
    """One rank's scheduler state in virtual time: the mocker's scheduler reduced to its events (module NOTE)."""

    kv_tokens: int
    started_s: float
    role: str = "both"
    """both (agg) | prefill (a prompt's first token ends its stay: `handoffs`) | decode (only decode steps)."""
    now: float = 0.0
    passes: int = 0
    stopped_s: float | None = None
    waiting: deque[list[object]] = field(default_factory=deque)
    running: list[tuple[int, int, _Running]] = field(default_factory=list)
    active_kv: int = 0
    handoffs: list[tuple[float, SimRequest]] = field(default_factory=list)
    """prefill: (first token time, request) of each prompt done, for a decode worker."""
    timing: TimingModel = field(default_factory=TimingModel)
    """The mocker's pass times (its default: no speedup)."""
    _seq: int = 0

    def __post_init__(self) -> None:
        self.now = self.started_s

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def advance(self, until: float, stats: Stats) -> None:
        """Run passes until `until` (or until idle)."""
        while self.now < until and self.busy():
            if self.waiting and len(self.running) < DEFAULT_MAX_NUM_SEQS:
                self._prefill_pass(stats)
            elif self.running:
                self._decode_until(until, stats)
            else:
                break
        if until != math.inf:
            self.now = max(self.now, until)

    def pass_ms(self, num_prefill_tokens: int, num_decoding: int) -> float:
        """Duration of a pass computing `num_prefill_tokens` prompt tokens while `num_decoding` running
        requests emit a token, at the rank's KV usage: the mocker scheduler's pass time for that pass."""
        return self.timing.pass_ms(num_prefill_tokens, num_decoding, self.active_kv / self.kv_tokens)

    def _prefill_pass(self, stats: Stats) -> None:
        # The prompts that complete in this pass emit their first token at its end but add no decode term:
        # only the requests running before it do (the mocker counts both: tests/planner/test_timing_shared.py).
        budget, admitted = DEFAULT_MAX_NUM_BATCHED_TOKENS, list[object]()
        while self.waiting and budget > 0 and len(self.running) + len(admitted) < DEFAULT_MAX_NUM_SEQS:
            entry = self.waiting[0]
            left = int(entry[1])  # type: ignore[call-overload]
            take = min(left, budget)
            budget -= take
            entry[1] = left - take
            if left - take == 0:
                admitted.append(self.waiting.popleft()[0])
        self.now += self.pass_ms(DEFAULT_MAX_NUM_BATCHED_TOKENS - budget, len(self.running)) / 1000
        self.passes += 1
        for request in admitted:
            assert isinstance(request, SimRequest)
            if self.role == "prefill":
                self.handoffs.append((self.now, request))
            else:
                self.join(request, self.now, stats, finish=False)
        self._finish(stats)

    def join(self, request: SimRequest, first_token_s: float, stats: Stats, finish: bool = True) -> None:
        """Start decoding `request`, whose first token came at `first_token_s` (decode role: from a prefill
        worker; this rank must have been advanced to that time)."""
        self._seq += 1
        run = _Running(self.passes + request.osl - 1, request, first_token_s)
        heapq.heappush(self.running, (run.finish_pass, self._seq, run))
        self.active_kv += request.isl + request.osl // 2
        if finish:
            self._finish(stats)

    def _decode_until(self, until: float, stats: Stats) -> None:
        step = self.pass_ms(0, len(self.running)) / 1000
        to_finish = self.running[0][0] - self.passes
        fits = to_finish if until == math.inf else max(1, math.ceil((until - self.now) / step))
        n = max(1, min(to_finish, fits))
        self.now += n * step
        self.passes += n
        self._finish(stats)

    def _finish(self, stats: Stats) -> None:
        while self.running and self.running[0][0] <= self.passes:
            _, _, run = heapq.heappop(self.running)
            self.active_kv -= run.request.isl + run.request.osl // 2
            stats.record(run.request, run.first_token_s, self.now)


@dataclass(slots=True)
class Stats:
    """Cumulative frontend-like counters and SLO attainment of finished requests."""

    ttft_ms: float
    itl_ms: float
    sums: dict[str, float] = field(default_factory=dict)
    arrived: int = 0
    finished: int = 0
    met: int = 0

    def record(self, request: SimRequest, first_token_s: float, end_s: float) -> None:
        ttft = first_token_s - request.arrival_s
        itl = (end_s - first_token_s) / (request.osl - 1) if request.osl > 1 else 0.0
        self.finished += 1
        self.met += ttft * 1000 <= self.ttft_ms and itl * 1000 <= self.itl_ms
        decoded = request.osl - 1
        for name, value, count in (
            ("time_to_first_token_seconds", ttft, 1),
            ("input_sequence_tokens", request.isl, 1),
            ("output_sequence_tokens", request.osl, 1),
            ("request_duration_seconds", end_s - request.arrival_s, 1),
            ("inter_token_latency_seconds", itl * decoded, decoded),
        ):
            self.sums[name] = self.sums.get(name, 0.0) + value
            self.sums[f"{name}:count"] = self.sums.get(f"{name}:count", 0.0) + count


@dataclass(slots=True)
class SimWorker:
    """One worker of `len(ranks)` data-parallel ranks: requests go to its ranks in turn."""

    ranks: list[SimRank]
    """Its ranks' schedulers, each with a KV cache of its own."""
    started_s: float
    """When it serves."""
    _turn: int = 0

    @classmethod
    def of(
        cls,
        num_ranks: int,
        kv_tokens: int,
        started_s: float,
        role: str = "both",
        handoffs: list[tuple[float, SimRequest]] | None = None,
    ) -> SimWorker:
        """A worker of `num_ranks` ranks of `kv_tokens` KV tokens each (`handoffs`: a prefill pool's, shared)."""
        shared = handoffs if handoffs is not None else []
        return cls([SimRank(kv_tokens, started_s, role=role, handoffs=shared) for _ in range(num_ranks)], started_s)

    @property
    def now(self) -> float:
        """The latest time any of its ranks was advanced to."""
        return max(rank.now for rank in self.ranks)

    def busy(self) -> bool:
        return any(rank.busy() for rank in self.ranks)

    def advance(self, until: float, stats: Stats) -> None:
        """Run every rank's passes until `until` (or until idle)."""
        for rank in self.ranks:
            rank.advance(until, stats)

    def serve_from(self, now: float) -> None:
        """Its ranks are up: their clocks start at `now` at the earliest."""
        for rank in self.ranks:
            rank.now = max(rank.now, now)

    def next_rank(self, now: float, stats: Stats) -> SimRank:
        """The rank the next request goes to (in turn), advanced to `now`."""
        rank = self.ranks[self._turn % len(self.ranks)]
        self._turn += 1
        rank.advance(now, stats)
        return rank

    def num_running(self) -> int:
        return sum(len(rank.running) for rank in self.ranks)

    def num_waiting(self) -> int:
        return sum(len(rank.waiting) for rank in self.ranks)
