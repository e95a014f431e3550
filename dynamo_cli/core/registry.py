"""The routable models of a namespace: discovered from worker cards, with their workers and policies.

Built on the runtime's instance watch (`v1/instances/{ns}/` + `v1/mdc/{ns}/`, cards decoded as
`ModelCard`): an instance is routable once both are known. One request-plane connection per worker
address; a worker that leaves discovery has its connection closed once idle, which fails its open
streams over to migration. The frontend and `dyn router` both route with it.

NOTE: aggregated and decode workers serve a model; prefill workers only add a prefill stage to it
(core/disagg.py). A model whose only workers are prefill workers is known (`models`) but not
servable (`get`, `servable`): nothing could decode it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from dynamo_cli.config import BusyThresholds
from dynamo_cli.core.queue import WaitQueue
from dynamo_cli.engine import Role
from dynamo_cli.errors import ModelNotFound, Overloaded
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.lora.routing import AdapterView
from dynamo_cli.model_card import ModelCard
from dynamo_cli.routing.base import RoutingPolicy
from dynamo_cli.routing.sessions import SessionTable
from dynamo_cli.runtime.discovery import Discovery
from dynamo_cli.runtime.endpoint import Connections, Instance, InstanceRecord, InstanceWatch
from dynamo_cli.runtime.names import EndpointName
from dynamo_cli.runtime.request_client import RequestClient
from dynamo_cli.wire import LoadMetrics

logger = logging.getLogger(__name__)

ROUTER_COMPONENT = "router"
"""Component name of standalone `dyn router` instances; by default the frontend routes to workers only."""

PolicyFactory = Callable[[ModelCard], RoutingPolicy]


@dataclass(slots=True)
class Worker:
    """A routable instance."""

    instance_id: int
    record: InstanceRecord
    card: ModelCard
    client: RequestClient
    num_inflight: int = 0
    """Streams this frontend has open on the worker."""
    load: LoadMetrics | None = None
    """The worker's last published load."""
    pending_prefill_tokens: int = 0
    """Prompt tokens this router sent the worker that it has not prefilled yet (disaggregation's queue view)."""
    heard_at: float = field(default_factory=time.monotonic)
    """`time.monotonic()` when the worker last sent anything here: a chunk on any stream, or a load report."""
    used_at: float = field(default_factory=time.monotonic)
    """When a stream to it (a request's, or a canary's) last began or ended: a canary goes to one idle for long."""
    hung: str | None = None
    """Why the worker counts as hung (core/health.py): out of routing until a canary answers."""
    adapters: AdapterView = field(default_factory=AdapterView)
    """The LoRA adapters it serves and has loaded (lora/routing.py)."""

    def busy_reason(self, limits: BusyThresholds) -> str | None:
        """Why the worker is busy (or hung), or None."""
        if self.hung is not None:
            return f"not answering ({self.hung})"
        if limits.max_inflight and self.num_inflight >= limits.max_inflight:
            return f"{self.num_inflight} requests in flight (limit {limits.max_inflight})"
        load = self.load
        if load is not None and load.total_blocks and limits.active_blocks_fraction < 1.0:
            used = load.active_blocks / load.total_blocks
            if used > limits.active_blocks_fraction:
                return f"KV cache {used:.0%} used (threshold {limits.active_blocks_fraction:.0%})"
        return None


def not_busy(candidates: list[int], workers: dict[int, Worker], limits: BusyThresholds, what: str) -> list[int]:
    """The candidates that are not busy; Overloaded with the first reason when every one is (`what`: the
    noun for them in that message, and `what` of which model)."""
    reasons = {w: r for w in candidates if (r := workers[w].busy_reason(limits))}
    if reasons and len(reasons) == len(candidates):
        raise Overloaded(f"all {len(candidates)} {what} are busy ({next(iter(reasons.values()))})")
    return [w for w in candidates if w not in reasons] if reasons else candidates


def free_of_prefill(candidates: list[int], workers: dict[int, Worker]) -> list[int]:
    """Background work (a batch line) goes only to a worker prefilling nothing this router sent it: so it fills
    the capacity interactive requests leave, and never sits in the way of their prompts. Overloaded (it then waits
    in the queue, behind every interactive request) when no candidate is free."""
    free = [w for w in candidates if workers[w].pending_prefill_tokens <= 0]
    if not free:
        raise Overloaded(f"all {len(candidates)} candidates are prefilling: background work waits")
    return free


@dataclass(slots=True)
class ModelEntry:
    """One model: its card, workers by role and routing policies."""

    name: str
    card: ModelCard
    policy: RoutingPolicy
    prefill_policy: RoutingPolicy
    workers: dict[int, Worker] = field(default_factory=dict)
    """Aggregated and decode workers."""
    prefill_workers: dict[int, Worker] = field(default_factory=dict)
    encode_workers: dict[int, Worker] = field(default_factory=dict)
    """Encode workers (`--role encode`): images in, embeddings out (core/encode_stage.py)."""
    queue: WaitQueue = field(default_factory=WaitQueue)
    """Requests waiting for one of `workers` to stop being busy (core/queue.py)."""
    adapters: dict[str, int] = field(default_factory=dict)
    """LoRA adapter -> how many of its aggregated or decode workers serve it (each adapter a model too)."""
    sessions: SessionTable = field(default_factory=SessionTable)
    """Session id -> the worker (and rank) of its last call (routing/sessions.py)."""

    def pool(self, role: Role) -> dict[int, Worker]:
        if role is Role.ENCODE:
            return self.encode_workers
        return self.prefill_workers if role is Role.PREFILL else self.workers

    def find(self, worker_id: int) -> Worker | None:
        """The worker of any role with this id."""
        return self.workers.get(worker_id) or self.prefill_workers.get(worker_id) or self.encode_workers.get(worker_id)

    def policy_of(self, worker_id: int) -> RoutingPolicy:
        """The policy of the pool `worker_id` is in: what that worker's KV events and load feed."""
        return self.prefill_policy if worker_id in self.prefill_workers else self.policy


EntryT = TypeVar("EntryT", bound=ModelEntry)


class Registry(Generic[EntryT]):
    """Live view of models and workers, fed by discovery watches; `_new_entry` makes a model's entry."""

    def __init__(
        self,
        discovery: Discovery,
        namespace: str,
        policy_factory: PolicyFactory,
        accept: Callable[[EndpointName], bool] | None = None,
        secret: bytes | None = None,
        prefill_policy_factory: PolicyFactory | None = None,
    ) -> None:
        self._policy_factory = policy_factory
        self._prefill_policy_factory = prefill_policy_factory or policy_factory
        """Routing of the prefill pool (`--prefill-router-mode`); by default the same as the decode pool's."""
        self.models: dict[str, EntryT] = {}
        self.adapters: dict[str, EntryT] = {}
        """LoRA adapter name -> the entry of its base model (requests naming it run there with `lora` set)."""
        self._placed: dict[int, EntryT] = {}
        self._watch = InstanceWatch(
            discovery, f"{namespace}/", ModelCard, accept or (lambda name: name.component != ROUTER_COMPONENT)
        )
        self._watch.on_join, self._watch.on_leave = self._add, self._remove
        self._watch.on_update = self._update
        self._connections = Connections(secret)
        """One request-plane connection per worker address, authenticated with the cluster `secret`."""
        self.changed = self._watch.changed
        """Set after every discovery event."""
        self.on_join: Callable[[EntryT, Worker], None] | None = None
        """Called when a worker becomes routable (the KV router catches up on its cache then)."""

    def _new_entry(self, card: ModelCard) -> EntryT:
        raise NotImplementedError

    ##### Queries #####

    def get(self, name: str) -> EntryT:
        """The entry serving `name`, or ModelNotFound listing what is served."""
        entry = self.models.get(name)
        if entry is None or not entry.workers:
            raise ModelNotFound(name, [e.name for e in self.servable()] + sorted(self.adapters))
        return entry

    def resolve(self, name: str) -> tuple[EntryT, str]:
        """The entry serving model `name` and the LoRA adapter to run it with ("": `name` is a base model)."""
        entry = self.adapters.get(name)
        if entry is not None and name not in self.models:
            return entry, name
        return self.get(name), ""

    def servable(self) -> list[EntryT]:
        """The models some aggregated or decode worker serves, by name."""
        return [e for _, e in sorted(self.models.items()) if e.workers]

    def num_workers(self) -> int:
        """Registered workers of every role."""
        return len(self._placed)

    def worker_of(self, instance_id: int) -> EntryT | None:
        return self._placed.get(instance_id)

    ##### Event ingestion #####

    def apply_kv_events(self, batch: KvEventBatch) -> None:
        """A worker's KV cache changes, to the policy of its pool."""
        entry = self._placed.get(batch.worker_id)
        if entry is not None:
            entry.policy_of(batch.worker_id).apply_kv_events(batch)

    def apply_load(self, metrics: LoadMetrics) -> None:
        """A worker's published load: kept on the worker (busy thresholds) and given to its pool's policy."""
        entry = self._placed.get(metrics.worker_id)
        if entry is not None:
            worker = entry.find(metrics.worker_id)
            if worker is not None:
                worker.load = metrics
                worker.heard_at = time.monotonic()
                if worker.adapters.served:
                    worker.adapters.reported(metrics)
            entry.policy_of(metrics.worker_id).apply_load(metrics)
            entry.queue.notify()

    ##### Discovery #####

    def loops(self) -> list[Coroutine[Any, Any, None]]:
        """The discovery watches (instances, cards); each runs until cancelled."""
        return self._watch.loops()

    def _add(self, instance: Instance[ModelCard]) -> None:
        instance_id, record, card = instance.instance_id, instance.record, instance.card
        entry = self.models.get(card.display_name)
        if entry is None:
            entry = self.models[card.display_name] = self._new_entry(card)
        client = self._connections.get(record.address)
        worker = entry.pool(Role(card.role))[instance_id] = Worker(instance_id, record, card, client)
        worker.adapters = AdapterView.of(card.loras, card.max_loras)
        self._placed[instance_id] = entry
        self._count_adapters(entry)
        entry.queue.notify()
        if self.on_join is not None:
            self.on_join(entry, worker)
        logger.info("worker %x joined model %s at %s (%s)", instance_id, card.display_name, record.address, card.role)

    def _update(self, instance: Instance[ModelCard]) -> None:
        """A live worker published a new card: the adapters it serves changed (a run-time load or unload)."""
        entry = self._placed.get(instance.instance_id)
        if entry is None:
            return
        worker = entry.find(instance.instance_id)
        if worker is None:
            return
        worker.card = instance.card
        worker.adapters = worker.adapters.updated(instance.card.loras, instance.card.max_loras)
        self._count_adapters(entry)
        entry.queue.notify()
        logger.info("worker %x of %s now serves adapters %s", instance.instance_id, entry.name, instance.card.loras)

    def _count_adapters(self, entry: EntryT) -> None:
        """Recount which adapters `entry`'s decoding workers serve; the registry's adapter index follows."""
        counts: dict[str, int] = {}
        for worker in entry.workers.values():
            for name in worker.adapters.served:
                counts[name] = counts.get(name, 0) + 1
        for name in entry.adapters.keys() - counts.keys():
            if self.adapters.get(name) is entry:
                del self.adapters[name]
        entry.adapters = counts
        for name in counts:
            self.adapters.setdefault(name, entry)

    def _remove(self, instance: Instance[ModelCard]) -> None:
        instance_id = instance.instance_id
        entry = self._placed.pop(instance_id)
        for pool in (entry.workers, entry.prefill_workers, entry.encode_workers):
            pool.pop(instance_id, None)
        self._count_adapters(entry)
        entry.policy.remove_worker(instance_id)
        entry.prefill_policy.remove_worker(instance_id)
        entry.queue.notify()  # waiters for a model with no worker left get their 503 now
        address = instance.record.address
        if not any(w.record.address == address for w in self._all_workers()):
            self._connections.retire(address)
        logger.info("worker %x left model %s", instance_id, entry.name)

    def _all_workers(self) -> list[Worker]:
        return [
            w
            for e in self.models.values()
            for w in (*e.workers.values(), *e.prefill_workers.values(), *e.encode_workers.values())
        ]

    async def close(self) -> None:
        """Close every worker connection. Idempotent."""
        await self._connections.close()


class RouterRegistry(Registry[ModelEntry]):
    """The registry of `dyn router`: plain entries (it sees token ids only, no tokenizer)."""

    def _new_entry(self, card: ModelCard) -> ModelEntry:
        return ModelEntry(card.display_name, card, self._policy_factory(card), self._prefill_policy_factory(card))
