"""The oracle of `dyn plan simulate`: the load it reads ahead, the pools it sizes, when it starts and releases."""

from __future__ import annotations

import pytest

from dynamo_cli.planner.oracle import OracleStep, oracle_needs, oracle_schedule, trace_rates
from dynamo_cli.planner.planner import PlannerConfig
from dynamo_cli.planner.simulate import curve_rates
from dynamo_cli.planner.sizing import Bounds, Targets
from tests.planner.test_simulate import MOCKER


def test_a_traces_load_is_its_arrivals_centred_on_each_time() -> None:
    # arrivals at 0.5, 1.5, …, 9.5 s with ISL 100·i: at t = 5 over 4 s, [3, 7) holds 3.5, 4.5, 5.5, 6.5
    rate_at = trace_rates([(i + 0.5, 100 * i, 10) for i in range(10)], 4.0)
    assert rate_at(5.0) == (1.0, 450.0, 10.0)
    assert rate_at(0.0) == (0.5, 50.0, 10.0)  # [−2, 2): 0.5 and 1.5
    assert rate_at(20.0) == (0.0, 0.0, 0.0)


def test_a_curves_load_is_its_own_rate() -> None:
    steps, ramp = curve_rates("0:5,10:40,20:0", 2000, 150), curve_rates("0:5,10:40,20:0", 2000, 150, linear=True)
    assert [steps(t)[0] for t in (0.0, 9.9, 10.0, 25.0)] == [5.0, 5.0, 40.0, 0.0]
    assert [ramp(t)[0] for t in (0.0, 5.0, 10.0, 15.0)] == [5.0, 22.5, 40.0, 20.0]
    assert steps(3.0)[1:] == (2000, 150)


def test_the_oracle_starts_each_worker_a_startup_before_the_rate_needs_it_and_releases_it_after() -> None:
    # one worker, three from t = 10 to 14, one again from 16: with a 4 s startup the oracle holds 3 from 6
    # (10 is within reach) to 14, and 1 from 16 (no point in [16, 20] needs more)
    needs = [(float(t), 0, 3 if 10 <= t <= 14 else 1) for t in range(0, 22, 2)]
    steps = oracle_schedule(needs, 4.0)
    assert [step.at for step in steps] == [float(t) for t in range(0, 22, 2)]
    changes = [step for i, step in enumerate(steps) if i == 0 or step.num_decode != steps[i - 1].num_decode]
    assert changes == [OracleStep(0.0, 0, 1), OracleStep(6.0, 0, 3), OracleStep(16.0, 0, 1)]


@pytest.mark.parametrize(
    ("mode", "during"), [pytest.param("agg", (0, 6), id="agg"), pytest.param("disagg", (3, 2), id="disagg")]
)
def test_the_oracle_sizes_each_point_as_the_planner_sizes_its_rate(mode: str, during: tuple[int, int]) -> None:
    # one mocker worker holds 7.90 req/s of 2000+150 tokens at TTFT 500 ms, ITL 40 ms × 0.8: 40 req/s → 5.07 → 6;
    # disagg: prefill 80,000 tok/s over 36,824 tok/s × ρ 0.94 → 2.30 → 3, decode 6,000 tok/s over 3,715 → 2
    config = PlannerConfig(targets=Targets(500.0, 40.0), bounds=Bounds(1, 32), mode=mode)
    needs = oracle_needs(curve_rates("0:5,20:40,40:5,60:0", 2000, 150), 58.0, MOCKER, config)
    assert [t for t, _, _ in needs] == [float(t) for t in range(0, 60, 2)]
    assert {(p, d) for t, p, d in needs if 20 <= t < 40} == {during}
    assert {(p, d) for t, p, d in needs if t < 20 or t >= 40} == {(0 if mode == "agg" else 1, 1)}
