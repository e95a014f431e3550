"""`dyn router`: the standalone KV router, a request-plane service between frontends and backend workers.

NOTE: to a frontend the router is a worker, to the workers it is a frontend. It registers under
`{ns}/router/generate` with a copy of a backend's model card (so a `--router remote` frontend finds
it), and for each `generate` request it picks a backend with `KvRoutingPolicy`, forwards the request
body unchanged, relays the worker's GenerateChunk bytes unchanged, and marks the first token and the
end on the policy, telling the other replicas (replicas.py), on every path: done, failed, cancelled.
A backend that fails before any token was relayed is replaced by the next best one; after that, the
failure goes back to the frontend, which migrates the request. A request annotated
`report_worker` (a frontend's) first gets an empty chunk naming the backend chosen, and a pin
(annotation `worker_instance_id`) that names no backend is a 400 listing the known ones.

NOTE on the queue: a backend over the busy thresholds (`--max-inflight-per-worker`, counting this
replica's streams, and `--active-decode-blocks-threshold`, from the backends' published load) is not
chosen, and when every backend is busy the request waits in the model's `WaitQueue` (router/queue.py,
the frontend's own) in the order of `--router-queue-policy`, after its priority; its priority and
deadline come from the frontend's headers as annotations (`priority`, `deadline_ms`), its job size from
the request. A refusal is Overloaded, which the frontend answers as a 503 with `Retry-After`. Each
routed request holds its backend from `_route` to `_release` (done, failed, cancelled, rerouted):
that is where the policy, the replicas and the queue hear that it let go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from dynamo_cli.config import DEFAULT_NAMESPACE, DisaggConfig, KvRouterConfig, PlanesConfig, QueueConfig, ServeConfig
from dynamo_cli.engine import (
    DEADLINE_ANNOTATION,
    PIN_ANNOTATION,
    PRIORITY_ANNOTATION,
    REPORT_WORKER_ANNOTATION,
    GenerateChunk,
    GenerateRequest,
    LoadMetrics,
)
from dynamo_cli.errors import NoWorkers, Overloaded, RequestError, TransportError, UnknownInstance
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.model_card import ModelCard
from dynamo_cli.router import prefill
from dynamo_cli.router.base import ExpiresStale, RepairsKvGaps, RouteDecision, RouteRequest
from dynamo_cli.router.disagg import falls_back, prefill_choice
from dynamo_cli.router.kv import KvRoutingPolicy, kv_policy_factory
from dynamo_cli.router.kv_repair import repair_gap, repair_loop
from dynamo_cli.router.queue import QueuedRequest
from dynamo_cli.router.registry import ROUTER_COMPONENT, BusyThresholds, ModelEntry, ModelRegistry, Worker, not_busy
from dynamo_cli.router.replicas import ReplicaSync
from dynamo_cli.runtime.discovery import Discovery
from dynamo_cli.runtime.endpoint import Endpoint
from dynamo_cli.runtime.events import EventBus, pump
from dynamo_cli.runtime.names import EndpointName, component_subject
from dynamo_cli.runtime.planes import open_planes
from dynamo_cli.runtime.supervisor import ServiceTasks, freeze_heap, stop_on_signals
from dynamo_cli.runtime.transport import RequestServer

logger = logging.getLogger(__name__)

MAX_REROUTES = 3
"""Backends tried for one request that fails before its first relayed chunk."""
CARD_POLL_S = 0.5
EXPIRE_INTERVAL_S = 30.0
"""How often requests in flight for over STALE_REQUEST_S (a lost end) are freed."""


@dataclass(frozen=True, slots=True)
class RouterServiceConfig:
    """`dyn router`."""

    namespace: str = DEFAULT_NAMESPACE
    component: str = "backend"
    """Component of the backend workers routed to."""
    host: str = "127.0.0.1"
    """Address the request plane listens on and advertises."""
    port: int = 0
    kv_router: KvRouterConfig = field(default_factory=KvRouterConfig)
    """The routing settings; `block_size` None = the backend card's."""
    graceful_shutdown_s: float = 5.0
    """How long SIGTERM waits for in-flight streams after deregistering."""
    planes: PlanesConfig = field(default_factory=PlanesConfig)
    prefill_component: str = "prefill"
    """Component of the prefill workers: a model that has some gets a prefill stage (router/disagg.py)."""
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    busy: BusyThresholds = field(default_factory=BusyThresholds)
    """When a backend counts as busy; `max_inflight` counts this replica's streams (as a frontend's own)."""
    queue: QueueConfig = field(default_factory=QueueConfig)
    """The wait queue of requests that find every backend busy."""


class BestWorkerQuery(msgspec.Struct, frozen=True, kw_only=True):
    """`best_worker_id` request (msgpack): the prompt's token ids, optionally a pinned worker."""

    token_ids: list[int]
    worker_instance_id: int | None = None


class RouterService:
    """Routes and relays `generate`, answers `best_worker_id`, keeps the backends' KV and load views."""

    def __init__(self, config: RouterServiceConfig, discovery: Discovery, bus: EventBus) -> None:
        self.config = config
        self.name = EndpointName(config.namespace, ROUTER_COMPONENT, "generate")
        secret = config.planes.cluster_secret
        self.registry = ModelRegistry(
            discovery,
            config.namespace,
            kv_policy_factory(config.kv_router),
            accept=lambda name: name.component in (config.component, config.prefill_component),
            busy=config.busy,
            secret=secret,
        )
        self.server = RequestServer(config.host, config.port, secret=secret)
        self.sync = ReplicaSync(bus, config.namespace, discovery.lease_id, self.registry)
        self.model: str | None = None
        """The model this router serves: the first backend card's (set at registration)."""
        self._discovery = discovery
        self._bus = bus
        self._decode_request = msgspec.msgpack.Decoder(GenerateRequest).decode
        self._decode_chunk = msgspec.msgpack.Decoder(GenerateChunk).decode

    @property
    def instance_id(self) -> int:
        return self._discovery.lease_id

    ##### Endpoints #####

    async def generate(self, body: msgspec.Raw) -> AsyncIterator[bytes]:
        """Route `body` (a GenerateRequest) to a backend and relay its chunks; closing aborts it."""
        try:
            request = self._decode_request(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise RequestError(f"malformed generate request: {exc}") from exc
        entry = self._entry()
        rendezvous: prefill.Rendezvous | None = None
        """NOTE: SGLang's prefill, drained beside the decode; owned here, closed on the way out."""
        try:
            async for raw in self._route_and_relay(entry, request, body):
                if isinstance(raw, prefill.Rendezvous):
                    rendezvous = raw
                    rendezvous.start()
                    continue
                yield raw
        finally:
            if rendezvous is not None:
                await rendezvous.aclose()

    async def _route_and_relay(
        self, entry: ModelEntry, request: GenerateRequest, body: msgspec.Raw
    ) -> AsyncIterator[bytes | prefill.Rendezvous]:
        excluded: set[int] = set()
        is_reported = request.annotations.get(REPORT_WORKER_ANNOTATION) == "1"
        queued = _queued(request)  # a bad annotation is a 400 now, not after a wait
        while True:
            worker, decision = await self._route_or_wait(entry, request, excluded, queued)
            is_relayed = False
            try:
                if is_reported:  # before any token, so the frontend's response can name the backend
                    yield msgspec.msgpack.encode(GenerateChunk(token_ids=[], worker_id=worker.instance_id))
                if not excluded:
                    first, body, rendezvous = await self._prefill_stage(entry, worker, request, decision, body)
                    if rendezvous is not None:
                        yield rendezvous
                    if first is not None:
                        is_relayed = True
                        yield msgspec.msgpack.encode(first)
                        if first.finish_reason is not None:
                            return
                async for raw in self._relay(entry, worker, request.request_id, bytes(body)):
                    is_relayed = True
                    yield raw
                return
            except TransportError as exc:
                if is_relayed or not exc.is_migratable or len(excluded) + 1 >= MAX_REROUTES:
                    raise
                excluded.add(worker.instance_id)
                logger.warning(
                    "request %s: backend %x failed before its first token (%s); rerouting",
                    request.request_id,
                    worker.instance_id,
                    exc,
                )
            finally:
                self._release(entry, worker, request.request_id)

    async def best_worker_id(self, body: msgspec.Raw) -> AsyncIterator[bytes]:
        """The backend `generate` would choose now, explained, with the in-flight view; routes nothing.

        In: a msgpack map `{"token_ids": [...], "worker_instance_id": id?}`. Out: one msgpack map.
        """
        try:
            query = msgspec.msgpack.decode(body, type=BestWorkerQuery)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise RequestError(f'malformed best_worker_id query: {exc}; send {{"token_ids": [...]}}') from exc
        entry = self._entry()
        policy = entry.policy
        assert isinstance(policy, KvRoutingPolicy)
        decision = policy.peek(
            RouteRequest("best_worker_id", query.token_ids, query.worker_instance_id), list(entry.workers)
        )
        reply = {
            "worker_id": decision.worker_id,
            "overlap_blocks": decision.overlap_blocks,
            "explanation": decision.explanation,
            "router_id": self.instance_id,
            "model": entry.name,
            "in_flight": in_flight_view(policy, list(entry.workers)),
            "queued": len(entry.queue),
            "indexed_workers": sorted(policy.indexer.workers()),
            "prefill_workers": sorted(entry.prefill_workers),
        }
        yield msgspec.msgpack.encode(reply)

    def _entry(self) -> ModelEntry:
        entry = self.registry.models.get(self.model) if self.model is not None else None
        if entry is None or not entry.workers:
            raise NoWorkers(f"model '{self.model}' (component '{self.config.component}' behind this router)")
        return entry

    async def _prefill_stage(
        self, entry: ModelEntry, worker: Worker, request: GenerateRequest, decision: RouteDecision, body: msgspec.Raw
    ) -> tuple[GenerateChunk | None, msgspec.Raw, prefill.Rendezvous | None]:
        """Disaggregation, as the frontend does it (frontend/dispatch.py): prefill remotely or not; if so the
        prefill's first token is the stream's first chunk and the decode request carries its KV handle."""
        config, pool = self.config.disagg, list(entry.prefill_workers.values())
        chosen = prefill_choice(config, entry.name, worker, pool, len(request.token_ids), decision.overlap_blocks)
        if chosen is None or not chosen[0].is_remote:
            return None, body, None
        # the prefill pool sheds by its own queue (--max-prefill-queue), not by the decode thresholds
        hop = prefill.PrefillHop(entry, request, BusyThresholds(), attempts=MAX_REROUTES)
        try:
            result = await hop.run()
        except (NoWorkers, Overloaded, TransportError) as exc:
            if not falls_back(config, exc):
                raise
            logger.warning(
                "request %s: remote prefill failed (%s); prefilling on the decode worker", request.request_id, exc
            )
            return None, body, None
        finally:
            hop.cancel()  # a no-op once it ended; aborts the prefill if this stream was closed meanwhile
        if hop.rendezvous is not None:  # SGLang: the decode meets the running prefill; it brings every token
            rendezvous = msgspec.structs.replace(request, kv_transfer=result.handle)
            return None, msgspec.Raw(msgspec.msgpack.encode(rendezvous)), hop.rendezvous
        first = GenerateChunk(
            token_ids=[result.first_token], finish_reason=result.finish_reason, num_cached_tokens=result.cached_tokens
        )
        entry.policy.on_first_token(request.request_id)
        self.sync.prefill_completed(entry.name, request.request_id)
        if result.finish_reason is not None or result.handle is None:
            if result.handle is not None and result.worker_id in entry.prefill_workers:
                await prefill.release(entry.prefill_workers[result.worker_id], result.handle)
            return first, body, None
        decode = msgspec.structs.replace(
            request,
            token_ids=[*request.token_ids, result.first_token],
            max_tokens=request.max_tokens - 1,
            min_tokens=max(0, request.min_tokens - 1),
            kv_transfer=result.handle,
        )
        return first, msgspec.Raw(msgspec.msgpack.encode(decode)), None

    async def _route_or_wait(
        self, entry: ModelEntry, request: GenerateRequest, excluded: set[int], queued: QueuedRequest
    ) -> tuple[Worker, RouteDecision]:
        """`_route`; at the first try, with every backend busy, wait in the model's queue for one (Overloaded
        when the queue is full or the wait too long; at once with `--router-queue-size 0`)."""
        try:
            return self._route(entry, request, excluded)
        except Overloaded:
            if excluded or not self.config.queue.max_size:
                raise
        return await entry.queue.take(lambda: self._route(entry, request, excluded), queued, self.config.queue)

    def _route(self, entry: ModelEntry, request: GenerateRequest, excluded: set[int]) -> tuple[Worker, RouteDecision]:
        """Pick a backend that is not busy and has not failed this request (the pinned one, if any); hold it."""
        candidates = [w for w in entry.workers if w not in excluded]
        if not candidates:
            raise NoWorkers(f"model '{entry.name}' (every backend failed this request)")
        pinned = _int_annotation(request, PIN_ANNOTATION, 16)
        if pinned is not None and pinned not in entry.workers:
            raise UnknownInstance(pinned, entry.name, list(entry.workers))
        if pinned in candidates:  # a pin waits for its own backend rather than going elsewhere
            candidates = [pinned]
        candidates = not_busy(candidates, entry.workers, self.registry.busy, f"backends of '{entry.name}'")
        decision = entry.policy.select(RouteRequest(request.request_id, request.token_ids, pinned), candidates)
        self.sync.added(entry.name, request.request_id, entry.policy)  # type: ignore[arg-type]
        worker = entry.workers[decision.worker_id]
        worker.num_inflight += 1
        return worker, decision

    def _release(self, entry: ModelEntry, worker: Worker, request_id: str) -> None:
        """The end of the held backend's part, for any reason: the policy, the replicas and the queue hear it."""
        worker.num_inflight -= 1
        entry.policy.on_finish(request_id)
        self.sync.freed(entry.name, request_id)
        entry.queue.freed()

    async def _relay(self, entry: ModelEntry, worker: Worker, request_id: str, body: bytes) -> AsyncIterator[bytes]:
        """The backend's chunks, as received; the policy learns the first token (`_release`, the end)."""
        stream = None
        is_prefilled = False
        try:
            stream = await worker.client.open_stream(worker.record.endpoint, body)
            while batch := await stream.next_batch():
                if not is_prefilled and any(self._decode_chunk(raw).token_ids for raw in batch):
                    is_prefilled = True
                    entry.policy.on_first_token(request_id)
                    self.sync.prefill_completed(entry.name, request_id)
                for raw in batch:
                    yield bytes(raw)
            stream = None
        finally:
            if stream is not None:
                stream.cancel()  # the caller left or the stream failed: abort it on the backend

    ##### Lifecycle #####

    async def run(self, stop: asyncio.Event, announce: Callable[[str], None]) -> None:
        """Serve until `stop`: register once a backend card is known; on stop deregister, then drain."""
        self.server.add_endpoint("best_worker_id", self.best_worker_id)
        address = await self.server.start()
        try:
            async with ServiceTasks() as tasks:
                await self._start_loops(tasks)
                card = await self._wait_for_card(stop, tasks)
                if card is None:
                    return
                async with Endpoint(self.name, self._discovery).serve_endpoint(
                    self.server, self.generate, card, role=card.role, grace_s=self.config.graceful_shutdown_s
                ):
                    backends = f"{self.config.namespace}/{self.config.component}"
                    announce(
                        f"dyn router ready: instance={self.name}/{self.instance_id:x} address={address} "
                        f"model={card.display_name} backends={backends}"
                    )
                    freeze_heap()
                    await tasks.wait_stop(stop)
        finally:
            await self.server.close()
            await self.registry.close()

    async def _start_loops(self, tasks: ServiceTasks) -> None:
        """NOTE: the router's background loops, owned by `tasks`: the backends' discovery, load and
        KV events (with gap repair), the replicas' sync, and the expiry of lost requests."""
        ns, component = self.config.namespace, self.config.component
        if self.config.kv_router.use_kv_events:  # before the discovery watch runs: no join is missed
            self.registry.on_join = lambda entry, worker: _catch_up(tasks, entry, worker)
        for loop in [
            *self.registry.loops(),
            self.sync.publish_loop(),
            self.sync.subscribe_loop(),
            *self.sync.peer_loops(self._discovery),
            self._expire_loop(),
        ]:
            tasks.spawn(loop)
        load = await self._bus.subscribe(component_subject(ns, component, "kv-metrics"))
        tasks.spawn(pump(load, self.registry.apply_load, LoadMetrics))
        if self.config.kv_router.use_kv_events:
            kv = await self._bus.subscribe(component_subject(ns, component, "kv-events"))
            tasks.spawn(pump(kv, self.registry.apply_kv_events, KvEventBatch))
            tasks.spawn(repair_loop(self.registry))

    async def _wait_for_card(self, stop: asyncio.Event, tasks: ServiceTasks) -> ModelCard | None:
        """The first backend card seen, or None if `stop` came first."""
        while not stop.is_set():
            tasks.raise_if_died()
            entry = next((e for e in self.registry.models.values() if e.workers), None)
            if entry is not None:
                self.model = entry.name
                return entry.card
            self.registry.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CARD_POLL_S):
                    await self.registry.changed.wait()
        return None

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_S)
            for entry in list(self.registry.models.values()):
                stale = entry.policy.expire_stale() if isinstance(entry.policy, ExpiresStale) else []
                if stale:
                    logger.warning("freed %d requests in flight for too long on model %s", len(stale), entry.name)


def in_flight_view(policy: KvRoutingPolicy, workers: list[int]) -> list[dict[str, int]]:
    """Per worker: requests in flight, unique active blocks, outstanding prefill tokens (this replica)."""
    s = policy.sequences
    return [
        {
            "worker_id": w,
            "num_requests": s.num_requests(w),
            "active_blocks": s.active_blocks(w),
            "active_prefill_tokens": s.active_prefill_tokens(w),
        }
        for w in sorted(workers)
    ]


def _queued(request: GenerateRequest) -> QueuedRequest:
    """What the wait queue's policy knows of `request`: the frontend's priority and deadline (annotations), and
    the job size (prompt + the most output tokens)."""
    deadline_ms = _int_annotation(request, DEADLINE_ANNOTATION)
    deadline = time.monotonic() + max(0, deadline_ms) / 1000 if deadline_ms is not None else None
    priority = _int_annotation(request, PRIORITY_ANNOTATION) or 0
    return QueuedRequest(priority, len(request.token_ids) + request.max_tokens, deadline)


def _int_annotation(request: GenerateRequest, name: str, base: int = 10) -> int | None:
    value = request.annotations.get(name)
    if not value:
        return None
    try:
        return int(value, base)
    except ValueError:
        kind = "a hex instance id" if base == 16 else "an integer"
        raise RequestError(f"annotation {name} '{value[:40]}' is not {kind}", param=name) from None


async def serve_router(config: RouterServiceConfig, announce: Callable[[str], None]) -> None:
    """Run a router until SIGTERM/SIGINT, then deregister, drain and exit."""
    stop = asyncio.Event()
    stop_on_signals(stop)
    planes = config.planes
    async with open_planes(planes.discovery, planes.events, planes.lease_ttl) as (discovery, bus):
        await RouterService(config, discovery, bus).run(stop, announce)


def _catch_up(tasks: ServiceTasks, entry: ModelEntry, worker: Worker) -> None:
    """A worker joined: replay its kept KV events from 0 (or load its dump), so what it announced before
    this router saw it register (a restarted worker's disk tier: warm restart) is routable at once."""
    policy = entry.prefill_policy if worker.instance_id in entry.prefill_workers else entry.policy
    if isinstance(policy, RepairsKvGaps):
        tasks.spawn(repair_gap(policy, worker, 0))


def router_argv(config: ServeConfig) -> list[str]:
    """The `dyn router` command line a `dyn serve --router remote --routers N` spawns (its planes' URLs
    come in the environment, as for workers)."""
    frontend, kv = config.frontend, config.frontend.kv_router
    argv = [
        sys.executable,
        "-m",
        "dynamo_cli.cli.main",
        "router",
        "--namespace",
        frontend.namespace,
        "--component",
        config.worker.component,
        "--host",
        config.worker.host,
        "--lease-ttl",
        str(frontend.planes.lease_ttl),
        "--graceful-shutdown",
        str(config.worker.graceful_shutdown_s),
        "--kv-overlap-score-weight",
        str(kv.overlap_score_weight),
        "--router-temperature",
        str(kv.temperature),
        "--router-ttl",
        str(kv.approx_ttl_s),
        "--kv-events" if kv.use_kv_events else "--no-kv-events",
        "--hot-spot-guard" if kv.hot_spot_guard else "--no-hot-spot-guard",
        "--router-cost",
        kv.cost,
    ]
    if kv.block_size is not None:
        argv += ["--block-size", str(kv.block_size)]
    if kv.prefill_tokens_per_s is not None:
        argv += ["--router-prefill-tps", str(kv.prefill_tokens_per_s)]
    argv += [
        "--router-host-bandwidth-gbs",
        str(kv.host_bandwidth_gbs),
        "--router-disk-bandwidth-gbs",
        str(kv.disk_bandwidth_gbs),
    ]
    if kv.tier_weights:
        argv += ["--router-tier-weights", ",".join(f"{tier}={weight}" for tier, weight in kv.tier_weights)]
    d = frontend.disagg
    q = frontend.queue  # the busy thresholds and the queue act in the routers (the frontend sees no load there)
    argv += [
        "--router-queue-size",
        str(q.max_size),
        "--router-queue-timeout",
        str(q.max_wait_s),
        "--router-queue-policy",
        q.policy.value,
        "--max-inflight-per-worker",
        str(frontend.max_inflight_per_worker),
        "--active-decode-blocks-threshold",
        str(frontend.active_blocks_threshold),
    ]
    argv += [
        "--disagg-policy",
        d.policy,
        "--max-local-prefill-length",
        str(d.max_local_prefill_length),
        "--max-prefill-queue",
        str(d.max_prefill_queue),
        "--decode-busy-threshold",
        str(d.decode_busy_threshold),
        *(["--enforce-disagg"] if d.enforce else []),
    ]
    return argv
