"""The frontend's per-worker series: load, in-flight streams and requests served, by worker and role; a
worker that left has none."""

from __future__ import annotations

from prometheus_client import generate_latest

from dynamo_cli.core.registry import Worker
from dynamo_cli.engine import Role
from dynamo_cli.frontend.metrics import FrontendMetrics
from dynamo_cli.model_card import ModelCard
from dynamo_cli.runtime.endpoint import InstanceRecord
from dynamo_cli.runtime.request_client import RequestClient
from dynamo_cli.wire import LoadMetrics


def worker(instance_id: int, role: Role, load: LoadMetrics | None, num_inflight: int = 0) -> Worker:
    """A registry entry as the frontend keeps it (its client never dials: nothing is sent)."""
    record = InstanceRecord(
        namespace="ns", component="backend", endpoint="generate", instance_id=instance_id, transport={"tcp": "x:1"}
    )
    card = ModelCard(display_name="m", tokenizer_source="-", engine="mocker", role=role.value)
    return Worker(instance_id, record, card, RequestClient("127.0.0.1:1"), num_inflight=num_inflight, load=load)


def value(metrics: FrontendMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(f"dynamo_frontend_worker_{name}", labels)


async def test_each_worker_is_exported_with_its_load_role_and_in_flight_streams() -> None:
    metrics = FrontendMetrics()
    load = LoadMetrics(num_running=3, num_waiting=2, active_blocks=40, total_blocks=100, active_prefill_tokens=512)
    metrics.export_workers(
        [
            ("m", worker(0xA1, Role.DECODE, load, num_inflight=4), frozenset({0xA1})),
            ("m", worker(0xB2, Role.PREFILL, None), frozenset({0xA1})),
        ]
    )
    decode = {"model": "m", "worker_id": "a1", "dp_rank": "0", "worker_type": "decode"}
    assert value(metrics, "active_decode_blocks", **decode) == 40
    assert value(metrics, "total_blocks", **decode) == 100
    assert value(metrics, "active_prefill_tokens", **decode) == 512
    assert value(metrics, "running_requests", **decode) == 3
    assert value(metrics, "waiting_requests", **decode) == 2
    assert value(metrics, "inflight_requests", **decode) == 4
    assert value(metrics, "kv_events", **decode) == 1  # its KV events reach the router
    prefill = {"model": "m", "worker_id": "b2", "dp_rank": "0", "worker_type": "prefill"}
    assert value(metrics, "total_blocks", **prefill) == 0  # no load report yet: zeros, but listed
    assert value(metrics, "kv_events", **prefill) == 0  # routed approximately


async def test_a_router_blind_to_caches_shows_minus_one_for_kv_events() -> None:
    metrics = FrontendMetrics()
    metrics.export_workers([("m", worker(0xA1, Role.BOTH, None), None)])
    assert value(metrics, "kv_events", model="m", worker_id="a1", dp_rank="0", worker_type="both") == -1


async def test_requests_served_count_per_worker_and_role() -> None:
    metrics = FrontendMetrics()
    for _ in range(3):
        metrics.count_served("m", 0xA1, "decode")
    metrics.count_served("m", 0xB2, "prefill")
    assert value(metrics, "requests_total", model="m", worker_id="a1", worker_type="decode") == 3
    assert value(metrics, "requests_total", model="m", worker_id="b2", worker_type="prefill") == 1


async def test_a_worker_that_left_loses_its_series_and_the_others_keep_theirs() -> None:
    metrics = FrontendMetrics()
    staying, leaving = worker(0xA1, Role.BOTH, LoadMetrics(total_blocks=8)), worker(0xC3, Role.BOTH, None)
    metrics.count_served("m", 0xA1, "both")
    metrics.count_served("m", 0xC3, "both")
    metrics.export_workers([("m", staying, None), ("m", leaving, None)])
    assert b'worker_id="c3"' in generate_latest(metrics.registry)
    metrics.export_workers([("m", staying, None)])
    text = generate_latest(metrics.registry).decode()
    assert 'worker_id="c3"' not in text
    assert value(metrics, "total_blocks", model="m", worker_id="a1", dp_rank="0", worker_type="both") == 8
    assert value(metrics, "requests_total", model="m", worker_id="a1", worker_type="both") == 1
