"""The planner loop on hand-made frontend snapshots and a recording connector (no processes)."""

from __future__ import annotations

import pytest

from dynamo_cli.planner.connectors import ScaleTarget
from dynamo_cli.planner.observe import Snapshot, observation_between, parse_metrics
from dynamo_cli.planner.planner import Planner, PlannerConfig
from dynamo_cli.planner.replicas import Bounds, Targets
from tests.planner.test_replicas import PROFILE

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
    sums = {"request_duration_seconds": 6.0 * requests, "time_to_first_token_seconds": 0.2 * requests,
            "inter_token_latency_seconds": 0.0281 * requests * 199, "input_sequence_tokens": 2000.0 * requests,
            "output_sequence_tokens": 200.0 * requests}  # fmt: skip
    counts = {"request_duration_seconds": requests, "time_to_first_token_seconds": requests,
              "inter_token_latency_seconds": requests * 199, "input_sequence_tokens": requests,
              "output_sequence_tokens": requests}  # fmt: skip
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
    # a frontend restarted: its counters went back; read as no traffic, not negative traffic
    assert observation_between(snap(0.0, 650), snap(60.0, 10)).num_requests == 0


async def test_a_throughput_step_applies_the_worked_example() -> None:
    # 600 req/60 s of ISL 2000, OSL 200, TTFT as profiled (p_corr 1), ITL 28.1 ms at 4 decode workers (d_corr 1):
    # test_replicas' worked example, 3 prefill and 4 decode workers.
    recorder = Recorder()
    config = PlannerConfig(targets=Targets(1000.0, 30.0), bounds=Bounds(1, 100), interval_s=60.0)

    async def counts() -> tuple[int, int]:
        return (1, 4)

    planner = Planner(config, PROFILE, Source([snap(0.0, 0), snap(60.0, 600)]), recorder, counts)
    await planner.baseline()
    step = await planner.plan_once()
    assert step.decision.corrections.prefill == pytest.approx(1.0)
    assert step.decision.corrections.decode == pytest.approx(1.0)
    assert recorder.targets == [ScaleTarget(decision_id=7, num_prefill=3, num_decode=4)]
    assert (step.current, step.applied, step.decision_id) == ((1, 4), True, 7)


async def test_a_burst_scales_up_between_throughput_steps_and_never_down() -> None:
    # Before any traffic the forecast is ISL 3000, OSL 150: context 3075, clamped to the profile's 3000 row,
    # ITL 20 + 40u <= 30 → u = 0.25, 0.25 × 100000 / 3075 = 8.13 requests per worker at the ITL target.
    recorder = Recorder()
    config = PlannerConfig(targets=Targets(1000.0, 30.0), bounds=Bounds(1, 10), mode="agg")

    async def counts() -> tuple[int, int]:
        return (0, 2)

    planner = Planner(config, PROFILE, Source([snap(0.0, 0, inflight=16), snap(1.0, 0, inflight=40)]), recorder,
                      counts)  # fmt: skip
    assert await planner.check_burst() is None  # 16 in flight fit 2 × 8.13
    step = await planner.check_burst()  # 40 do not: ceil(40 / 8.13) = 5
    assert step is not None and step.kind == "burst" and "40 in flight" in step.decision.why
    assert recorder.targets == [ScaleTarget(decision_id=7, num_prefill=0, num_decode=5)]
