"""What one request asks of the workers (its plan, fixed before it is dispatched), and what the request core
reports as it goes (core/dispatch.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dynamo_cli.core.queue import QueuedRequest
from dynamo_cli.errors import ContextOverflow
from dynamo_cli.kv.handles import TransferReport
from dynamo_cli.routing.sessions import Session
from dynamo_cli.wire import GenerateRequest

if TYPE_CHECKING:
    from dynamo_cli.tracing.spans import RequestTrace


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What one request asks of the workers, fixed before it is dispatched."""

    request: GenerateRequest
    """The request as the first worker gets it (prompt, max_tokens checked against the context, sampling)."""
    pinned_worker: int | None = None
    """The backend the caller asked for (header `x-worker-instance-id`, annotation `worker_instance_id`)."""
    is_explained: bool = False
    """The caller asked to see the routing decision (header `x-dyn-explain-route`)."""
    client_request_id: str | None = None
    """The caller's `x-request-id`, echoed back; `request_id` is always the frontend's own."""
    queued: QueuedRequest = QueuedRequest()
    """Its place in the wait queue when every worker is busy: priority and deadline, job size."""
    trace: RequestTrace | None = None
    """The request's span in this process, to which the core adds its hops' (tracing on and the request
    traced); its `annotations` are already on `request`."""
    session: Session | None = None
    """The agent session it belongs to (`x-dyn-session-id`): its calls go where its last one went."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.token_ids


def check_context(prompt_tokens: int, max_tokens: int | None, context_length: int) -> int:
    """The output tokens allowed (`max_tokens`, or as many as the context leaves when None); ContextOverflow
    when the prompt leaves no room or `max_tokens` asks for more than it leaves."""
    room = context_length - prompt_tokens
    wanted = max_tokens if max_tokens is not None else room
    if room < 1 or wanted > room:
        raise ContextOverflow(prompt_tokens, wanted, context_length)
    return wanted


class HealthMetrics(Protocol):
    """Where hung workers and their recoveries are counted (core/stalls.py, core/health.py)."""

    def count_stall(self, model: str, worker_id: int, reason: str) -> None: ...

    def count_recovery(self, model: str, worker_id: int) -> None: ...


class DispatchMetrics(HealthMetrics, Protocol):
    """What the core reports as it goes (`core/metrics.py`'s `DispatchSeries`: the frontend's and `dyn
    router`'s Prometheus series)."""

    def observe_queue_wait(self, model: str, seconds: float) -> None: ...

    def count_migration(self, model: str, kind: str) -> None: ...

    def count_preemption(self, model: str) -> None: ...

    def count_disagg(self, model: str, outcome: str) -> None: ...

    def count_encode(self, model: str, outcome: str, images: int) -> None: ...

    def observe_transfer(self, model: str, report: TransferReport) -> None: ...

    def count_served(self, model: str, worker_id: int, role: str) -> None: ...


class NoMetrics:
    """DispatchMetrics that record nothing."""

    def observe_queue_wait(self, model: str, seconds: float) -> None:
        pass

    def count_migration(self, model: str, kind: str) -> None:
        pass

    def count_preemption(self, model: str) -> None:
        pass

    def count_disagg(self, model: str, outcome: str) -> None:
        pass

    def count_encode(self, model: str, outcome: str, images: int) -> None:
        pass

    def observe_transfer(self, model: str, report: TransferReport) -> None:
        pass

    def count_served(self, model: str, worker_id: int, role: str) -> None:
        pass

    def count_stall(self, model: str, worker_id: int, reason: str) -> None:
        pass

    def count_recovery(self, model: str, worker_id: int) -> None:
        pass
