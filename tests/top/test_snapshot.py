"""A frontend's /metrics text read into `dyn top`'s snapshot: per model, per worker; absent series are 0."""

from __future__ import annotations

import math

import pytest

from dynamo_cli.engine import Role
from dynamo_cli.top.snapshot import Buckets, parse_snapshot
from dynamo_cli.wire import LoadMetrics
from tests.top.exposition import MODEL, Frontend


async def test_workers_are_read_with_their_role_load_and_requests_served() -> None:
    frontend = Frontend()
    frontend.add_worker(
        0xA1, Role.DECODE, LoadMetrics(num_running=3, num_waiting=1, active_blocks=25, total_blocks=100)
    )
    frontend.add_worker(0xB2, Role.PREFILL, num_inflight=2)
    frontend.serve(0xA1, ttft=0.02, itl=0.003, num_requests=5)
    frontend.serve(0xB2, ttft=0.02, itl=0.003, num_requests=2)
    snapshot = frontend.snapshot(at=7.0)
    decode, prefill = snapshot.workers[(MODEL, "a1")], snapshot.workers[(MODEL, "b2")]
    assert (decode.role, decode.num_running, decode.num_waiting) == ("decode", 3, 1)
    assert (decode.active_blocks, decode.total_blocks, decode.num_requests) == (25, 100, 5)
    assert (prefill.role, prefill.num_inflight, prefill.num_requests, prefill.total_blocks) == ("prefill", 2, 2, 0)
    model = snapshot.models[MODEL]
    assert (snapshot.at, model.num_requests) == (7.0, 7)
    assert model.ttft.total == 7 and model.ttft.bounds[-1] == math.inf
    assert model.ttft.counts[model.ttft.bounds.index(0.025)] == 7  # 0.02 s: in the (0.01, 0.025] bucket
    assert model.ttft.counts[model.ttft.bounds.index(0.01)] == 0


async def test_disaggregation_transfers_migrations_and_queue_are_read_by_model() -> None:
    frontend = Frontend()
    frontend.metrics.count_disagg(MODEL, "remote")
    frontend.metrics.count_disagg(MODEL, "remote")
    frontend.metrics.count_disagg(MODEL, "local")
    frontend.metrics.count_migration(MODEL, "ongoing_request")
    frontend.metrics.queued.labels(MODEL).set(4)
    frontend.transfer(nbytes=3_000_000, seconds=0.002)
    model = frontend.snapshot(at=0.0).models[MODEL]
    assert model.disagg == {"remote": 2, "local": 1}
    assert (model.num_migrations, model.num_queued) == (1, 4)
    assert (model.transfer_bytes, model.transfer_seconds) == (3_000_000, pytest.approx(0.002))


async def test_series_a_frontend_does_not_export_read_as_zero_and_stalls_are_summed_when_it_does() -> None:
    frontend = Frontend()
    text = frontend.text()
    assert "dynamo_frontend_worker_stalls_total{" not in text  # no stall yet: no sample, read as 0
    assert parse_snapshot(text, 0.0).num_stalls == 0
    frontend.metrics.count_stall(MODEL, 0xA1, "deadline")
    frontend.metrics.count_stall(MODEL, 0xA1, "canary")
    frontend.metrics.count_stall(MODEL, 0xB2, "deadline")
    assert parse_snapshot(frontend.text(), 0.0).num_stalls == 3
    without = "\n".join(line for line in text.splitlines() if "worker_stalls" not in line) + "\n"
    assert parse_snapshot(without, 0.0).num_stalls == 0  # an older frontend without the series


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("<html><body>502 Bad Gateway</body></html>", id="html"),
        pytest.param('{"object": "list", "data": []}', id="json"),
        pytest.param("# TYPE up gauge\nup 1\n", id="prometheus-but-not-a-dyn-frontend"),
        pytest.param("", id="empty"),
    ],
)
def test_text_that_is_not_a_dyn_frontends_metrics_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_snapshot(text, 0.0)


def test_observations_since_an_earlier_histogram_are_the_bucket_differences() -> None:
    before = Buckets((0.1, 1.0, math.inf), (2, 5, 6))
    now = Buckets((0.1, 1.0, math.inf), (2, 9, 12))
    assert now.minus(before) == Buckets((0.1, 1.0, math.inf), (0, 4, 6))
    assert before.minus(now) == before  # fewer now than then: the frontend restarted, its counts are all new
