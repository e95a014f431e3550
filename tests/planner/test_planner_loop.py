"""The planner loop on hand-made frontend snapshots and a recording connector (no processes)."""

from __future__ import annotations

import logging

import pytest

from dynamo_cli.planner.connectors import ScaleTarget
from dynamo_cli.planner.observe import Snapshot, WorkerCount, WorkerRanks, observation_between, parse_metrics
from dynamo_cli.planner.planner import Planner, PlannerConfig
from dynamo_cli.planner.sizing import Bounds, RanksPerWorker, Targets
from tests.planner.test_sizing import PROFILE

METRICS = """\
# TYPE dynamo_frontend_inflight_requests gauge
dynamo_frontend_inflight_requests{model="a"} 3.0
dynamo_frontend_inflight_requests{model="b"} 2.0
# TYPE dynamo_frontend_input_sequence_tokens histogram
dynamo_frontend_input_sequence_tokens_bucket{le="+Inf",model="a"} 10.0
dynamo_frontend_input_sequence_tokens_count{model="a"} 10.0
dynamo_frontend_input_sequence_tokens_sum{model="a"} 20000.0
dynamo_frontend_input_sequence_tokens_count{model="b"} 5.0
dynamo_frontend_input_sequence_tokens_sum{model="b"} 5000.0
"""


def snap(at: float, requests: float, inflight: float = 0.0) -> Snapshot:
    """Cumulative counters as if every request had ISL 2000, OSL 200, TTFT 0.2 s, ITL 28.1 ms, 6 s long."""
    sums = {
        "request_duration_seconds": 6.0 * requests,
        "time_to_first_token_seconds": 0.2 * requests,
        "inter_token_latency_seconds": 0.0281 * requests * 199,
        "input_sequence_tokens": 2000.0 * requests,
        "output_sequence_tokens": 200.0 * requests,
    }
    counts = {
        "request_duration_seconds": requests,
        "time_to_first_token_seconds": requests,
        "inter_token_latency_seconds": requests * 199,
        "input_sequence_tokens": requests,
        "output_sequence_tokens": requests,
    }
    return Snapshot(at=at, sums={**sums, **{f"{k}:count": v for k, v in counts.items()}}, inflight=inflight)


class Source:
    def __init__(self, snapshots: list[Snapshot]) -> None:
        self.snapshots = snapshots

    async def snapshot(self) -> Snapshot:
        return self.snapshots.pop(0)


class Recorder:
    def __init__(self) -> None:
        self.targets: list[ScaleTarget] = []

    async def next_decision_id(self) -> int:
        return 7

    async def apply(self, target: ScaleTarget) -> bool:
        self.targets.append(target)
        return True

    async def close(self) -> None:
        return None


def test_metrics_text_sums_histograms_over_models_and_counts_inflight() -> None:
    sums, inflight = parse_metrics(METRICS)
    assert inflight == 5.0
    assert sums == {"input_sequence_tokens": 25000.0, "input_sequence_tokens:count": 15.0}


def test_an_interval_is_the_difference_of_two_snapshots() -> None:
    observed = observation_between(snap(100.0, 50), snap(160.0, 650))
    assert (observed.interval_s, observed.num_requests, observed.isl, observed.osl) == (60.0, 600, 2000, 200)
    assert observed.ttft_ms == pytest.approx(200.0) and observed.itl_ms == pytest.approx(28.1)
    # arrivals: 600 completed and in flight 5 → 25, so 620 arrived (an overloaded pool completes fewer)
    assert observation_between(snap(100.0, 50, inflight=5), snap(160.0, 650, inflight=25)).demand() == 620
    # a frontend restarted: its counters went back; read as no traffic, not negative traffic
    assert observation_between(snap(0.0, 650), snap(60.0, 10)).num_requests == 0


async def test_a_throughput_step_applies_the_worked_example() -> None:
    # 600 req/60 s of ISL 2000, OSL 200, TTFT as profiled (p_corr 1), ITL 28.1 ms at 4 decode workers (d_corr 1):
    # test_sizing' worked example, 3 prefill and 4 decode workers.
    recorder = Recorder()
    config = PlannerConfig(targets=Targets(1000.0, 30.0), bounds=Bounds(1, 100), mode="disagg", interval_s=60.0)

    async def counts() -> WorkerCount:
        return WorkerCount(1, 4)

    planner = Planner(config, PROFILE, Source([snap(0.0, 0), snap(60.0, 600)]), recorder, counts)
    await planner.baseline()
    step = await planner.plan_once()
    assert step.decision.corrections.prefill == pytest.approx(1.0)
    assert step.decision.corrections.decode == pytest.approx(1.0)
    assert recorder.targets == [ScaleTarget(decision_id=7, num_prefill=3, num_decode=4)]
    assert (step.current, step.applied, step.decision_id) == ((1, 4), True, 7)


@pytest.mark.parametrize(
    ("count", "override", "ranks", "expected"),
    [
        # the cards: prefill workers of 1 rank, decode workers of 4; one decode worker serves the example's 4 decode
        # ranks (d_corr 1): prefill ceil(2.25) = 3, decode ceil(3.488 / 4) = 1
        pytest.param(WorkerCount(1, 1, 1, 4), 0, RanksPerWorker(1, 4), (3, 1), id="from the cards"),
        # --ranks-per-worker 2 whatever the cards say; 2 decode workers of 2 are the example's 4 ranks:
        # prefill ceil(2.25 / 2) = 2, decode ceil(3.488 / 2) = 2
        pytest.param(WorkerCount(1, 2, 1, 4), 2, RanksPerWorker(2, 2), (2, 2), id="overridden"),
    ],
)
async def test_a_throughput_step_sizes_in_ranks_and_asks_for_workers_of_the_ranks_the_cards_say(
    count: WorkerCount, override: int, ranks: RanksPerWorker, expected: tuple[int, int]
) -> None:
    recorder = Recorder()
    config = PlannerConfig(
        targets=Targets(1000.0, 30.0), bounds=Bounds(1, 100), mode="disagg", interval_s=60.0, ranks_per_worker=override
    )

    async def counts() -> WorkerCount:
        return count

    planner = Planner(config, PROFILE, Source([snap(0.0, 0), snap(60.0, 600)]), recorder, counts)
    await planner.baseline()
    step = await planner.plan_once()
    assert step.decision.corrections.decode == pytest.approx(1.0)
    assert step.decision.ranks == ranks
    assert recorder.targets == [ScaleTarget(decision_id=7, num_prefill=expected[0], num_decode=expected[1])]
    assert f"decode {count.num_decode}→{expected[1]} (× {ranks.decode} ranks) [applied]" in str(step)


def test_the_ranks_the_cards_say_are_kept_for_an_empty_pool_and_a_disagreement_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ranks = WorkerRanks()
    assert ranks.now == RanksPerWorker(1, 1)  # nothing read yet
    mixed = WorkerCount(0, 4, 0, 4, mixed="decode: 3 of 4 ranks, 1 of 2 ranks")
    with caplog.at_level(logging.INFO, logger="dynamo_cli.planner"):
        assert ranks.read(mixed) == RanksPerWorker(1, 4)
        assert ranks.read(mixed) == RanksPerWorker(1, 4)
        assert ranks.read(WorkerCount()) == RanksPerWorker(1, 4)  # the pools emptied: what they had
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "workers' cards disagree on their ranks (decode: 3 of 4 ranks, 1 of 2 ranks): sizing for the most common "
        "(prefill 1, decode 4); set --ranks-per-worker to choose"
    ]
    assert WorkerRanks(fixed=2).read(mixed) == RanksPerWorker(2, 2)


async def test_a_burst_scales_up_between_throughput_steps_and_the_next_step_holds_it() -> None:
    # ISL 2000, OSL 200 as observed; an agg worker holds 1.2904 req/s at ITL 30 ms (test_sizing' example).
    recorder = Recorder()
    config = PlannerConfig(
        targets=Targets(1000.0, 30.0), bounds=Bounds(1, 20), mode="agg", headroom=1.0, startup_s=0.0
    )  # no trend projection: the windows alone

    async def counts() -> WorkerCount:
        return WorkerCount(0, 2)  # discovery: the burst's workers are still starting

    snapshots = [
        snap(0.0, 0),
        snap(60.0, 60),
        snap(62.0, 62),
        snap(64.0, 62, inflight=30),
        snap(66.0, 62, inflight=46),
        snap(90.0, 92),
    ]
    planner = Planner(config, PROFILE, Source(snapshots), recorder, counts)
    await planner.baseline()
    await planner.plan_once()  # 60 req in 60 s: 1 req/s → 0.775 → 1 worker
    # 2 arrived in 2 s: 2 − 2·√2 < 0, nothing is sure; 2 workers stay
    assert await planner.check_burst() is None
    # 30 arrived (0 completed, in flight 0 → 30): at least (30 − 2·√30) / 2 = 9.523 req/s → 7.38 → 8 > 2
    # workers; sized for (30 + 2·√30) / 2 = 20.477 req/s → 15.87 → 16
    step = await planner.check_burst()
    assert step is not None and step.kind == "burst" and ">= 9.52 req/s" in step.decision.why
    assert recorder.targets[-1] == ScaleTarget(decision_id=8, num_prefill=0, num_decode=16)
    # 16 more arrived: surely (16 − 2·4) / 2 = 4 req/s → 3.1 → 4 > the 2 workers in discovery, sized for (16 + 8) / 2
    # = 12 req/s → 10; but 16 were asked for and are still starting: no burst asks for fewer
    assert await planner.check_burst() is None and len(recorder.targets) == 2
    # the next throughput step: 48 arrived in 30 s → 1.6 req/s → 2 workers, but the last windows' 48 requests in
    # 6 s = 8 req/s → 6.2 → 7 workers: held at 7
    held = await planner.plan_once()
    assert held.decision.num_decode == 7 and "held at prefill 0, decode 7" in held.decision.why


@pytest.mark.parametrize(
    ("startup_s", "expected"),
    [pytest.param(2.0, 5, id="projected 4 s ahead"), pytest.param(0.0, None, id="no projection")],
)
async def test_a_rising_trend_scales_up_before_any_window_alone_is_sure(startup_s: float, expected: int | None) -> None:
    # 1, 2, 3 req/s in three 2 s windows (midpoints 61, 63, 65): slope 0.5 req/s², projected startup 2 + load 2 s
    # past 66 (t = 70): 2 + 0.5·7 = 5.5 req/s; pooled 2 req/s, variance 2/2·(1/3 + 7²/8) = 6.458 → σ 2.541;
    # surely 5.5 − 2.541 = 2.959 req/s → 2.29 → 3 workers > 2: sized for 5.5 req/s → 4.26 → 5. The last window
    # alone is surely only (6 − 2·√6) / 2 = 0.55 req/s. (One worker holds 1.2904 req/s: the ramp rises below 4×
    # half of that per 2 s startup, 1.29 req/s², so the projection is not capped.)
    recorder = Recorder()
    config = PlannerConfig(
        targets=Targets(1000.0, 30.0),
        bounds=Bounds(1, 20),
        mode="agg",
        headroom=1.0,
        load_interval_s=2.0,
        startup_s=startup_s,
    )

    async def counts() -> WorkerCount:
        return WorkerCount(0, 2)

    rising = [snap(62.0, 60, inflight=2), snap(64.0, 60, inflight=6), snap(66.0, 60, inflight=12)]
    snapshots = [snap(0.0, 0), snap(60.0, 60), *rising]
    planner = Planner(config, PROFILE, Source(snapshots), recorder, counts)
    await planner.baseline()
    await planner.plan_once()
    assert await planner.check_burst() is None and await planner.check_burst() is None
    step = await planner.check_burst()
    if expected is None:
        assert step is None
        return
    assert step is not None and "trend in 4 s 5.50 ± 2.54 req/s" in step.decision.why, step
    assert recorder.targets[-1].num_decode == expected


async def test_a_trend_steeper_than_any_startup_can_follow_is_projected_at_4x_the_followable_slope() -> None:
    # 2, 4, 6 req/s in three 2 s windows: slope 1 req/s², level 7 req/s at 66. A 10 s startup follows at most
    # half of one worker's 1.2904 req/s per 10 s, 0.06452 req/s²; 4× that over 12 s adds 3.097: the projection
    # is 10.10 req/s, not 4 + 1·15 = 19 (a line through a step is steep too). σ: 4/2·(1/3 + 15²/8) = 56.92 →
    # 7.545; surely 10.10 − 7.545 = 2.55 req/s → 1.98 → 2 workers: not more than 2. The last window alone:
    # (12 − 2·√12) / 2 = 2.54 req/s → 2 workers. So nothing starts; uncapped, surely 19 − 7.545 = 11.46 req/s
    # → 9 workers would have started 15 (sized for 19 req/s).
    recorder = Recorder()
    config = PlannerConfig(
        targets=Targets(1000.0, 30.0), bounds=Bounds(1, 40), mode="agg", headroom=1.0, startup_s=10.0
    )

    async def counts() -> WorkerCount:
        return WorkerCount(0, 2)

    rising = [snap(62.0, 60, inflight=4), snap(64.0, 60, inflight=12), snap(66.0, 60, inflight=24)]
    planner = Planner(config, PROFILE, Source([snap(0.0, 0), snap(60.0, 60), *rising]), recorder, counts)
    await planner.baseline()
    await planner.plan_once()
    for _ in rising:
        assert await planner.check_burst() is None
    assert all(target.num_decode <= 2 for target in recorder.targets)


async def test_the_startup_the_bursts_project_over_is_measured_from_the_first_scale_up_seen_through() -> None:
    recorder = Recorder()
    config = PlannerConfig(
        targets=Targets(1000.0, 30.0), bounds=Bounds(1, 20), mode="agg", headroom=1.0, startup_s=30.0
    )
    serving = [(0, 1)]

    async def counts() -> WorkerCount:
        return WorkerCount(*serving[-1])  # discovery: workers show once they serve

    snapshots = [
        snap(0.0, 0),
        snap(60.0, 60),
        snap(62.0, 62, inflight=30),
        snap(70.0, 70, inflight=30),
        snap(75.0, 75, inflight=30),
    ]
    planner = Planner(config, PROFILE, Source(snapshots), recorder, counts)
    await planner.baseline()
    await planner.plan_once()
    step = await planner.check_burst()  # 32 arrived in 2 s: a burst at t = 62
    assert step is not None and step.kind == "burst"
    wanted = recorder.targets[-1].num_decode
    serving.append((0, wanted - 1))  # at 70 the last one still starts: nothing measured yet
    await planner.check_burst()
    assert planner.startup_s == 30.0
    serving.append((0, wanted))  # at 75 it serves: 13 s after the scale-up
    await planner.check_burst()
    assert planner.startup_s == 13.0
