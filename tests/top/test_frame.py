"""Two snapshots into `dyn top`'s rows: rates over the interval, and latency quantiles of the observations
made in it, interpolated inside buckets as Prometheus's histogram_quantile does."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from dynamo_cli.engine import Role
from dynamo_cli.top.frame import frame_between, histogram_quantile, rate
from dynamo_cli.top.snapshot import Buckets, read_series
from dynamo_cli.wire import LoadMetrics
from tests.top.exposition import Frontend

# 10 observations ≤ 0.1, 20 in (0.1, 0.2], 10 in (0.2, 0.4], none above.
KNOWN = Buckets((0.1, 0.2, 0.4, math.inf), (10, 30, 40, 40))


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        pytest.param(0.5, KNOWN, 0.1 + 0.1 * (20 - 10) / 20, id="median-inside-the-second-bucket"),
        pytest.param(0.99, KNOWN, 0.2 + 0.2 * (39.6 - 30) / 10, id="p99-inside-the-third-bucket"),
        pytest.param(0.25, KNOWN, 0.1, id="first-bucket-starts-at-zero"),
        pytest.param(0.1, KNOWN, 0.1 * 4 / 10, id="inside-the-first-bucket"),
        pytest.param(0.9, Buckets((0.1, 0.2, 0.4, math.inf), (10, 10, 10, 20)), 0.4, id="rank-in-inf-bucket"),
        pytest.param(0.5, Buckets((-1.0, 0.0, math.inf), (3, 4, 4)), -1.0, id="non-positive-first-bound"),
    ],
)
def test_quantiles_of_known_histograms_match_prometheus(q: float, buckets: Buckets, expected: float) -> None:
    assert histogram_quantile(q, buckets) == pytest.approx(expected)


def test_a_histogram_without_observations_has_no_quantile() -> None:
    assert histogram_quantile(0.5, Buckets((0.1, math.inf), (0, 0))) is None
    assert histogram_quantile(0.5, Buckets()) is None


def test_interpolation_recovers_the_quantiles_of_a_uniform_distribution() -> None:
    registry = CollectorRegistry()
    bounds = [i / 10 for i in range(1, 11)]
    histogram = Histogram("x", "x", buckets=bounds, registry=registry)
    for i in range(1000):
        histogram.observe((i + 0.5) / 1000)  # uniform on (0, 1)
    samples = read_series(generate_latest(registry).decode())["x_bucket"]
    buckets = Buckets(tuple(float(s[0]["le"]) for s in samples), tuple(s[1] for s in samples))
    for q in (0.05, 0.5, 0.9, 0.99):
        assert histogram_quantile(q, buckets) == pytest.approx(q, abs=1e-3)


async def test_rates_and_quantiles_cover_only_the_interval_between_the_snapshots() -> None:
    frontend = Frontend()
    frontend.add_worker(0xA1, Role.BOTH, LoadMetrics(num_running=2, active_blocks=30, total_blocks=120))
    frontend.add_worker(0xB2, Role.BOTH)
    frontend.serve(0xA1, ttft=0.004, itl=0.002, num_requests=100)  # before the interval: fast
    before = frontend.snapshot(at=10.0)
    frontend.serve(0xA1, ttft=0.7, itl=0.02, num_requests=6)  # in it: slow
    frontend.serve(0xB2, ttft=0.7, itl=0.02, num_requests=2)
    frame = frame_between(before, frontend.snapshot(at=12.0))
    (model,) = frame.models
    assert frame.interval_s == 2.0
    assert model.requests_per_s == pytest.approx(8 / 2)
    assert not model.ttft.is_since_start
    assert model.ttft.p50 == pytest.approx(0.5 + 0.5 * 0.5)  # all 8 in (0.5, 1]: the median halfway
    assert model.itl.p99 == pytest.approx(0.01 + 0.015 * 0.99)  # all 8 in (0.01, 0.025]
    a1, b2 = model.workers
    assert (a1.worker_id, a1.requests_per_s, a1.num_requests, a1.kv_usage) == ("a1", 3.0, 106, 0.25)
    assert (b2.worker_id, b2.requests_per_s, b2.num_requests, b2.kv_usage) == ("b2", 1.0, 2, None)


async def test_an_idle_interval_shows_the_whole_history_flagged_and_no_rate() -> None:
    frontend = Frontend()
    frontend.add_worker(0xA1, Role.BOTH)
    frontend.serve(0xA1, ttft=0.004, itl=0.002, num_requests=10)
    before = frontend.snapshot(at=0.0)
    (model,) = frame_between(before, frontend.snapshot(at=1.0)).models
    assert model.ttft.is_since_start and model.requests_per_s == 0
    assert model.ttft.p50 == pytest.approx(0.0025 + 0.0025 * 0.5)


async def test_the_first_reading_has_no_interval_and_reads_the_cumulative_histograms() -> None:
    frontend = Frontend()
    frontend.add_worker(0xA1, Role.BOTH)
    frontend.serve(0xA1, ttft=0.2, itl=0.002, num_requests=4)
    frame = frame_between(None, frontend.snapshot(at=5.0))
    (model,) = frame.models
    assert frame.interval_s == 0 and model.requests_per_s == 0 and model.workers[0].requests_per_s == 0
    assert model.ttft.is_since_start and model.ttft.p50 == pytest.approx(0.1 + 0.15 * 0.5)


async def test_kv_transfer_rate_is_bytes_pulled_per_second_of_pulling_in_the_interval() -> None:
    frontend = Frontend()
    frontend.transfer(nbytes=10**9, seconds=10.0)  # before: slow
    before = frontend.snapshot(at=0.0)
    frontend.transfer(nbytes=6 * 10**9, seconds=1.0)
    frontend.transfer(nbytes=2 * 10**9, seconds=1.0)
    (model,) = frame_between(before, frontend.snapshot(at=3.0)).models
    assert model.transfer_gbps == pytest.approx(4.0)
    assert not model.is_transfer_since_start
    (idle,) = frame_between(frontend.snapshot(at=3.0), frontend.snapshot(at=4.0)).models
    assert idle.is_transfer_since_start and idle.transfer_gbps == pytest.approx(9 / 12)  # 9 GB in 12 s of pulls
    (never,) = frame_between(None, Frontend().snapshot(at=0.0)).models
    assert never.transfer_gbps is None and not never.is_transfer_since_start


@pytest.mark.parametrize(
    ("now", "before", "seconds", "expected"),
    [
        pytest.param(30.0, 10.0, 4.0, 5.0, id="increase-per-second"),
        pytest.param(3.0, 10.0, 1.0, 3.0, id="reset-counts-from-zero"),
        pytest.param(30.0, None, 4.0, 0.0, id="no-earlier-reading"),
    ],
)
def test_counter_rates(now: float, before: float | None, seconds: float, expected: float) -> None:
    assert rate(now, before, seconds) == expected
