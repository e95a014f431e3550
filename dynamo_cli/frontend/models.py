"""What the frontend can serve: models discovered from worker cards, their workers and routers.

Watches `v1/instances/{ns}/` and `v1/mdc/{ns}/`; an instance is routable once both its record and
its card are known. One request-plane connection per worker address; a worker that leaves
discovery has its connection closed, which fails its open streams over to migration.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dynamo_cli.engine import LoadMetrics, Role
from dynamo_cli.errors import ModelNotFound
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.model.tokenizer import Tokenizer, load_tokenizer
from dynamo_cli.model_card import InstanceRecord, ModelCard
from dynamo_cli.router.base import RoutingPolicy
from dynamo_cli.runtime.discovery import Discovery, WatchKind
from dynamo_cli.runtime.names import EndpointName, parse_instance_key
from dynamo_cli.runtime.supervisor import cancel_and_wait
from dynamo_cli.runtime.transport import RequestClient

logger = logging.getLogger(__name__)

ROUTER_COMPONENT = "router"
"""Component name of standalone `dyn router` instances; by default the frontend routes to workers only."""

RETIRE_GRACE_S = 30.0
"""How long a departed worker's connection stays open for its in-flight streams."""

PolicyFactory = Callable[[ModelCard], RoutingPolicy]


@dataclass(frozen=True, slots=True)
class BusyThresholds:
    """When a worker counts as busy (a request finding every worker busy gets a 503)."""

    max_inflight: int = 0
    """Streams in flight from this frontend to one worker; 0 = no limit."""
    active_blocks_fraction: float = 1.0
    """Published active KV blocks / total blocks above this is busy; >= 1.0 never triggers."""


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

    def busy_reason(self, limits: BusyThresholds) -> str | None:
        """Why the worker is busy, or None."""
        if limits.max_inflight and self.num_inflight >= limits.max_inflight:
            return f"{self.num_inflight} requests in flight (limit {limits.max_inflight})"
        load = self.load
        if load is not None and load.total_blocks and limits.active_blocks_fraction < 1.0:
            used = load.active_blocks / load.total_blocks
            if used > limits.active_blocks_fraction:
                return f"KV cache {used:.0%} used (threshold {limits.active_blocks_fraction:.0%})"
        return None


@dataclass(slots=True)
class ModelEntry:
    """One served model: its card, tokenizer, workers by role and routing policies."""

    name: str
    card: ModelCard
    tokenizer: asyncio.Future[Tokenizer]
    policy: RoutingPolicy
    prefill_policy: RoutingPolicy
    workers: dict[int, Worker] = field(default_factory=dict)
    """Aggregated and decode workers."""
    prefill_workers: dict[int, Worker] = field(default_factory=dict)

    def pool(self, role: Role) -> dict[int, Worker]:
        return self.prefill_workers if role is Role.PREFILL else self.workers


class ModelRegistry:
    """Live view of models and workers, fed by discovery watches."""

    def __init__(
        self, discovery: Discovery, namespace: str, policy_factory: PolicyFactory,
        busy: BusyThresholds | None = None,
        accept: Callable[[EndpointName], bool] | None = None,
    ) -> None:  # fmt: skip
        self.busy = busy or BusyThresholds()
        self._accept = accept or (lambda name: name.component != ROUTER_COMPONENT)
        self._discovery = discovery
        self._namespace = namespace
        self._policy_factory = policy_factory
        self.models: dict[str, ModelEntry] = {}
        self._records: dict[int, InstanceRecord] = {}
        self._cards: dict[int, ModelCard] = {}
        self._placed: dict[int, ModelEntry] = {}
        self._clients: dict[str, RequestClient] = {}
        self.changed = asyncio.Event()
        self.on_join: Callable[[ModelEntry, Worker], None] | None = None
        """Called when a worker becomes routable (the KV router catches up on its cache then)."""
        self._retiring: set[asyncio.Task[None]] = set()

    ##### Queries #####

    def get(self, name: str) -> ModelEntry:
        """The entry serving `name`, or ModelNotFound listing what is served."""
        entry = self.models.get(name)
        if entry is None or not (entry.workers or entry.prefill_workers):
            raise ModelNotFound(name, [n for n, e in self.models.items() if e.workers])
        return entry

    def num_workers(self) -> int:
        return len(self._placed)

    def worker_of(self, instance_id: int) -> ModelEntry | None:
        return self._placed.get(instance_id)

    ##### Event ingestion #####

    def apply_kv_events(self, batch: KvEventBatch) -> None:
        entry = self._placed.get(batch.worker_id)
        if entry is not None:
            pool_policy = entry.prefill_policy if batch.worker_id in entry.prefill_workers else entry.policy
            pool_policy.apply_kv_events(batch)

    def apply_load(self, metrics: LoadMetrics) -> None:
        entry = self._placed.get(metrics.worker_id)
        if entry is not None:
            worker = entry.workers.get(metrics.worker_id) or entry.prefill_workers.get(metrics.worker_id)
            if worker is not None:
                worker.load = metrics
            entry.policy.apply_load(metrics)

    ##### Discovery watches #####

    async def watch_instances(self) -> None:
        """Follow instance records; runs until cancelled."""
        await self._follow("v1/instances", InstanceRecord, self._records)

    async def watch_cards(self) -> None:
        """Follow model cards; runs until cancelled."""
        await self._follow("v1/mdc", ModelCard, self._cards)

    async def _follow(self, root: str, kind: type[Any], store: dict[int, Any]) -> None:
        decode = msgspec.json.Decoder(kind).decode
        async for event in self._discovery.watch(f"{root}/{self._namespace}/"):
            name, instance_id = parse_instance_key(event.key)
            if not self._accept(name):
                continue
            if event.kind is WatchKind.PUT:
                store[instance_id] = decode(event.value)
            else:
                store.pop(instance_id, None)
            await self._reconcile(instance_id)

    async def _reconcile(self, instance_id: int) -> None:
        record, card = self._records.get(instance_id), self._cards.get(instance_id)
        placed = self._placed.get(instance_id)
        if record is not None and card is not None:
            if placed is None:
                self._add(instance_id, record, card)
        elif placed is not None:
            await self._remove(instance_id, placed)
        self.changed.set()

    def _add(self, instance_id: int, record: InstanceRecord, card: ModelCard) -> None:
        entry = self.models.get(card.display_name)
        if entry is None:
            entry = self._new_entry(card)
            self.models[card.display_name] = entry
        client = self._clients.get(record.address)
        if client is None:
            client = self._clients[record.address] = RequestClient(record.address)
        worker = entry.pool(Role(card.role))[instance_id] = Worker(instance_id, record, card, client)
        self._placed[instance_id] = entry
        if self.on_join is not None:
            self.on_join(entry, worker)
        logger.info("worker %x joined model %s at %s (%s)", instance_id, card.display_name, record.address, card.role)

    def _new_entry(self, card: ModelCard) -> ModelEntry:
        loop = asyncio.get_running_loop()
        tokenizer = loop.run_in_executor(None, load_tokenizer, card.tokenizer_source)
        return ModelEntry(card.display_name, card, tokenizer, self._policy_factory(card), self._policy_factory(card))

    async def _remove(self, instance_id: int, entry: ModelEntry) -> None:
        del self._placed[instance_id]
        worker = entry.workers.pop(instance_id, None) or entry.prefill_workers.pop(instance_id, None)
        entry.policy.remove_worker(instance_id)
        entry.prefill_policy.remove_worker(instance_id)
        if worker is not None and not any(w.record.address == worker.record.address for w in self._all_workers()):
            self._clients.pop(worker.record.address, None)
            self._retire(worker.client)
        logger.info("worker %x left model %s", instance_id, entry.name)

    def _retire(self, client: RequestClient) -> None:
        """Close a departed worker's connection once its streams finish (a draining worker completes
        them), or after RETIRE_GRACE_S (a worker cut off without closing its socket): those fail over
        to migration."""
        if client.num_streams == 0:
            self._retiring.add(asyncio.get_running_loop().create_task(client.close()))
            return

        async def close_when_idle() -> None:
            deadline = asyncio.get_running_loop().time() + RETIRE_GRACE_S
            while client.num_streams and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
            await client.close()

        task = asyncio.get_running_loop().create_task(close_when_idle())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _all_workers(self) -> list[Worker]:
        return [w for e in self.models.values() for w in (*e.workers.values(), *e.prefill_workers.values())]

    async def close(self) -> None:
        await cancel_and_wait(*self._retiring)
        for client in list(self._clients.values()):
            await client.close()
        self._clients.clear()
