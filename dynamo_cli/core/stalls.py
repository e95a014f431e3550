"""The deadline on a worker's streams: a stream that waits too long, on a worker that sent nothing at all for as
long, takes the worker out of routing (it is hung: core/health.py lets it back in) and fails over.

A worker reports its load every half second and sends chunks on every stream it serves; `Worker.heard_at` is the
last time either arrived. A slow prefill or a long queue on the worker does not trip the deadline: its load
reports go on. A stopped process, a frozen host or a cut network does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from dynamo_cli.core.registry import Worker
from dynamo_cli.core.request_plan import HealthMetrics, NoMetrics
from dynamo_cli.errors import BackendUnavailable, StreamTimeout, TransportError, WorkerHung
from dynamo_cli.runtime.request_client import ResponseStream
from dynamo_cli.runtime.transport import Spec

Req = TypeVar("Req")

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Deadline:
    """The stall timeout of a process's streams, and where a hung worker is counted."""

    stall_s: float
    """0: no deadline (the request plane's idle timeout only)."""
    metrics: HealthMetrics

    def failed(self, worker: Worker | None, model: str, exc: TransportError) -> None:
        """A stream failed: a worker whose backend failed (BackendUnavailable, an http-engine worker's server) is
        out of routing until a canary gets through to the backend."""
        if isinstance(exc, BackendUnavailable) and worker is not None and worker.hung is None:
            mark_hung(worker, model, str(exc), "backend", self.metrics)

    async def next_batch(self, stream: ResponseStream, worker: Worker, model: str) -> list[msgspec.Raw]:
        """The stream's next batch; WorkerHung once it waited `stall_s` and its worker sent nothing here for as
        long (the first such stream takes the worker out of routing)."""
        try:
            batch = await stream.next_batch(self.stall_s or None)
        except StreamTimeout:
            batch = await self.waited(stream, worker, model)
        if self.stall_s:
            worker.heard_at = time.monotonic()
        return batch

    async def open(
        self, worker: Worker, model: str, spec: Spec[Req, Any], request: Req, *, name: str | None = None
    ) -> ResponseStream:
        """`worker.client.open(spec, request, name=name)`, under the deadline where it must first connect: a
        stopped process's kernel accepts the connection but the handshake never comes (the request plane would wait
        HANDSHAKE_TIMEOUT_S for it, and every request to the worker behind it). As a stream's wait: waited
        `stall_s`, the worker is hung unless it is heard elsewhere (then the open waits on, up to the request
        plane's own limit)."""
        if not self.stall_s or worker.client.is_connected:
            return await worker.client.open(spec, request, name=name)  # the common case: no wait, no task
        opening = asyncio.ensure_future(worker.client.open(spec, request, name=name))
        try:
            wait = self.stall_s
            while True:
                done, _ = await asyncio.wait({opening}, timeout=wait)
                if done:
                    worker.heard_at = time.monotonic()
                    return opening.result()
                wait = self.stall_s - (time.monotonic() - worker.heard_at)
                if worker.hung is not None or wait <= 0:
                    silent = time.monotonic() - worker.heard_at
                    if worker.hung is None:
                        mark_hung(
                            worker,
                            model,
                            f"nothing from it for {silent:.1f} s while connecting",
                            "deadline",
                            self.metrics,
                        )
                    raise WorkerHung(f"worker {worker.instance_id:x} is not answering ({worker.hung})")
        finally:
            if not opening.done():
                opening.cancel()
                await asyncio.wait({opening})
                if not opening.cancelled():
                    opening.exception()  # it failed as it was given up on: retrieved, so never logged as lost

    async def waited(self, stream: ResponseStream, worker: Worker, model: str) -> list[msgspec.Raw]:
        """After a wait of `stall_s` timed out (raise it again without a deadline): wait on while the worker
        is heard elsewhere; else take it out of routing and raise WorkerHung. Without a deadline, the timeout
        was the request plane's own: StreamTimeout."""
        if not self.stall_s:
            raise StreamTimeout(f"no response from worker {worker.instance_id:x} within the idle timeout")
        while True:
            silent = time.monotonic() - worker.heard_at
            if worker.hung is None and silent < self.stall_s:
                try:  # it answers elsewhere (or reports its load): wait on
                    return await stream.next_batch(self.stall_s - silent)
                except StreamTimeout:
                    continue
            if worker.hung is None:
                reason = f"nothing from it for {silent:.1f} s with a stream open"
                mark_hung(worker, model, reason, "deadline", self.metrics)
            raise WorkerHung(f"worker {worker.instance_id:x} is not answering ({worker.hung})") from None


NO_DEADLINE = Deadline(0.0, NoMetrics())


def mark_hung(worker: Worker, model: str, reason: str, kind: str, metrics: HealthMetrics) -> None:
    """Take the worker out of routing until a canary answers."""
    worker.hung = reason
    metrics.count_stall(model, worker.instance_id, kind)
    logger.warning(
        "worker %x (%s, model %s) is hung: %s; out of routing, its streams migrate, probed until it answers",
        worker.instance_id,
        worker.card.role,
        model,
        reason,
    )
