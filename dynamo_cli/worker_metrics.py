"""A worker's own series on its system server: its engine's load and KV cache as Dynamo names them
(`dynamo_component_kvstats_*`), its scheduler's queue, its KV transfers held, and its KV tiers (`kvbm_*`).

Read at scrape time from the engine's `load_metrics()` (what the worker also publishes for routers), so serving
costs nothing more; the request plane's own counts are `runtime/system.py`'s `ComponentMetrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_cli.kv.tier_stats import KVBM_SERIES
from dynamo_cli.wire import LoadMetrics

LOAD_GAUGES = {
    "kvstats_active_blocks": ("active_blocks", "KV cache blocks in use"),
    "kvstats_total_blocks": ("total_blocks", "KV cache blocks the engine has"),
    "running_requests": ("num_running", "Requests the engine is running"),
    "waiting_requests": ("num_waiting", "Requests waiting in the engine's scheduler"),
    "active_prefill_tokens": ("active_prefill_tokens", "Prompt tokens being prefilled"),
    "kv_transfer_held": ("kv_transfer_held", "Prefill role: exported KV payloads not yet pulled"),
    "kv_transfer_held_bytes": (
        "kv_transfer_held_bytes",
        "Prefill role: bytes of the exported KV payloads not yet pulled",
    ),
}
"""`dynamo_component_{name}` gauge -> (LoadMetrics field, help)."""
LOAD_COUNTERS = {
    "prefill_tokens_computed": ("num_prefill_tokens_computed", "Prompt tokens computed (prefix-cache misses)"),
    "prefill_tokens_cached": ("num_prefill_tokens_cached", "Prompt tokens served from the prefix cache"),
    "lora_loads": ("lora_loads", "LoRA adapter loads (at start, at run time, again after an eviction)"),
}
"""`dynamo_component_{name}_total` counter -> (LoadMetrics field, help)."""


class WorkerMetrics(Collector):
    """The worker's engine series, labelled dynamo_namespace, dynamo_component, model."""

    def __init__(
        self,
        load: Callable[[], LoadMetrics],
        namespace: str,
        component: str,
        model: str,
        counters: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        self.load = load
        """The engine's load now (with the worker's KV transfer holdings)."""
        self.labels = [namespace, component, model]
        self.counters = counters
        """The engine's own work counters (`CountsWork`), if it keeps any."""

    def collect(self) -> Iterator[Metric]:
        load, labels, names = self.load(), self.labels, ["dynamo_namespace", "dynamo_component", "model"]
        for name, (field, text) in LOAD_GAUGES.items():
            yield _gauge(f"dynamo_component_{name}", text, names, labels, getattr(load, field))
        yield _gauge(
            "dynamo_component_lora_adapters_loaded", "LoRA adapters loaded now", names, labels, len(load.loras)
        )
        usage = load.active_blocks / load.total_blocks if load.total_blocks else 0.0
        yield _gauge("dynamo_component_kvstats_gpu_cache_usage_percent", "KV cache used (0..1)", names, labels, usage)
        seen = load.num_prefill_tokens_cached + load.num_prefill_tokens_computed
        hit_rate = load.num_prefill_tokens_cached / seen if seen else 0.0
        text = "Prompt tokens served from the prefix cache, of all prompt tokens (0..1, since start)"
        yield _gauge("dynamo_component_kvstats_gpu_prefix_cache_hit_rate", text, names, labels, hit_rate)
        for name, (field, text) in LOAD_COUNTERS.items():
            counter = CounterMetricFamily(f"dynamo_component_{name}", text, labels=names)
            counter.add_metric(labels, getattr(load, field))
            yield counter
        for name, value in (self.counters() if self.counters is not None else {}).items():
            counter = CounterMetricFamily(f"dynamo_component_engine_{name}", f"The engine's {name}", labels=names)
            counter.add_metric(labels, value)
            yield counter
        if load.kv_tiers is not None:
            worker = f"{load.worker_id:x}"
            for name, field in KVBM_SERIES.items():
                text = f"KV tiers: {field} (cumulative unless a holding or rate)"
                yield _gauge(name, text, ["model", "worker"], [labels[2], worker], getattr(load.kv_tiers, field))


def _gauge(name: str, text: str, names: list[str], labels: list[str], value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, text, labels=names)
    gauge.add_metric(labels, value)
    return gauge
