"""The workers' per-step load as the planner sees it: LoadMetrics from real mocker workers over the embedded event
plane, summed per pool; a stale worker left out; queue growth past the arrivals' noise scales up at once."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from dynamo_cli.config import CLUSTER_SECRET_ENV, PlanesConfig
from dynamo_cli.planner.observe import PoolLoad, WorkerCount, WorkerLoads, follow_worker_loads
from dynamo_cli.planner.planner import Planner, PlannerConfig
from dynamo_cli.planner.sizing import Bounds, Targets
from dynamo_cli.runtime.planes import open_planes
from dynamo_cli.wire import LoadMetrics
from tests.conftest import DynProcess
from tests.planner.test_planner_loop import Recorder, Source, snap
from tests.planner.test_sizing import PROFILE


async def test_the_planner_hears_every_workers_load_over_the_embedded_event_plane(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    secret = os.urandom(32).hex()
    deployment: DynProcess = dyn_serve(
        "--engine", "mocker", "--workers", "2", "--num-gpu-blocks", "1000", env={CLUSTER_SECRET_ENV: secret}
    )
    loads = WorkerLoads()
    planes = PlanesConfig(discovery=deployment.discovery, cluster_secret=bytes.fromhex(secret))
    async with open_planes(planes) as (_, bus):
        follower = asyncio.get_running_loop().create_task(follow_worker_loads(bus, "dynamo", loads))
        try:
            async with asyncio.timeout(20):
                while loads.total().num_workers < 2:  # each worker publishes at least every 0.5 s
                    await asyncio.sleep(0.1)
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
    total = loads.total()
    assert (total.num_workers, total.total_blocks, total.num_waiting, total.num_running) == (2, 2000, 0, 0)


def test_a_worker_not_heard_from_lately_is_left_out() -> None:
    now = [0.0]
    loads = WorkerLoads(stale_s=5.0, clock=lambda: now[0])
    loads.apply(LoadMetrics(worker_id=1, num_waiting=3, num_running=2, active_blocks=10, total_blocks=100))
    now[0] = 4.0
    loads.apply(LoadMetrics(worker_id=2, num_waiting=1, total_blocks=100))
    assert loads.total() == PoolLoad(num_workers=2, num_running=2, num_waiting=4, active_blocks=10, total_blocks=200)
    now[0] = 5.5  # worker 1: 5.5 s ago
    assert loads.total() == PoolLoad(num_workers=1, num_waiting=1, total_blocks=100)


@pytest.mark.parametrize(
    ("waiting", "expected"),
    [
        pytest.param(6, 6, id="queues grew past the noise"),
        pytest.param(5, None, id="within the noise"),
        pytest.param(None, None, id="no load signal"),
    ],
)
async def test_queue_growth_past_the_arrivals_noise_scales_up_when_the_count_alone_would_not(
    waiting: int | None, expected: int | None
) -> None:
    # an agg worker holds 1.2904 req/s at ITL 30 ms (test_sizing' example). In 2 s, 2 completed and in flight
    # went 0 → W: the window alone is surely (2 + W − 2·√(2 + W)) / 2 <= 1.17 req/s → 1 worker, not more than 2.
    # Queues grew by 6 > 2·√8 = 5.66: surely (2 + 6) / 2 = 4 req/s → 3.1 → 4 > 2 workers; sized for 4 + 6 / (0 + 2)
    # = 7 req/s (the backlog drained within a load interval) → 5.42 → 6. Growth 5 <= 2·√7 = 5.29 is noise.
    recorder = Recorder()
    config = PlannerConfig(targets=Targets(1000.0, 30.0), bounds=Bounds(1, 20), mode="agg", headroom=1.0, startup_s=0.0)

    async def counts() -> WorkerCount:
        return WorkerCount(0, 2)

    queue = PoolLoad(num_workers=2, num_waiting=waiting or 0)
    snapshots = [snap(0.0, 0), snap(60.0, 60), snap(62.0, 62, inflight=waiting or 6)]
    planner = Planner(
        config, PROFILE, Source(snapshots), recorder, counts, loads=None if waiting is None else (lambda: queue)
    )
    await planner.baseline()
    await planner.plan_once()
    step = await planner.check_burst()
    if expected is None:
        assert step is None
        return
    assert step is not None, "no burst"
    assert "queues grew by 6 to 6 at 2 workers: >= 4.00 req/s, + 3.00 to drain" in step.decision.why
    assert recorder.targets[-1].num_decode == expected
