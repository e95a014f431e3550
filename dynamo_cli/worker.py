"""A worker process: an engine behind a request-plane endpoint, registered in discovery.

Lifecycle: start the planes, start the engine, listen, register instance + model card under the
process lease, publish KV events and load while serving; on SIGTERM deregister first (no new
requests arrive), drain in-flight streams within the grace period, then stop everything.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from prometheus_client import CollectorRegistry

from dynamo_cli.config import WorkerConfig
from dynamo_cli.engine import (
    ClearsKv,
    CountsWork,
    Embeds,
    EncodesImages,
    Engine,
    EngineArgs,
    Role,
    Scores,
    ServesLoras,
    SpawnsProcesses,
    check_image_inputs,
    load_engine,
    load_headless,
)
from dynamo_cli.errors import ConfigError, DynError, RequestError
from dynamo_cli.kv.events import KvDump, KvEventBatch
from dynamo_cli.kv.handles import PULLED_KINDS, BlobRef, KvHandle, TransferReport, check_handle
from dynamo_cli.kv.held_blocks import HeldBlocks
from dynamo_cli.lora.adapters import AdapterSet
from dynamo_cli.model_card import ModelCard
from dynamo_cli.node_group import GroupLeader, follow
from dynamo_cli.runtime.discovery import Discovery
from dynamo_cli.runtime.endpoint import Endpoint
from dynamo_cli.runtime.events import EventBus, ensure_kv_stream
from dynamo_cli.runtime.kv_transfer import KvTransferClient, KvTransferServer
from dynamo_cli.runtime.kv_transfer_nixl import load_agent_class
from dynamo_cli.runtime.names import EndpointName, component_subject, kv_events_subject
from dynamo_cli.runtime.planes import open_planes
from dynamo_cli.runtime.process import Loop, Process, Serving, serve
from dynamo_cli.runtime.reaper import guard_descendants
from dynamo_cli.runtime.supervisor import announce, cancel_and_wait, stop_on_signals
from dynamo_cli.runtime.system import ComponentMetrics, HealthReport, ServingState, SystemServer
from dynamo_cli.runtime.transport import RequestServer, Spec
from dynamo_cli.tracing import start_tracing
from dynamo_cli.tracing.logs import enter_request
from dynamo_cli.tracing.traceparent import trace_id_of
from dynamo_cli.wire import (
    EMBED,
    ENCODE,
    GENERATE,
    GROUP_JOIN,
    KV_CLEAR,
    KV_DUMP,
    KV_EVENTS_SINCE,
    KV_RELEASE,
    LORA,
    SCORE,
    EmbedRequest,
    EmbedResponse,
    EncodeReply,
    EncodeRequest,
    GenerateChunk,
    GenerateRequest,
    ImageEmbeds,
    ImageInput,
    KvClear,
    KvCleared,
    KvDumpQuery,
    KvEventsSince,
    KvRelease,
    LoadMetrics,
    LoraCommand,
    LoraReply,
    ScoreRequest,
    ScoreResponse,
    health_check_request,
)
from dynamo_cli.worker_metrics import WorkerMetrics

if TYPE_CHECKING:
    from dynamo_cli.tracing.spans import Tracing

logger = logging.getLogger(__name__)

T = TypeVar("T")

LOAD_INTERVAL_S = 0.05
"""How often a changed load snapshot is published."""
KV_HISTORY = 1024
"""KV event batches a worker keeps for routers that missed some (gap repair)."""
LOAD_HEARTBEAT_S = 0.5
"""Longest gap between two load publications."""
ENGINE_CHECK_S = 3.0
"""`/health`'s engine check: a one-token generation must end within this (Dynamo's canary timeout)."""
ENGINE_QUIET_S = 10.0
"""`/health` runs the engine check only when the engine produced nothing for this long (else it answers)."""


class WorkerService:
    """One engine served on one endpoint."""

    def __init__(
        self, config: WorkerConfig, engine: Engine, discovery: Discovery, bus: EventBus, tracing: Tracing | None = None
    ) -> None:
        if config.role is Role.ENCODE and not isinstance(engine, EncodesImages):
            raise ConfigError(
                f"--role encode: the {config.engine} engine has no encoder of its own to serve (the mocker has)"
            )
        self.config = config
        self.tracing = tracing
        """Each traced stream's `worker.generate` span (`--otlp-endpoint`); None: tracing off."""
        self.engine = engine
        self.discovery = discovery
        self.bus = bus
        self.name = EndpointName(config.namespace, config.component, config.endpoint)
        self.server = RequestServer(config.host, config.port, secret=config.planes.cluster_secret)
        """Its request plane: `generate` once registered (`begin`), the side endpoints from the start."""
        self.group = GroupLeader(config.group, config.engine) if config.group.is_grouped else None
        """A multi-node engine's leader side: its followers join here before it registers (node_group.py)."""
        for spec, handler in self._side_endpoints():
            self.server.add_endpoint(spec, handler)
        self._history: deque[tuple[int, bytes]] = deque(maxlen=KV_HISTORY)
        self._blocks = HeldBlocks()
        """Rank -> tier -> the blocks held there (a block may sit on several tiers); the card's ranks once started."""
        self._last_event_id = -1
        self.kv = KvMover(config)
        self.process = Process("worker")
        """Its skeleton (runtime/process.py): tasks, parts closed in reverse, serving state."""
        self.metrics = CollectorRegistry(auto_describe=True)
        """Its series (the request plane's, the engine's), on `/metrics` with `--system-port`."""
        self.metrics.register(ComponentMetrics(self.server, config.namespace, self.name.component))
        self.card: ModelCard | None = None
        self.last_output_at = 0.0
        """`time.monotonic()` when a request last ended: an engine that serves needs no health check."""
        self._engine_check: asyncio.Task[str | None] | None = None
        lora_engine = engine if isinstance(engine, ServesLoras) else None
        self.loras = AdapterSet(lora_engine, config.engine, config.lora.max_loras, config.lora.lora_dirs)
        """The LoRA adapters it serves and has loaded (dynamo_cli/lora)."""
        self.endpoint: Endpoint | None = None
        """Its `generate` endpoint once registered (an adapter load publishes a new card there)."""
        self._card_lock = asyncio.Lock()

    @property
    def instance_id(self) -> int:
        return self.discovery.lease_id

    @property
    def state(self) -> ServingState:
        return self.process.state

    def _side_endpoints(self) -> list[tuple[Spec[Any, Any], Callable[[Any], AsyncIterator[Any]]]]:
        sides: list[tuple[Spec[Any, Any], Callable[[Any], AsyncIterator[Any]]]] = [
            (KV_EVENTS_SINCE, self.kv_events_since),
            (KV_DUMP, self.kv_dump),
            (KV_RELEASE, self.kv_release),
            (KV_CLEAR, self.kv_clear),
            (EMBED, self.embed),
            (SCORE, self.score),
            (ENCODE, self.encode),
            (LORA, self.lora),
        ]
        if self.group is not None:
            sides.append((GROUP_JOIN, self.group.join))
        return sides

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The `generate` endpoint: run the request; closing aborts the engine request. A request with a KV handle
        has its payload pulled first; a prefill's exported payload is held for its decode worker."""
        enter_request(request.request_id, trace_id_of(request.annotations))
        tracing = self.tracing
        trace = tracing.stream(request, self.instance_id, self.config.role.value) if tracing is not None else None
        try:
            request, report = await self.kv.take(request)
            request = await self.kv.take_images(request)
            if trace is not None and report is not None:
                trace.pulled(report)
            chunk: GenerateChunk
            async with self.loras.using(request.lora):
                async for chunk in self.engine.generate(request):
                    if chunk.kv_transfer is not None:
                        chunk = msgspec.structs.replace(chunk, kv_transfer=self.kv.hold(chunk.kv_transfer))
                    if report is not None:
                        chunk, report = msgspec.structs.replace(chunk, transfer=report), None
                    if trace is not None:
                        trace.saw(chunk)
                    yield chunk
        except BaseException as exc:
            if trace is not None:
                trace.end(exc)
            raise
        finally:
            self.last_output_at = time.monotonic()  # per request, not per chunk: the health check's clue
        if trace is not None:
            trace.end()

    async def embed(self, request: EmbedRequest) -> AsyncIterator[EmbedResponse]:
        """Endpoint: the embeddings of tokenized inputs, when the engine serves them (Feature.EMBEDDINGS)."""
        if not isinstance(self.engine, Embeds):
            raise RequestError(f"the {self.config.engine} engine serves no embeddings", param="model")
        yield await self.engine.embed(request)

    async def score(self, request: ScoreRequest) -> AsyncIterator[ScoreResponse]:
        """Endpoint: each templated text pair's score, when the engine scores (Feature.SCORE)."""
        if not isinstance(self.engine, Scores):
            raise RequestError(f"the {self.config.engine} engine scores no text pairs", param="model")
        yield await self.engine.score(request)

    async def encode(self, request: EncodeRequest) -> AsyncIterator[EncodeReply]:
        """Endpoint (`--role encode`): each image's embeddings, held on the KV transfer server for one pull."""
        if self.config.role is not Role.ENCODE or not isinstance(self.engine, EncodesImages):
            raise RequestError(f"worker {self.instance_id:x} is not an encode worker (--role encode)", param="images")
        if self.card is None or self.card.images is None:
            raise RequestError(f"the {self.config.engine} engine here takes no images", param="images")
        check_image_inputs(request.images, self.card.images)
        payloads, cached = await self.engine.encode_images(request.images)
        yield EncodeReply(embeds=[self.kv.hold_embeds(p) for p in payloads], cached=cached)

    async def kv_release(self, release: KvRelease) -> AsyncIterator[bool]:
        """Endpoint: free a held KV payload no decode worker will pull (the client left)."""
        yield self.kv.server is not None and self.kv.server.release(release.transfer_id)

    async def kv_clear(self, request: KvClear) -> AsyncIterator[KvCleared]:
        """Endpoint: empty the engine's prefix cache (`ClearsKv`; POST /v1/admin/clear_kv_blocks)."""
        if not isinstance(self.engine, ClearsKv):
            raise RequestError(f"the {self.config.engine} engine cannot clear its prefix cache", param="model")
        logger.info("clearing the prefix cache (%s)", request.request_id)
        yield KvCleared(blocks=await self.engine.clear_kv_blocks())

    async def lora(self, command: LoraCommand) -> AsyncIterator[LoraReply]:
        """Endpoint: load or unload an adapter; the reply comes once this instance's card says so."""
        if self.card is None or self.endpoint is None or self.state is not ServingState.READY:
            raise DynError(f"worker {self.instance_id:x} is {self.state.value}, not serving")
        if command.action == "load":
            await self.loras.add(command.name, command.path)
        else:
            await self.loras.remove(command.name)
        async with self._card_lock:  # one card write at a time: the last one written lists every change
            self.card = card = msgspec.structs.replace(self.card, loras=sorted(self.loras.served))
            await self.endpoint.update_card(card)
        yield LoraReply(loras=card.loras, resident=list(self.loras.resident))

    async def begin(self, process: Process, stop: asyncio.Event) -> Serving:
        """The KV mover and the engine started (closed by `process`); what the worker then serves."""
        await self.kv.start()
        process.opens(self.kv.close)
        process.opens(self.engine.stop)
        if self.group is not None:  # the engine spans the followers' nodes: it starts once they are there
            await self.group.wait_whole()
        card = await self.start_engine()
        counters = self.engine.work_counters if isinstance(self.engine, CountsWork) else None
        self.metrics.register(
            WorkerMetrics(self.load_now, self.config.namespace, self.name.component, card.display_name, counters)
        )
        return Serving(
            GENERATE,
            self.generate,
            card,
            self.config.role.value,
            f"model={card.display_name} engine={card.engine} role={card.role}",
            self._serving,
        )

    def _serving(self, endpoint: Endpoint) -> list[Loop]:
        """Registered: the endpoint an adapter load publishes a new card on, and the worker's loops (a group's
        leader watches its followers: one leaving ends the serving)."""
        self.endpoint = endpoint
        if self.group is None:
            return [self.pump_kv_events(), self.pump_load()]
        self.group.serving = True
        return [self.pump_kv_events(), self.pump_load(), self.group.watch()]

    async def start_engine(self) -> ModelCard:
        """Start the engine and load the `--lora` adapters; the card it will be served with."""
        info = await self.engine.start()
        await self.loras.start(info.model_name, self.config.lora.named())
        card = ModelCard.from_engine(info, self.config.engine, self.config.role)
        if self.config.group.is_grouped:
            card = msgspec.structs.replace(card, nnodes=self.config.group.nnodes)
        self._blocks = HeldBlocks(card.ranks)
        if self.loras.is_enabled:
            card = msgspec.structs.replace(card, loras=sorted(self.loras.served), max_loras=self.loras.max_loras)
        self.card = card
        return card

    async def health(self) -> HealthReport:
        """`/health`: ready when registered and the engine answers (it produced lately, or a one-token
        generation ends within ENGINE_CHECK_S); 503 while starting or draining."""
        detail: dict[str, object] = {"instance_id": f"{self.instance_id:x}", "role": self.config.role.value}
        if self.group is not None:
            detail["group"] = self.group.health()
        if self.state is not ServingState.READY:
            return HealthReport(False, self.state.value, detail)
        if time.monotonic() - self.last_output_at < ENGINE_QUIET_S:
            return HealthReport(True, "ready", {**detail, "engine": "served lately"})
        if self._engine_check is None or self._engine_check.done():  # one check at a time, shared by probes
            self._engine_check = asyncio.get_running_loop().create_task(self._check_engine())
        problem = await asyncio.shield(self._engine_check)
        if problem is not None:
            return HealthReport(False, "unhealthy", {**detail, "engine": problem})
        return HealthReport(True, "ready", {**detail, "engine": "answered"})

    async def _check_engine(self) -> str | None:
        """A one-token generation straight on the engine; None if it ended in time, else what went wrong."""
        assert self.card is not None
        try:
            async with asyncio.timeout(ENGINE_CHECK_S):
                async for _ in self.engine.generate(health_check_request(self.card.health_check_token)):
                    pass
        except TimeoutError:
            return f"no answer to a one-token generation within {ENGINE_CHECK_S:.0f} s"
        except DynError as exc:
            return f"a one-token generation failed: {exc}"
        self.last_output_at = time.monotonic()
        return None

    def load_now(self) -> LoadMetrics:
        """The engine's load, stamped with this instance and its KV transfer holdings."""
        held, held_bytes = self.kv.server.held() if self.kv.server is not None else (0, 0)
        return msgspec.structs.replace(
            self.engine.load_metrics(),
            worker_id=self.instance_id,
            kv_event_id=self._last_event_id,
            kv_transfer_held=held,
            kv_transfer_held_bytes=held_bytes,
            loras=list(self.loras.resident),
            lora_loads=self.loras.loads,
            lora_load_s=self.loras.last_load_s,
        )

    async def pump_kv_events(self) -> None:
        """Relay the engine's KV events to the event plane, stamped with this instance's id; keep the
        last KV_HISTORY batches and the current block set for routers that missed some."""
        subject = component_subject(self.name.namespace, self.name.component, "kv-events")
        await ensure_kv_stream(self.bus, self.name.namespace, kv_events_subject(self.name.namespace))
        encode = msgspec.msgpack.encode
        async for batch in self.engine.kv_events():
            stamped = msgspec.structs.replace(batch, worker_id=self.instance_id)
            payload = encode(stamped)
            self._remember(stamped, payload)
            await self.bus.publish(subject, payload)

    def _remember(self, batch: KvEventBatch, payload: bytes) -> None:
        self._history.append((batch.event_id, payload))
        self._last_event_id = batch.event_id
        self._blocks.apply(batch)

    async def kv_events_since(self, query: KvEventsSince) -> AsyncIterator[bytes]:
        """Endpoint: replay kept KV event batches (encoded as published) from `first_event_id` on; `too_old` if
        they are gone."""
        since = query.first_event_id
        if not self._history or since < self._history[0][0]:
            oldest = self._history[0][0] if self._history else self._last_event_id + 1
            raise RequestError(f"KV events before {oldest} are no longer kept; ask {KV_DUMP.name}", code="too_old")
        for event_id, payload in list(self._history):
            if event_id >= since:
                yield payload

    async def kv_dump(self, query: KvDumpQuery) -> AsyncIterator[KvDump]:
        """Endpoint: the whole cached block set, per rank and tier, and the event id it is current to."""
        yield self._blocks.dump(self.instance_id, self._last_event_id)

    async def pump_load(self) -> None:
        """Publish the engine's load when it changes (at most every LOAD_INTERVAL_S) and at least every
        LOAD_HEARTBEAT_S, so a subscriber that joins late learns the current load."""
        subject = component_subject(self.name.namespace, self.name.component, "kv-metrics")
        last, last_at = None, 0.0
        loop = asyncio.get_running_loop()
        while True:
            metrics = self.load_now()
            if metrics != last or loop.time() - last_at >= LOAD_HEARTBEAT_S:
                await self.bus.publish(subject, msgspec.msgpack.encode(metrics))
                last, last_at = metrics, loop.time()
            await asyncio.sleep(LOAD_INTERVAL_S)


async def serve_worker(config: WorkerConfig) -> None:
    """Run a worker until SIGTERM/SIGINT, then drain and exit (a group's follower: until its group ends)."""
    if not config.group.is_leader:
        await follow_leader(config)
        return
    if config.group.is_grouped:
        load_headless(config.engine)  # a leader of an engine that cannot have followers would wait for none forever
    stop = asyncio.Event()
    stop_on_signals(stop)
    planes = config.planes
    tracing = start_tracing(config.telemetry, f"dyn-worker-{config.role.value}")  # no SDK: fails before the engine
    system = _system_server(config)
    try:
        if system is not None:  # bound first: `/live` answers, and `/health` says starting, while the engine loads
            await system.start()
        # Built before the planes open: constructing an engine may import a large library (vLLM: ~15 s), and the
        # lease must not go stale meanwhile; in a thread, so that the loop answers the system port.
        engine = await asyncio.to_thread(_build_engine, config)
        # The watchdog outlives this process on purpose: it exits by itself once this process is gone.
        reaper = guard_descendants() if isinstance(engine, SpawnsProcesses) and engine.spawns_processes else None
        if system is not None:
            system.serve_for(_starting("joining the planes"), [])
        async with open_planes(planes) as (discovery, bus):
            worker = WorkerService(config, engine, discovery, bus, tracing)
            if system is not None:
                system.serve_for(worker.health, [worker.metrics])
            await serve(
                worker.process, worker, discovery, stop, announce, grace_s=config.graceful_shutdown_s, system=system
            )
        del reaper  # held until here so its Popen is not collected (and warned about) while the worker runs
    finally:
        if system is not None:
            await system.close()  # idempotent: serve closed it already unless the start failed
        if tracing is not None:
            tracing.shutdown()  # the last spans exported


async def follow_leader(config: WorkerConfig) -> None:
    """A follower node of a multi-node engine: join the leader, run the engine's headless part, and end with the
    group (GroupBroken) or at SIGTERM. It opens no plane: only the leader is a routable worker."""
    headless = load_headless(config.engine)
    # A real engine's headless part is processes (vLLM's TP workers), which a SIGKILL of this one would orphan,
    # stuck in a collective: the watchdog takes them down with it (it exits once this process is gone).
    reaper = guard_descendants()
    stop = asyncio.Event()
    stop_on_signals(stop)
    follower = asyncio.ensure_future(
        follow(config.group, config.engine, config.planes.cluster_secret, headless(_engine_args(config)))
    )
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([follower, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(follower, stopped)
    del reaper  # held until here so its Popen is not collected (and warned about) while the follower runs
    if follower.done() and not follower.cancelled():
        follower.result()  # GroupBroken (or a failed join) goes up: one red line, a non-zero exit


def _build_engine(config: WorkerConfig) -> Engine:
    return load_engine(config.engine)(_engine_args(config))


def _system_server(config: WorkerConfig) -> SystemServer | None:
    """The worker's `/live`, `/health`, `/metrics` (with `--system-port`); until the worker is built, `/health`
    says it is starting and `/metrics` has the process's series only."""
    port = config.telemetry.system_port
    return None if port is None else SystemServer(config.host, port, _starting("loading the engine"), [])


def _starting(phase: str) -> Callable[[], Awaitable[HealthReport]]:
    """`/health` before the worker serves: 503, starting, and what it is doing."""

    async def health() -> HealthReport:
        return HealthReport(False, ServingState.STARTING.value, {"phase": phase})

    return health


class KvMover:
    """The worker's side of disaggregation's KV transfer: a prefill worker holds each exported payload on
    its KV transfer server until a decode worker pulls it; a decode worker pulls before its engine runs.
    A failed pull is not the request's failure: the engine then prefills the prompt itself."""

    def __init__(self, config: WorkerConfig) -> None:
        secret, backend = config.planes.cluster_secret, config.kv_transfer
        self.server = (
            KvTransferServer(
                config.host,
                config.kv_transfer_port,
                secret=secret,
                ttl_s=config.kv_transfer_ttl_s,
                use_nixl=backend != "tcp",
            )
            if config.role in (Role.PREFILL, Role.ENCODE)
            else None
        )
        self.client = (
            KvTransferClient(secret=secret, use_nixl=backend != "tcp") if config.role is not Role.ENCODE else None
        )
        """Pulls a decode's KV, and any worker's images' embeddings from encode workers (E/P/D)."""
        self.address = ""
        self._backend, self._role = backend, config.role

    async def start(self) -> None:
        if self._backend == "nixl" and load_agent_class() is None:
            raise ConfigError(
                "--kv-transfer nixl: NIXL does not import here; pip install 'dynamo-cli[nixl]' "
                "(or use --kv-transfer tcp)"
            )
        if self.server is not None:
            self.address = await self.server.start()
        if self.client is not None and self._role is Role.DECODE:  # it pulls every request's KV
            await self.client.prepare()

    async def close(self) -> None:
        for part in (self.server, self.client):
            if part is not None:
                await part.close()

    def hold(self, handle: KvHandle) -> KvHandle:
        """Prefill: keep the handle's payload here; the handle then names where to pull it from."""
        if self.server is None or not isinstance(handle, PULLED_KINDS):
            return handle
        offer = self.server.offer(handle.payload)
        blob = BlobRef(address=self.address, transfer_id=offer.transfer_id, nbytes=offer.nbytes, nixl=offer.nixl)
        return msgspec.structs.replace(handle, payload=b"", blob=blob)

    async def take(self, request: GenerateRequest) -> tuple[GenerateRequest, TransferReport | None]:
        """Decode: the request with its handle's payload pulled in, and how the pull went; a request whose
        pull failed goes on without its handle (the engine prefills locally)."""
        handle = request.kv_transfer
        if handle is None:
            return request, None
        problem = check_handle(handle, len(request.token_ids))
        if problem is not None:
            raise RequestError(problem, param="kv_transfer")
        if not isinstance(handle, PULLED_KINDS):
            return request, None  # the engine's library moves this KV itself
        if self.client is None or self._role is Role.PREFILL or handle.blob is None:
            raise RequestError("a prefill worker pulls no KV; send kv_transfer to a decode worker", param="kv_transfer")
        blob, started = handle.blob, time.perf_counter()
        try:
            pulled = await self.client.pull(blob.address, blob.transfer_id, blob.nbytes, blob.nixl)
        except DynError as exc:
            logger.warning(
                "request %s: KV pull from %s failed (%s); prefilling locally", request.request_id, blob.address, exc
            )
            report = TransferReport(nbytes=0, seconds=time.perf_counter() - started, backend="local")
            return msgspec.structs.replace(request, kv_transfer=None), report
        taken = msgspec.structs.replace(handle, payload=bytes(pulled.payload), blob=None)
        report = TransferReport(nbytes=blob.nbytes, seconds=pulled.seconds, backend=pulled.backend)
        return msgspec.structs.replace(request, kv_transfer=taken), report

    def hold_embeds(self, payload: bytes) -> ImageEmbeds:
        """Encode: keep one image's embeddings here for the serving worker to pull (once)."""
        assert self.server is not None, "only prefill and encode workers hold payloads"
        offer = self.server.offer(payload)
        blob = BlobRef(address=self.address, transfer_id=offer.transfer_id, nbytes=offer.nbytes, nixl=offer.nixl)
        return ImageEmbeds(blob=blob, checksum=embeds_checksum(payload))

    async def take_images(self, request: GenerateRequest) -> GenerateRequest:
        """The request with its images' embeddings pulled from their encode workers, each checked against its
        checksum; an image whose pull fails (the encoder gone, the payload expired, a mismatch) is left to the
        engine's own encoder (its `embeds` dropped), counted in the log."""
        if self.client is None or not any(image.embeds is not None for image in request.images):
            return request
        if request.kv_transfer is not None:  # a decode: the prefilled KV holds what the images did
            return request
        taken = await asyncio.gather(*(self._take_image(request.request_id, image) for image in request.images))
        return msgspec.structs.replace(request, images=list(taken))

    async def _take_image(self, request_id: str, image: ImageInput) -> ImageInput:
        embeds = image.embeds
        if embeds is None or embeds.blob is None:
            return image
        assert self.client is not None
        blob = embeds.blob
        try:
            pulled = await self.client.pull(blob.address, blob.transfer_id, blob.nbytes, blob.nixl)
        except DynError as exc:
            logger.warning(
                "request %s: embeddings pull from %s failed (%s); encoding here", request_id, blob.address, exc
            )
            return msgspec.structs.replace(image, embeds=None)
        payload = bytes(pulled.payload)
        if embeds_checksum(payload) != embeds.checksum:
            logger.warning(
                "request %s: embeddings from %s do not match their checksum; encoding here", request_id, blob.address
            )
            return msgspec.structs.replace(image, embeds=None)
        return msgspec.structs.replace(image, embeds=ImageEmbeds(payload=payload, checksum=embeds.checksum))


def embeds_checksum(payload: bytes) -> str:
    """BLAKE2b-128 of an embeddings payload (`ImageEmbeds.checksum`)."""
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def _engine_args(config: WorkerConfig) -> EngineArgs:
    return EngineArgs(
        model=config.model,
        served_model_name=config.served_model_name,
        role=config.role,
        block_size=config.block_size,
        context_length=config.context_length,
        extra=dict(config.extra),
        host=config.host,
        kv_tiers=config.kv_tiers,
        group=config.group.node_group(),
        max_loras=config.lora.max_loras if config.lora.adapters or config.lora.lora_dirs else 0,
    )
