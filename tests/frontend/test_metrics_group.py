"""The merged /metrics of `dyn serve --frontends N` (frontend/metrics_group.py), on real registries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynamo_cli.frontend.metrics import FrontendMetrics
from dynamo_cli.frontend.metrics_group import MergedFamilies, MetricsGroup, merge, snapshot


def frontend(requests: int, inflight: int, worker_blocks: int, own_streams: int) -> FrontendMetrics:
    metrics = FrontendMetrics(gc=False)
    for _ in range(requests):
        metrics.requests.labels("m", "chat_completions", "stream", "success").inc()
        metrics.duration.labels("m").observe(0.2)
    metrics.inflight.labels("m").set(inflight)
    metrics.worker_gauges["active_decode_blocks"].labels("m", "a1", "0", "both").set(worker_blocks)
    metrics.worker_gauges["inflight_requests"].labels("m", "a1", "0", "both").set(own_streams)
    return metrics


def values(text: bytes | str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = text.decode() if isinstance(text, bytes) else text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return found[(name, tuple(sorted(labels.items())))]


REQUEST = {"model": "m", "endpoint": "chat_completions", "request_type": "stream", "status": "success"}
WORKER = {"model": "m", "worker_id": "a1", "dp_rank": "0", "worker_type": "both"}


def test_counters_histograms_and_own_gauges_add_up_and_worker_copies_show_once() -> None:
    a, b = frontend(3, 2, 40, 2), frontend(5, 1, 42, 1)
    merged = values(_text(a, b, True))
    assert sample(merged, "dynamo_frontend_requests_total", **REQUEST) == 8
    assert sample(merged, "dynamo_frontend_request_duration_seconds_count", model="m") == 8
    assert sample(merged, "dynamo_frontend_request_duration_seconds_bucket", model="m", le="+Inf") == 8
    assert sample(merged, "dynamo_frontend_inflight_requests", model="m") == 3
    assert sample(merged, "dynamo_frontend_worker_inflight_requests", **WORKER) == 3  # each frontend's own
    assert sample(merged, "dynamo_frontend_worker_active_decode_blocks", **WORKER) == 42  # a copy: the largest
    created = sample(merged, "dynamo_frontend_requests_created", **REQUEST)
    assert created == min(
        sample(values(_own(a)), "dynamo_frontend_requests_created", **REQUEST),
        sample(values(_own(b)), "dynamo_frontend_requests_created", **REQUEST),
    )


def test_a_dead_frontend_keeps_its_counters_and_loses_its_gauges() -> None:
    a, b = frontend(3, 2, 40, 2), frontend(5, 1, 42, 1)
    merged = values(_text(a, b, False))
    assert sample(merged, "dynamo_frontend_requests_total", **REQUEST) == 8
    assert sample(merged, "dynamo_frontend_inflight_requests", model="m") == 2
    assert sample(merged, "dynamo_frontend_worker_inflight_requests", **WORKER) == 2


def test_the_group_directory_merges_live_and_dead_snapshots(tmp_path: Path) -> None:
    live, dead = FrontendMetrics(gc=False), frontend(4, 3, 7, 3)
    Gauge("extra_gauge", "x", registry=live.registry).set(1)
    live.requests.labels(*REQUEST.values()).inc()
    live.inflight.labels("m").set(1)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)  # exited and reaped: no such process now
    dead_group = MetricsGroup(tmp_path, dead.registry)
    dead_group._own = tmp_path / f"{dead_pid}.json"  # as that process would have written it
    dead_group.write(lambda: None)
    (tmp_path / "junk.json").write_text("not a snapshot")
    (tmp_path / "12345678.json").write_text("[[")  # a torn or foreign file is skipped, not fatal
    refreshed = []
    group = MetricsGroup(tmp_path, live.registry)
    group.write(lambda: refreshed.append(1))
    assert (tmp_path / f"{os.getpid()}.json").exists() and refreshed == [1]
    merged = values(group.merged(lambda: refreshed.append(2)))
    assert refreshed == [1, 2]
    assert sample(merged, "dynamo_frontend_requests_total", **REQUEST) == 5
    assert sample(merged, "dynamo_frontend_inflight_requests", model="m") == 1  # the dead one's 3 are gone
    assert sample(merged, "extra_gauge") == 1


def test_families_only_one_frontend_has_are_kept_as_they_are() -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    Counter("only_a", "x", registry=a).inc(2)
    Histogram("only_b", "x", registry=b, buckets=(1.0,)).observe(0.5)
    merged = values(_text_of(a, b, True))
    assert sample(merged, "only_a_total") == 2
    assert sample(merged, "only_b_bucket", le="1.0") == 1


def _own(metrics: FrontendMetrics) -> str:
    return _text_of(metrics.registry, None, True)


def _text(a: FrontendMetrics, b: FrontendMetrics, b_alive: bool) -> str:
    return _text_of(a.registry, b.registry, b_alive)


def _text_of(a: CollectorRegistry, b: CollectorRegistry | None, b_alive: bool) -> str:
    others = [] if b is None else [(snapshot(b), b_alive)]
    return generate_latest(MergedFamilies(merge(snapshot(a), others))).decode()
