"""What one dispatch owes its model's wait queue (core/queue.py): its tenant's work, charged once, and its place
among the running requests a waiting higher class may pause.

The work is what the fair share counts: the prompt tokens the chosen worker had not cached (charged when the first
worker is held), then every output token at `--tenant-output-token-weight` (charged as each hold ends, so a
migrated or paused request is never charged twice for a token).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from dynamo_cli.config import QueueConfig
from dynamo_cli.config.tenants import PREEMPTIBLE, TENANT_NAME, PriorityClass
from dynamo_cli.core.queue import QueuedRequest, WaitQueue
from dynamo_cli.routing.base import RouteDecision
from dynamo_cli.runtime.request_client import ResponseStream
from dynamo_cli.wire import (
    CLASS_ANNOTATION,
    TENANT_ANNOTATION,
    TENANT_MAX_QUEUED_ANNOTATION,
    TENANT_WEIGHT_ANNOTATION,
)

MAX_WEIGHT = 1000.0
_CLASSES = {c.label: c for c in PriorityClass}


class Share:
    """One dispatch's account with its model's queue (a no-op where the model has none)."""

    def __init__(
        self, queue: WaitQueue | None, queued: QueuedRequest, config: QueueConfig, block_size: int, may_pause: bool
    ) -> None:
        """`may_pause`: the request's worker is one this side chose and may resume it on (not behind a router)."""
        self._queue = queue
        self._queued = queued
        self._config = config
        self._block_size = block_size
        self._is_prompt_charged = False
        self._charged_output = 0
        self._is_preemptible = may_pause and config.preemption and queued.lane_class <= PREEMPTIBLE
        self._is_preempted = False

    def preempt(self, stream: ResponseStream | None) -> bool:
        """The queue pauses the request for a higher class: its open `stream` is cancelled (None: nothing to pause
        now); True when it was."""
        if stream is None:
            return False
        self._is_preempted = True
        stream.cancel()
        return True

    def was_preempted(self) -> bool:
        """Whether the stream that just ended was cancelled by `preempt` (once: the resume clears it)."""
        was, self._is_preempted = self._is_preempted, False
        return was

    def held(
        self, key: object, decision: RouteDecision | None, prompt_tokens: int, preempt: Callable[[bool], bool]
    ) -> None:
        """A worker is held for the request: the first time, its uncached prompt is charged; while it runs, a
        bulk one may be paused."""
        queue, queued = self._queue, self._queued
        if queue is None:
            return
        if not self._is_prompt_charged:
            cached = decision.overlap_blocks * self._block_size if decision is not None else 0
            queue.charge(queued.tenant, max(0, prompt_tokens - cached), queued.weight)
            self._is_prompt_charged = True
        if self._is_preemptible:
            queue.running(key, queued.lane_class, preempt)

    def released(self, key: object, num_output: int) -> None:
        """The hold ended: the output tokens since the last charge are charged."""
        queue, queued = self._queue, self._queued
        if queue is None:
            return
        queue.stopped(key)
        fresh = num_output - self._charged_output
        if fresh > 0:
            queue.charge(queued.tenant, fresh * self._config.output_token_weight, queued.weight)
            self._charged_output = num_output


def tenant_annotations(queued: QueuedRequest) -> dict[str, str]:
    """A request's tenant, share and class, for the `dyn router` that queues it (`tenant_of` reads them)."""
    annotations = {TENANT_ANNOTATION: queued.tenant, CLASS_ANNOTATION: queued.priority_class.label}
    if queued.weight != 1.0:
        annotations[TENANT_WEIGHT_ANNOTATION] = repr(queued.weight)
    if queued.max_queued:
        annotations[TENANT_MAX_QUEUED_ANNOTATION] = str(queued.max_queued)
    return annotations


def tenant_of(annotations: Mapping[str, str], queued: QueuedRequest) -> QueuedRequest:
    """`queued` with the tenant, share and class a frontend annotated (`tenant_annotations`); what does not parse
    is left at its default (the plane is the frontend's, authenticated, but a value still never breaks the queue)."""
    tenant = annotations.get(TENANT_ANNOTATION, "")
    if not TENANT_NAME.fullmatch(tenant):
        return queued
    priority_class = _CLASSES.get(annotations.get(CLASS_ANNOTATION, ""), PriorityClass.DEFAULT)
    try:
        weight = float(annotations.get(TENANT_WEIGHT_ANNOTATION, "1"))
        max_queued = int(annotations.get(TENANT_MAX_QUEUED_ANNOTATION, "0"))
    except ValueError:
        weight, max_queued = 1.0, 0
    if not 0.0 < weight <= MAX_WEIGHT:
        weight = 1.0
    return dataclasses.replace(
        queued, tenant=tenant, weight=weight, priority_class=priority_class, max_queued=max(0, max_queued)
    )
