"""The Batch API's series on the frontend's `/metrics`, read from the store (so every frontend sharing a
database shows the same figures, and a restart loses none): every REFRESH_S by a task of the frontend's, in a
thread, never at the scrape, since /metrics answers on the event loop and a database query (a PostgreSQL server
on another host, a large SQLite file) must not stall it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_cli.batch.store import BatchStore, LineState

logger = logging.getLogger(__name__)

REFRESH_S = 2.0


class BatchMetrics(Collector):
    """`dynamo_frontend_batch_lines{state}`, `dynamo_frontend_batch_tokens_total{kind}`, and the runner's lines in
    flight."""

    def __init__(self, store: BatchStore, inflight: Callable[[], int] | None = None) -> None:
        self.store = store
        self.inflight = inflight
        self._lines: dict[str, int] = {state.value: 0 for state in LineState}
        self._tokens: dict[str, int] = {"prompt": 0, "completion": 0}

    async def refresh(self) -> None:
        """Until cancelled (the frontend's task group): read the figures every REFRESH_S; a failed read keeps
        the last ones (and says why in the log)."""
        while True:
            try:
                self._lines, self._tokens = await asyncio.to_thread(self.store.figures)
            except Exception as exc:  # noqa: BLE001  (the database out of reach: the next round tries again)
                logger.warning("batch metrics not refreshed: %s", exc)
            await asyncio.sleep(REFRESH_S)

    def collect(self) -> Iterator[Metric]:
        lines = GaugeMetricFamily(
            "dynamo_frontend_batch_lines", "Lines of every batch, by state (pending, done, failed)", labels=["state"]
        )
        for state, count in sorted(self._lines.items()):
            lines.add_metric([state], count)
        yield lines
        tokens = CounterMetricFamily(
            "dynamo_frontend_batch_tokens", "Tokens the batches' finished lines used", labels=["kind"]
        )
        for kind, count in sorted(self._tokens.items()):
            tokens.add_metric([kind], count)
        yield tokens
        if self.inflight is not None:
            yield GaugeMetricFamily(
                "dynamo_frontend_batch_inflight",
                "Batch lines this frontend's runner has in flight",
                value=self.inflight(),
            )
