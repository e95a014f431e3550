"""The Batch API's series on the frontend's `/metrics`, read from the store at each scrape (so every frontend
sharing a database shows the same figures, and a restart loses none)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_cli.batch.store import BatchStore


class BatchMetrics(Collector):
    """`dynamo_frontend_batch_lines{state}`, `dynamo_frontend_batch_tokens_total{kind}`, and the runner's lines in
    flight."""

    def __init__(self, store: BatchStore, inflight: Callable[[], int] | None = None) -> None:
        self.store = store
        self.inflight = inflight

    def collect(self) -> Iterator[Metric]:
        lines = GaugeMetricFamily(
            "dynamo_frontend_batch_lines", "Lines of every batch, by state (pending, done, failed)", labels=["state"]
        )
        for state, count in sorted(self.store.line_counts().items()):
            lines.add_metric([state], count)
        yield lines
        tokens = CounterMetricFamily(
            "dynamo_frontend_batch_tokens", "Tokens the batches' finished lines used", labels=["kind"]
        )
        for kind, count in sorted(self.store.token_totals().items()):
            tokens.add_metric([kind], count)
        yield tokens
        if self.inflight is not None:
            yield GaugeMetricFamily(
                "dynamo_frontend_batch_inflight",
                "Batch lines this frontend's runner has in flight",
                value=self.inflight(),
            )
