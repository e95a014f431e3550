"""`dyn router`: the standalone KV router, a request-plane service between frontends and backend workers.

NOTE: to a frontend the router is a worker, to the workers it is a frontend. It registers under
`{ns}/router/generate` with a copy of a backend's model card (so a `--router remote` frontend finds
it), and runs each `generate` request through the request core the frontend runs (core/dispatch.py):
choose a backend with `KvRoutingPolicy` (or wait in the queue), the prefill stage, then the worker's
GenerateChunk bytes relayed unchanged; the policy and the other replicas (replicas.py) hear the choice,
the first token and the end on every path: done, failed, cancelled. A backend that fails before any
token was relayed is replaced by the next best one; after that, the failure goes back to the frontend,
which migrates the request. A request annotated `report_worker` (a frontend's) first gets an empty chunk
naming the backend chosen, and a pin (annotation `worker_instance_id`) that names no backend is a 400
listing the known ones.

NOTE on the queue: a backend over the busy thresholds (`--max-inflight-per-worker`, counting this
replica's streams, and `--active-decode-blocks-threshold`, from the backends' published load) is not
chosen, and when every backend is busy the request waits in the model's `WaitQueue` (core/queue.py,
the frontend's own) in the order of `--router-queue-policy`, after its priority; its priority and
deadline come from the frontend's headers as annotations (`priority`, `deadline_ms`), its job size from
the request. A refusal is Overloaded, which the frontend answers as a 503 with `Retry-After`. Each
routed request holds its backend from the core's `route` to its `release` (done, failed, cancelled,
rerouted): that is where the policy, the replicas and the queue hear that it let go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import msgspec

from dynamo_cli.config import RouterConfig
from dynamo_cli.core import loras
from dynamo_cli.core.dispatch import Dispatch, frames
from dynamo_cli.core.holds import pool_targets
from dynamo_cli.core.metrics import RouterMetrics
from dynamo_cli.core.queue import QueuedRequest
from dynamo_cli.core.registry import ROUTER_COMPONENT, ModelEntry, RouterRegistry
from dynamo_cli.core.request_plan import RequestPlan
from dynamo_cli.core.shares import tenant_of
from dynamo_cli.core.side_calls import call_worker
from dynamo_cli.core.stack import Routing, routing_stack
from dynamo_cli.errors import NoWorkers, RequestError
from dynamo_cli.model_card import ModelCard
from dynamo_cli.routing.base import RouteRequest
from dynamo_cli.routing.kv_policy import KvRoutingPolicy, kv_policy_factory
from dynamo_cli.routing.sessions import session_from
from dynamo_cli.routing.target import Target
from dynamo_cli.runtime.discovery import Discovery
from dynamo_cli.runtime.endpoint import Endpoint
from dynamo_cli.runtime.events import EventBus
from dynamo_cli.runtime.names import EndpointName
from dynamo_cli.runtime.planes import open_planes
from dynamo_cli.runtime.process import Process, Serving, serve
from dynamo_cli.runtime.supervisor import ServiceTasks, stop_on_signals
from dynamo_cli.runtime.system import ComponentMetrics, HealthReport, ServingState, SystemServer
from dynamo_cli.runtime.transport import RequestServer
from dynamo_cli.tracing import start_tracing
from dynamo_cli.tracing.logs import enter_request
from dynamo_cli.tracing.traceparent import trace_context, trace_id_of
from dynamo_cli.wire import (
    BEST_WORKER,
    DEADLINE_ANNOTATION,
    EMBED,
    GENERATE,
    LORA,
    PARENT_SESSION_ANNOTATION,
    PIN_ANNOTATION,
    PRIORITY_ANNOTATION,
    REPORT_WORKER_ANNOTATION,
    SCORE,
    SESSION_ANNOTATION,
    BestWorkerQuery,
    BestWorkerReply,
    EmbedRequest,
    EmbedResponse,
    GenerateChunk,
    GenerateRequest,
    InFlight,
    LoraCommand,
    LoraReply,
    ScoreRequest,
    ScoreResponse,
)

if TYPE_CHECKING:
    from dynamo_cli.tracing.spans import RequestTrace

logger = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode

MAX_REROUTES = 3
"""Backends (and prefill workers) tried for one request that fails before its first relayed chunk."""
CARD_POLL_S = 0.5


class RouterService:
    """Routes and relays `generate`, answers `best_worker_id`, keeps the backends' KV and load views."""

    def __init__(self, config: RouterConfig, discovery: Discovery, bus: EventBus) -> None:
        self.config = config
        self.name = EndpointName(config.namespace, ROUTER_COMPONENT, GENERATE.name)
        secret = config.planes.cluster_secret
        self.registry = RouterRegistry(
            discovery,
            config.namespace,
            kv_policy_factory(config.kv_router),
            accept=lambda name: name.component in (config.component, config.prefill_component),
            secret=secret,
        )
        self.server = RequestServer(config.host, config.port, secret=secret)
        self.metrics = RouterMetrics()
        self.tracing = start_tracing(config.telemetry, "dyn-router")
        """Spans of the requests routed here (`--otlp-endpoint`); None: tracing off. Shut down by the process."""
        self.process = Process("router", self.tracing)
        """Its skeleton (runtime/process.py): tasks, parts closed in reverse, serving state, tracing shut last."""
        routing = Routing(
            MAX_REROUTES - 1,
            config.busy,
            config.disagg,
            config.queue,
            config.health,
            kv_events=config.kv_router.use_kv_events,
            replica_sync=True,
            migrates_after_output=False,  # the frontend migrates a stream that already relayed tokens
            sessions=config.sessions,
        )
        self.stack = routing_stack(routing, self.registry, self.metrics, bus, config.namespace, discovery.lease_id)
        """The registry, rules, health monitor and replicas' sync this router routes with."""
        c = config
        self._settings = msgspec.to_builtins(
            {"kv_router": c.kv_router, "disagg": c.disagg, "queue": c.queue, "busy": c.busy}
        )
        """The routing settings, as `best_worker_id` shows them."""
        self.model: str | None = None
        """The model this router serves: the first backend card's (set at registration)."""
        self._discovery = discovery
        self._bus = bus

    @property
    def instance_id(self) -> int:
        return self._discovery.lease_id

    @property
    def state(self) -> ServingState:
        return self.process.state

    ##### Endpoints #####

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk | bytes]:
        """Route `request` to a backend and relay its chunks as they came (encoded); closing aborts it."""
        enter_request(request.request_id, trace_id_of(request.annotations))
        trace = self.tracing.continue_request("router.generate", request) if self.tracing is not None else None
        try:
            plan = plan_of(request, trace)  # a bad annotation is a 400 now, not after a wait
            dispatch = Dispatch(self._entry(), plan, self.stack.rules)
        except BaseException as exc:
            if trace is not None:
                trace.end(None, "error", exc)
            raise
        status = "error"
        try:
            await dispatch.route()
            if request.annotations.get(REPORT_WORKER_ANNOTATION) == "1":  # before any token: the frontend's
                yield GenerateChunk(token_ids=[], worker_id=dispatch.served_by)  # the response names it
            await dispatch.prepare()
            async with contextlib.aclosing(frames(dispatch)) as relayed:
                async for frame in relayed:
                    yield frame
            status = "cancelled" if dispatch.is_aborted else "success"
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        finally:
            await dispatch.aclose()
            self._observe(dispatch, status)
            if plan.trace is not None:
                plan.trace.end(dispatch.output.finish_reason, status)

    def _observe(self, dispatch: Dispatch, status: str) -> None:
        """A routed request's figures, as its end leaves them."""
        prompt = len(dispatch.plan.prompt_ids)
        decision, block_size = dispatch.decision, dispatch.entry.card.kv_cache_block_size
        hit = min(1.0, decision.overlap_blocks * block_size / prompt) if decision is not None and prompt else 0.0
        first = dispatch.output.first_token_at
        ttft = first - dispatch.started_at if first is not None else None
        now = time.perf_counter()
        self.metrics.observe_request(
            dispatch.entry.name, status, prompt, len(dispatch.output.token_ids), ttft, now - dispatch.started_at, hit
        )

    async def lora(self, command: LoraCommand) -> AsyncIterator[LoraReply]:
        """Endpoint: load or unload a LoRA adapter on the backends (a `--router remote` frontend's run-time load)."""
        if command.action == "load":
            await loras.load(self.registry, self._entry(), command, replicas=0)
        else:
            await loras.unload(self.registry, command.name)
        entry = self._entry()
        yield LoraReply(loras=sorted(entry.adapters), resident=[])

    async def embed(self, request: EmbedRequest) -> AsyncIterator[EmbedResponse]:
        """Endpoint: a backend's embeddings (a `--router remote` frontend's /v1/embeddings)."""
        yield await call_worker(self._entry(), EMBED, request, request.request_id, self.stack.rules)

    async def score(self, request: ScoreRequest) -> AsyncIterator[ScoreResponse]:
        """Endpoint: a backend's scores (a `--router remote` frontend's /v1/rerank and /v1/score)."""
        yield await call_worker(self._entry(), SCORE, request, request.request_id, self.stack.rules)

    async def _advertise_adapters(self, endpoint: Endpoint, card: ModelCard) -> None:
        """Keep this router's card listing the adapters its backends serve (frontends list them from it)."""
        while True:
            entry = self.registry.models.get(self.model) if self.model is not None else None
            if entry is not None:
                served = sorted(entry.adapters)
                most = max((w.card.max_loras for w in entry.workers.values()), default=0)
                if served != card.loras or most != card.max_loras:
                    card = msgspec.structs.replace(card, loras=served, max_loras=most)
                    await endpoint.update_card(card)
            self.registry.changed.clear()
            await self.registry.changed.wait()

    async def best_worker_id(self, query: BestWorkerQuery) -> AsyncIterator[BestWorkerReply]:
        """The backend `generate` would choose now, explained, with the in-flight view; routes nothing."""
        entry = self._entry()
        policy = entry.policy
        assert isinstance(policy, KvRoutingPolicy)
        workers, lora = list(entry.workers), query.lora
        if lora:
            workers = [w for w in workers if entry.workers[w].adapters.serves(lora)]
            if not workers:
                raise NoWorkers(f"LoRA adapter '{lora}' of model '{entry.name}'")
        load_s = {w: entry.workers[w].adapters.cost_s(lora) for w in workers} if lora else None
        route = RouteRequest("best_worker_id", query.token_ids, query.worker_instance_id, lora, load_s, query.images)
        targets = pool_targets(entry.workers, workers)
        decision = policy.peek(route, targets)
        yield BestWorkerReply(
            worker_id=decision.worker_id,
            dp_rank=decision.target.rank,
            overlap_blocks=decision.overlap_blocks,
            explanation=decision.explanation,
            router_id=self.instance_id,
            model=entry.name,
            in_flight=in_flight_view(policy, targets),
            queued=len(entry.queue),
            indexed_workers=sorted(policy.indexer.workers()),
            prefill_workers=sorted(entry.prefill_workers),
            settings=self._settings,
        )

    def _entry(self) -> ModelEntry:
        entry = self.registry.models.get(self.model) if self.model is not None else None
        if entry is None or not entry.workers:
            raise NoWorkers(f"model '{self.model}' (component '{self.config.component}' behind this router)")
        return entry

    ##### Lifecycle #####

    async def run(self, stop: asyncio.Event, announce: Callable[[str], None]) -> None:
        """Serve until `stop`: register once a backend card is known; on stop deregister, then drain."""
        self.server.add_endpoint(BEST_WORKER, self.best_worker_id)
        self.server.add_endpoint(LORA, self.lora)
        self.server.add_endpoint(EMBED, self.embed)
        self.server.add_endpoint(SCORE, self.score)
        grace_s = self.config.graceful_shutdown_s
        await serve(self.process, self, self._discovery, stop, announce, grace_s=grace_s, system=self._system_server())

    async def begin(self, process: Process, stop: asyncio.Event) -> Serving | None:
        """The routing loops (core/stack.py, as the frontend's) and the first backend's card; None: stopped first."""
        process.opens(self.registry.close)
        await self.stack.start(process.tasks, self._bus, self._discovery, self.config.namespace)
        card = await self._wait_for_card(stop, process.tasks)
        if card is None:
            return None
        backends = f"{self.config.namespace}/{self.config.component}"
        detail = f"model={card.display_name} backends={backends}"
        card = msgspec.structs.replace(card, dp_start=0, dp_size=1)  # one target to its callers: it chooses ranks
        return Serving(GENERATE, self.generate, card, card.role, detail, lambda e: [self._advertise_adapters(e, card)])

    def _system_server(self) -> SystemServer | None:
        """`/live`, `/health`, `/metrics` with `--system-port`: the request plane's and the routing's series."""
        port = self.config.telemetry.system_port
        if port is None:
            return None
        self.metrics.registry.register(ComponentMetrics(self.server, self.config.namespace, ROUTER_COMPONENT))
        return SystemServer(self.config.host, port, self.health, [self.metrics.registry], self._export_gauges)

    def _export_gauges(self) -> None:
        for entry in self.registry.models.values():
            self.metrics.workers.labels(entry.name).set(len(entry.workers))
            self.metrics.queued.labels(entry.name).set(len(entry.queue))
            self.metrics.export_kv_modes(entry.name, list(entry.workers), entry.policy.snapshot().precise)

    async def health(self) -> HealthReport:
        """Ready when registered with at least one backend to route to."""
        detail: dict[str, object] = {"instance_id": f"{self.instance_id:x}"}
        served = self.registry.models.get(self.model) if self.model is not None else None
        backends = len(served.workers) if served is not None else 0
        detail["backends"] = backends
        if self.state is ServingState.READY and not backends:
            return HealthReport(False, "unhealthy", {**detail, "reason": "no backend to route to"})
        return HealthReport(self.state is ServingState.READY, self.state.value, detail)

    async def _wait_for_card(self, stop: asyncio.Event, tasks: ServiceTasks) -> ModelCard | None:
        """The card of the first decode (or aggregated) backend seen, or None if `stop` came first.

        NOTE: not `entry.card`, which is the card of whichever worker of the model joined first: a prefill
        worker's when the prefill pool registered first, and a router advertising that card (its role)
        would be a prefill worker to the frontends, which never route a request to one."""
        while not stop.is_set():
            tasks.raise_if_died()
            entry = next((e for e in self.registry.models.values() if e.workers), None)
            if entry is not None:
                self.model = entry.name
                return next(iter(entry.workers.values())).card
            self.registry.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CARD_POLL_S):
                    await self.registry.changed.wait()
        return None


def in_flight_view(policy: KvRoutingPolicy, targets: list[Target]) -> list[InFlight]:
    """Per target: requests in flight, unique active blocks, outstanding prefill tokens (this replica)."""
    loads = policy.snapshot(sorted(targets)).in_flight
    return [
        InFlight(
            worker_id=t.worker,
            dp_rank=t.rank,
            num_requests=load.num_requests,
            active_blocks=load.active_blocks,
            active_prefill_tokens=load.active_prefill_tokens,
        )
        for t, load in loads.items()
    ]


def plan_of(request: GenerateRequest, trace: RequestTrace | None = None) -> RequestPlan:
    """The core's plan of a request a frontend sent: its pin, and what the wait queue's policy knows of it (the
    frontend's priority, deadline, tenant and class, from annotations; the job size, prompt + the most output
    tokens). The annotations stay here but the trace context: the backend's parent span is this router's
    (`trace`), or the frontend's when this router traces nothing."""
    pinned = _int_annotation(request, PIN_ANNOTATION, 16)
    deadline_ms = _int_annotation(request, DEADLINE_ANNOTATION)
    deadline = time.monotonic() + max(0, deadline_ms) / 1000 if deadline_ms is not None else None
    priority = _int_annotation(request, PRIORITY_ANNOTATION) or 0
    queued = tenant_of(
        request.annotations, QueuedRequest(priority, len(request.token_ids) + request.max_tokens, deadline)
    )
    carried = trace.annotations if trace is not None else trace_context(request.annotations)
    plain = msgspec.structs.replace(request, annotations=carried) if request.annotations else request
    names = (SESSION_ANNOTATION, PARENT_SESSION_ANNOTATION)
    annotations = request.annotations
    session = session_from(annotations.get(names[0]), annotations.get(names[1]), names)
    return RequestPlan(plain, pinned_worker=pinned, queued=queued, trace=trace, session=session)


def _int_annotation(request: GenerateRequest, name: str, base: int = 10) -> int | None:
    value = request.annotations.get(name)
    if not value:
        return None
    try:
        return int(value, base)
    except ValueError:
        kind = "a hex instance id" if base == 16 else "an integer"
        raise RequestError(f"annotation {name} '{value[:40]}' is not {kind}", param=name) from None


async def serve_router(config: RouterConfig, announce: Callable[[str], None]) -> None:
    """Run a router until SIGTERM/SIGINT, then deregister, drain and exit."""
    stop = asyncio.Event()
    stop_on_signals(stop)
    planes = config.planes
    async with open_planes(planes) as (discovery, bus):
        await RouterService(config, discovery, bus).run(stop, announce)
