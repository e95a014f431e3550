"""Hung workers: found by a deadline on open streams and by canary requests, taken out of routing, let back in
when they answer.

NOTE: a worker that is alive, registered and producing nothing (its process stopped, its host frozen, cut off
from this one) keeps its lease for a while and its connection for longer; requests sent to it would wait. Two
signals find it, as Dynamo's canary does and more:
    deadline  a stream that waits `stall_timeout_s` for its next chunk, from a worker that sent nothing here
              for as long (no chunk on any stream, no load report: it reports every half second), takes the
              worker out of routing; that stream, and each other one on it when its own wait runs out,
              migrates (core/stalls.py). A slow worker still reports its load: not hung.
    canary    a one-token generation (`health_check_request`) sent to a hung worker every PROBE_INTERVAL_S
              until one ends within `check_timeout_s`: then it is routed to again. With canaries on, a worker
              idle for `canary_wait_s` is probed too, and one that does not answer is taken out.
A hung worker counts as busy (`Worker.busy_reason`): requests go elsewhere, or wait in the queue if none is left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from dynamo_cli.config import HealthChecks
from dynamo_cli.core import prefill
from dynamo_cli.core.holds import Hold
from dynamo_cli.core.registry import ModelEntry, Registry, Worker
from dynamo_cli.core.request_plan import HealthMetrics
from dynamo_cli.core.stalls import mark_hung
from dynamo_cli.errors import RemoteError, TransportError
from dynamo_cli.runtime.request_client import ResponseStream
from dynamo_cli.wire import GENERATE, health_check_request

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5
"""How often the monitor looks for workers to probe."""


class HealthMonitor:
    """Probes the registry's hung workers (and, with canaries on, its idle ones); `run()` is its one loop."""

    def __init__(self, registry: Registry[Any], config: HealthChecks, metrics: HealthMetrics) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self._probing: set[int] = set()

    async def run(self) -> None:
        """NOTE: every PROBE_INTERVAL_S, a canary to each hung worker and each worker idle past `canary_wait_s`
        (with canaries on), at most one in flight per worker; the probes are this loop's tasks."""
        async with asyncio.TaskGroup() as probes:
            while True:
                await asyncio.sleep(PROBE_INTERVAL_S)
                for entry, worker in self._due(time.monotonic()):
                    self._probing.add(worker.instance_id)
                    probes.create_task(self._probe(entry, worker))

    def _due(self, now: float) -> list[tuple[ModelEntry, Worker]]:
        due, config = [], self.config
        for entry in list(self.registry.models.values()):
            for worker in (*entry.workers.values(), *entry.prefill_workers.values()):
                if worker.instance_id in self._probing:
                    continue
                idle = (
                    config.is_canary_enabled
                    and not worker.num_inflight
                    and now - worker.used_at >= config.canary_wait_s
                )
                if worker.hung is not None or idle:
                    due.append((entry, worker))
        return due

    async def _probe(self, entry: ModelEntry, worker: Worker) -> None:
        hold = Hold(worker, "canary")  # a canary is traffic too: its release starts the idle wait again
        try:
            problem = await self._canary(worker)
        finally:
            hold.release()
            self._probing.discard(worker.instance_id)
        if problem is None and worker.hung is not None:
            logger.warning("worker %x (model %s) answered a canary: routed to again", worker.instance_id, entry.name)
            worker.hung = None
            worker.heard_at = time.monotonic()
            self.metrics.count_recovery(entry.name, worker.instance_id)
            entry.queue.notify()
        elif problem is not None and worker.hung is None:
            mark_hung(worker, entry.name, problem, "canary", self.metrics)

    async def _canary(self, worker: Worker) -> str | None:
        """None if a one-token generation on `worker` ended in time, else why not. A refusal (4xx) is an answer."""
        request = health_check_request(worker.card.health_check_token)
        stream: ResponseStream | None = None
        try:
            async with asyncio.timeout(self.config.check_timeout_s):
                stream = await worker.client.open(GENERATE, request, name=worker.record.endpoint)
                while batch := await stream.next_batch():
                    for raw in batch:
                        handle = GENERATE.decode_reply(raw).kv_transfer
                        if handle is not None:  # a prefill worker holds its KV for a decode: free it
                            await prefill.release(worker, handle)
        except TimeoutError:
            return f"a canary got no answer within {self.config.check_timeout_s:.0f} s"
        except RemoteError as exc:
            return None if exc.is_client_error else f"a canary failed: {exc}"
        except TransportError as exc:
            return f"a canary failed: {exc}"
        finally:
            if stream is not None:
                stream.cancel()
        worker.heard_at = time.monotonic()
        return None
