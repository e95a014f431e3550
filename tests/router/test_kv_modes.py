"""`dyn router`'s per-worker KV routing mode on its `/metrics` (`dynamo_component_router_worker_kv_events`)."""

from __future__ import annotations

from dynamo_cli.core.metrics import RouterMetrics

NAME = "dynamo_component_router_worker_kv_events"


def mode(metrics: RouterMetrics, model: str, worker_id: str) -> float | None:
    return metrics.registry.get_sample_value(NAME, {"model": model, "worker_id": worker_id})


def test_each_worker_shows_precise_or_approximate_and_a_worker_gone_loses_its_series() -> None:
    metrics = RouterMetrics()
    metrics.export_kv_modes("m", [0xA1, 0xB2], frozenset({0xA1}))
    metrics.export_kv_modes("n", [0xC3], None)  # a round-robin model
    assert (mode(metrics, "m", "a1"), mode(metrics, "m", "b2"), mode(metrics, "n", "c3")) == (1, 0, -1)
    metrics.export_kv_modes("m", [0xB2], frozenset({0xB2}))  # a1 left; b2's events arrived
    assert (mode(metrics, "m", "a1"), mode(metrics, "m", "b2"), mode(metrics, "n", "c3")) == (None, 1, -1)
