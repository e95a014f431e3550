"""`dyn serve`: one frontend in this process plus N worker subprocesses on shared planes.

With `--frontends N` the N - 1 other frontends are `dyn serve` children too: each binds the same port with
SO_REUSEPORT (the kernel spreads connections over them), runs its own router with the in-flight load shared
(`--router-replica-sync`, core/replicas.py) and writes its metrics where the others merge them (frontend/
metrics_group.py). Each is restarted if it dies, as a worker is; only its own open streams are lost. This process
is the first of them and their supervisor: it going takes the others with it.

Workers are `dyn worker` processes started with this process's planes; each asks the kernel to
SIGTERM it if this process dies (no orphans even on SIGKILL). Once every worker registered, a worker
that exits unexpectedly is started again (process_pool.py: backoff, `--max-restarts` budget), and
meanwhile requests for its model get 503 with Retry-After rather than 404. Stop order on
SIGINT/SIGTERM: HTTP server, then the other frontends, then workers (SIGTERM, grace period, SIGKILL), then the
planes.

With `--planner` the SLA planner runs in this process instead (one more task of the frontend's service): it
reads the frontend's metrics registry directly, and its local connector owns the workers, starting the
initial `--workers` and then as many as each decision asks, draining the surplus (deregister, finish
streams, exit). Those workers are not restarted one by one: a worker that dies drops the count in
discovery, and the planner's next decision starts what is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from dynamo_cli.backend_file import BackendFile
from dynamo_cli.config import PlanesConfig, RouterConfig, ServeConfig, WorkerConfig, backend_options, child_command
from dynamo_cli.core.registry import Worker
from dynamo_cli.engine import EngineArgs, Role
from dynamo_cli.errors import ConfigError, DynError, TransportError
from dynamo_cli.planner.connectors import LocalConnector, ScaleTarget
from dynamo_cli.planner.observe import (
    FrontendRecord,
    TextSnapshotter,
    WorkerLoads,
    count_workers,
    follow_worker_loads,
    frontend_urls,
)
from dynamo_cli.planner.planner import Planner, PlannerConfig
from dynamo_cli.planner.profile import Profile, load_profile
from dynamo_cli.planner.profiler import profile_mocker_as_deployed
from dynamo_cli.process_pool import ProcessPool, RestartPolicy
from dynamo_cli.runtime.discovery import Discovery, HostLocal
from dynamo_cli.runtime.events import EventBus
from dynamo_cli.runtime.names import frontend_key
from dynamo_cli.runtime.planes import open_planes
from dynamo_cli.runtime.supervisor import PARENT_ENV, ServiceTasks, announce, ready_line, stop_on_signals
from dynamo_cli.wire import BEST_WORKER, BestWorkerQuery

if TYPE_CHECKING:
    from dynamo_cli.frontend.server import FrontendService

logger = logging.getLogger(__name__)


class WorkerFailed(DynError):
    """A worker subprocess exited before registering."""


@dataclass(frozen=True, slots=True)
class ServePlan:
    """`dyn serve --planner`: the SLA planner in this process, scaling this deployment's own workers."""

    config: PlannerConfig
    """Targets, bounds (the pools' min/max) and cadence."""
    profile: Path | None = None
    """The engine's profile JSON (`dyn plan profile`); None: profile the mocker on the fly (a few seconds)."""


def _own_disk_dir(config: WorkerConfig, name: str) -> WorkerConfig:
    """Each worker its own subdirectory of `--kv-disk-cache-dir` (the same one when it is restarted)."""
    tiers = config.kv_tiers
    if tiers.disk_dir is None:
        return config
    return replace(config, kv_tiers=replace(tiers, disk_dir=os.path.join(tiers.disk_dir, name)))


async def _wait_ready(
    service: FrontendService, procs: list[asyncio.subprocess.Process], n: int, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while service.registry.num_workers() < n:
        dead = [p for p in procs if p.returncode is not None]
        if dead:
            raise WorkerFailed(f"worker pid {dead[0].pid} exited with code {dead[0].returncode} before registering")
        if time.monotonic() > deadline:
            raise WorkerFailed(
                f"only {service.registry.num_workers()} of {n} workers registered within {timeout:.0f} s"
            )
        service.registry.changed.clear()
        try:
            async with asyncio.timeout(0.2):
                await service.registry.changed.wait()
        except TimeoutError:
            pass


async def _wait_backends(
    service: FrontendService, config: ServeConfig, procs: list[asyncio.subprocess.Process]
) -> None:
    """Behind `dyn router`s: wait until every router routes to every worker (decode and prefill); a router's
    discovery watch lags the workers' registration, and until it has the prefill pool it prefills locally."""
    wanted, deadline = config.num_workers + config.num_prefill_workers, time.monotonic() + config.ready_timeout_s
    while True:
        if min([await _backends_seen(router) for router in _routers(service)], default=0) >= wanted:
            return
        dead = [p for p in procs if p.returncode is not None]
        if dead:
            raise WorkerFailed(f"worker pid {dead[0].pid} exited with code {dead[0].returncode} before registering")
        if time.monotonic() > deadline:
            raise WorkerFailed(
                f"the {wanted} workers behind the routers did not all reach every router within "
                f"{config.ready_timeout_s:.0f} s"
            )
        await asyncio.sleep(0.2)


def _routers(service: FrontendService) -> list[Worker]:
    return [w for entry in service.registry.models.values() for w in entry.workers.values()]


async def _backends_seen(router: Worker) -> int:
    """How many workers `router` routes to: its `best_worker_id` reply has a row of `in_flight` per rank of each
    decode worker and lists `prefill_workers`; 0 while it cannot answer yet."""
    try:
        async with asyncio.timeout(10):
            reply = await router.client.call(BEST_WORKER, BestWorkerQuery(token_ids=[]))
    except (TransportError, TimeoutError):
        return 0
    return len({row.worker_id for row in reply.in_flight}) + len(reply.prefill_workers)


async def serve_all(config: ServeConfig, plan: ServePlan | None = None) -> None:
    """Run frontend(s) + workers (+ the planner) until SIGINT/SIGTERM."""
    stop = asyncio.Event()
    stop_on_signals(stop)
    planes = config.frontend.planes
    env = {PARENT_ENV: str(os.getpid())}
    pool = ProcessPool(RestartPolicy(max_restarts=config.max_restarts), env)
    frontends = ProcessPool(RestartPolicy(max_restarts=config.max_restarts), env)
    with contextlib.ExitStack() as cleanup:
        if config.num_frontends > 1:  # the group's metrics directory, removed on the way out
            group = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="dyn-frontends-"))
            frontend = replace(config.frontend, reuse_port=True, metrics_dir=group, replica_sync=True)
            config = replace(config, frontend=frontend)
        async with open_planes(planes) as (discovery, bus):
            try:
                await Deployment(config, discovery, bus, Pools(pool, frontends), stop).run(plan)
            finally:
                await frontends.stop(config.frontend.graceful_shutdown_s)  # their streams end before the workers go
                await pool.stop(config.worker.graceful_shutdown_s)


@dataclass(frozen=True, slots=True)
class Pools:
    """The supervised children of `dyn serve`: its workers (and routers), and its other frontends."""

    workers: ProcessPool
    frontends: ProcessPool


class Deployment:
    """One `dyn serve`: its settings, planes and supervised children, the frontend in this process and (with
    `--planner`) the planner that scales its workers."""

    def __init__(
        self, config: ServeConfig, discovery: Discovery, bus: EventBus, pools: Pools, stop: asyncio.Event
    ) -> None:
        self.config = config
        self.discovery = discovery
        self.bus = bus
        self.pools = pools
        self.stop = stop
        planes = config.frontend.planes
        self.planes = replace(planes, discovery=_shared_discovery(planes.discovery, discovery))
        """The children's planes: this process's, the embedded discovery's directory made explicit."""
        self.connector: LocalConnector | None = None
        """`--planner`: the connector that owns the workers (else the pool supervises them)."""
        self.served: set[str] = set()
        """The models served once ready: a request for one while its worker restarts is a 503, not a 404."""
        self.backend_file: BackendFile | None = None
        """`--backend-file`: the workers of the backends it lists, kept in step with it."""

    async def run(self, plan: ServePlan | None) -> None:
        """Start the workers, then the frontend (and the planner); serve until the stop. The caller stops the pools."""
        profile = await _profile(self.config, plan) if plan is not None else None
        # The workers first: they start (~0.8 s) while this process imports and builds the frontend (~1 s on 2 cores),
        # not after it; they register in discovery, where the frontend's registry finds them when it starts.
        self.connector = await _start_workers(self.config, self.pools.workers, self.planes, planned=plan is not None)
        if self.config.backend_file:
            self.backend_file = _backend_file(self.config, self.planes, self.pools.workers)
        try:
            if self.backend_file is not None:
                await self.backend_file.sync(supervise=False)  # supervised once ready, as the other workers
            from dynamo_cli.batch.service import batch_service
            from dynamo_cli.frontend.server import FrontendService, bind_socket

            config, frontend = self.config, self.config.frontend  # joining a group's port: no connection until ready
            sock = bind_socket(
                frontend.host, frontend.port, reuse_port=frontend.reuse_port, listen=not config.joins_group
            )
            service = FrontendService(frontend, self.discovery, self.bus)
            if frontend.batch.is_enabled:  # one frontend of a group runs the batches; every one serves them
                service.attach(*batch_service(frontend, service.app, runs=not config.joins_group))
            planner = None if plan is None or profile is None else self._planner(plan, profile, service)
            await self._serve(service, sock, planner)
        finally:
            if self.connector is not None:
                await self.connector.close()
            if self.backend_file is not None:
                await self.backend_file.close()

    async def _serve(self, service: FrontendService, sock: socket.socket, planner: _PlannerLoops | None) -> None:
        config, pools = self.config, self.pools
        url = f"{config.frontend.scheme}://{config.frontend.advertised_host}:{sock.getsockname()[1]}"
        expected = config.num_workers + config.num_prefill_workers + config.num_encode_workers
        expected += len(self.backend_file.backends) if self.backend_file is not None else 0
        if config.num_routers:  # `--router remote --routers N`: the frontend's registry holds the routers
            router = replace(config.router_config(), planes=self.planes)
            for i in range(config.num_routers):
                await _spawn(pools.workers, _system_port(router, _child_port(config, expected + i)))
            expected = config.num_routers
        if config.joins_group:
            expected = config.ready_workers or 0
        await _spawn_frontends(config, pools.frontends, self.planes, sock.getsockname()[1], expected)
        pool, served = pools.workers, self.served
        pool.on_restart = lambda index, code: service.metrics.worker_restarts.inc()
        pools.frontends.on_restart = lambda index, code: service.metrics.frontend_restarts.inc()
        service.app.lifecycle.standby = lambda m: (
            (pool.retry_after() or 1.0) if m in served and pool.is_live() else None
        )
        async with ServiceTasks() as tasks:  # owns the pools' supervision; closed on the way out
            ready = functools.partial(self._on_ready, service, url, expected, planner, tasks)
            await service.run(sock, self.stop, ready, serve_first=not config.joins_group)  # serve_all stops the pools

    async def _on_ready(
        self, service: FrontendService, url: str, expected: int, planner: _PlannerLoops | None, tasks: ServiceTasks
    ) -> None:
        """Once the frontend serves: wait for the workers (and routers), supervise them, run the planner, publish
        this frontend, wait for the others, then the ready line."""
        config, pools = self.config, self.pools
        procs = pools.workers.procs + (self.connector.processes() if self.connector is not None else [])
        procs += self.backend_file.procs if self.backend_file is not None else []
        await _wait_ready(service, procs, expected, config.ready_timeout_s)
        if config.num_routers:  # the frontend sees only the routers: count the workers behind them
            await _wait_backends(service, config, pools.workers.procs)
        self.served.update(service.registry.models)
        tasks.spawn(pools.workers.supervise())
        if self.backend_file is not None:
            self.backend_file.supervise()
            tasks.spawn(self.backend_file.watch())
        if planner is not None:
            tasks.spawn(planner[1]())  # the workers' load, from the event plane
            tasks.spawn(planner[0].run(self.stop))
        # leased: a planner finds this frontend's /metrics here, and its peers' routers its load; both lose it when
        # this process goes
        key = frontend_key(config.frontend.namespace, self.discovery.lease_id)
        await self.discovery.put(key, msgspec.json.encode(FrontendRecord(url=url)))
        if config.joins_group:
            logger.info("frontend %x ready on %s", self.discovery.lease_id, url)
            return
        await _wait_frontends(self.discovery, config, pools.frontends, url)
        tasks.spawn(pools.frontends.supervise())
        grpc = f", kserve grpc {service.kserve_address}" if service.kserve_address is not None else ""
        workers = _workers_text(config, len(self.backend_file.backends) if self.backend_file is not None else 0)
        announce(ready_line("serve", f"{url} ({workers}, router {config.frontend.router}{grpc})"))

    def _planner(self, plan: ServePlan, profile: Profile, service: FrontendService) -> _PlannerLoops:
        """The planner on this frontend's own metrics registry (no HTTP), this deployment's workers and their load;
        and what follows their load."""
        namespace, discovery = self.config.frontend.namespace, self.discovery
        source = TextSnapshotter(lambda: service.app.rest.metrics_text().decode())  # with --frontends N: the group's
        loads = WorkerLoads()
        planner = Planner(
            plan.config, profile, source, self.connector, lambda: count_workers(discovery, namespace), loads=loads.total
        )
        return planner, lambda: follow_worker_loads(self.bus, namespace, loads)


_PlannerLoops = tuple[Planner, Callable[[], Coroutine[Any, Any, None]]]


async def _start_workers(
    config: ServeConfig, pool: ProcessPool, planes: PlanesConfig, planned: bool
) -> LocalConnector | None:
    """The initial workers: supervised by the pool, or (`--planner`) owned by the planner's connector."""
    decode = replace(config.worker, planes=planes)
    prefill = replace(decode, role=Role.PREFILL, component=Role.PREFILL.value)
    encode = replace(decode, role=Role.ENCODE, component=Role.ENCODE.value)
    for i in range(config.num_encode_workers):  # a fixed pool, the planner's or not
        port = _child_port(config, config.num_workers + config.num_prefill_workers + i)
        await _spawn(pool, _system_port(encode, None if planned else port))
    if planned and config.nodes_per_worker > 1:
        raise ConfigError(
            "--planner starts single-node workers: drop --nodes-per-worker (on Kubernetes it scales groups)"
        )
    if planned:  # one config for every worker the planner starts: any free system port each
        decode, prefill = (_system_port(c, 0 if _base_port(config) is not None else None) for c in (decode, prefill))
        if decode.kv_tiers.disk_dir is not None:  # one config for every worker the planner starts
            raise ConfigError(
                "--planner starts every worker with one config: drop --kv-disk-cache-dir (each "
                "worker then gets a temporary disk tier of its own)"
            )
        connector = LocalConnector(
            child_command(decode),
            child_command(prefill) if config.num_prefill_workers else None,
            pool.env,
            grace_s=decode.graceful_shutdown_s,
        )
        await connector.apply(ScaleTarget(0, config.num_prefill_workers, config.num_workers))
        return connector
    for i in range(config.num_workers):  # the caller stops them
        worker = _system_port(_own_disk_dir(decode, f"worker-{i}"), _child_port(config, i))
        if config.backends:  # --backend: worker i forwards to backend i
            worker = replace(worker, extra={**worker.extra, **backend_options(config.backends[i])})
        await _spawn(pool, worker, config.nodes_per_worker)
    for i in range(config.num_prefill_workers):
        port = _child_port(config, config.num_workers + i)
        await _spawn(pool, _system_port(_own_disk_dir(prefill, f"prefill-{i}"), port), config.nodes_per_worker)
    return None


def _backend_file(config: ServeConfig, planes: PlanesConfig, pool: ProcessPool) -> BackendFile:
    """`--backend-file`'s watch: its workers as the pool's (any free system port each, with --system-port)."""
    worker = _system_port(replace(config.worker, planes=planes), 0 if _base_port(config) is not None else None)
    return BackendFile(Path(config.backend_file or ""), worker, pool.policy, pool.env)


def _base_port(config: ServeConfig) -> int | None:
    return config.worker.telemetry.system_port


def _child_port(config: ServeConfig, index: int) -> int | None:
    """`--system-port BASE`: the index-th child's (decode workers, then prefill, encode workers, then routers)."""
    base = _base_port(config)
    return base + index if base else base


_Child = TypeVar("_Child", WorkerConfig, RouterConfig)


def _system_port(config: _Child, port: int | None) -> _Child:
    return replace(config, telemetry=replace(config.telemetry, system_port=port))


async def _spawn(pool: ProcessPool, config: WorkerConfig | RouterConfig, nodes: int = 1) -> None:
    """One supervised child; a worker of `nodes` > 1 as a group: its leader, and followers restarted with it."""
    if nodes == 1 or not isinstance(config, WorkerConfig):
        command = child_command(config)
        await pool.spawn(list(command.argv), command.env)
        return
    leader, followers = node_group(config, nodes, _free_port(config.host))
    commands = [child_command(c) for c in (leader, *followers)]
    await pool.spawn(list(commands[0].argv), commands[0].env, [(list(c.argv), c.env) for c in commands[1:]])


def node_group(config: WorkerConfig, nodes: int, port: int) -> tuple[WorkerConfig, list[WorkerConfig]]:
    """The configs of one worker spanning `nodes` processes on this host: its leader (on `port`) and followers."""
    group = replace(config.group, nnodes=nodes, node_rank=0, leader_addr=f"{config.host}:{port}")
    leader = replace(config, group=group, port=0)
    quiet = replace(config.telemetry, system_port=None)  # the leader's probes are the group's
    return leader, [replace(config, group=replace(group, node_rank=r), telemetry=quiet) for r in range(1, nodes)]


def _free_port(host: str) -> int:
    """A port free on `host` now (the group's leader binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


async def _profile(config: ServeConfig, plan: ServePlan) -> Profile:
    if plan.profile is not None:
        return load_profile(plan.profile)
    worker = config.worker
    logger.info("profiling the mocker for the planner (no --planner-profile given)")
    return await profile_mocker_as_deployed(
        EngineArgs(
            model=worker.model, block_size=worker.block_size, context_length=worker.context_length, extra=worker.extra
        )
    )


async def _spawn_frontends(
    config: ServeConfig, pool: ProcessPool, planes: PlanesConfig, port: int, expected: int
) -> None:
    """`--frontends N`: the N - 1 other frontends, `dyn serve` processes on the same port and planes that wait for
    the same workers and start none."""
    child = replace(
        config,
        frontend=replace(config.frontend, port=port, planes=planes, kserve_grpc_port=None),  # gRPC: the first's
        num_workers=0,
        num_prefill_workers=0,
        num_encode_workers=0,
        num_routers=0,
        num_frontends=1,
        ready_workers=expected,
    )
    for _ in range(config.num_frontends - 1):
        command = child_command(child)
        await pool.spawn(list(command.argv), command.env)


async def _wait_frontends(discovery: Discovery, config: ServeConfig, pool: ProcessPool, url: str) -> None:
    """Until all `--frontends` registered (this one included: the records on `url`), or raise when one exited or
    time ran out."""
    deadline = time.monotonic() + config.ready_timeout_s
    while (await frontend_urls(discovery, config.frontend.namespace)).count(url) < config.num_frontends:
        dead = [p for p in pool.procs if p.returncode is not None]
        if dead:
            raise WorkerFailed(f"frontend pid {dead[0].pid} exited with code {dead[0].returncode} before serving")
        if time.monotonic() > deadline:
            raise WorkerFailed(f"not all {config.num_frontends} frontends served within {config.ready_timeout_s:.0f} s")
        await asyncio.sleep(0.1)


def _workers_text(config: ServeConfig, backends: int = 0) -> str:
    encode = f"{config.num_encode_workers} encode + " if config.num_encode_workers else ""
    if not config.num_prefill_workers:
        return f"{encode}{config.num_workers + backends} workers"
    policy = config.frontend.disagg.policy
    return f"{encode}{config.num_prefill_workers} prefill + {config.num_workers} decode workers, disagg {policy}"


def _shared_discovery(url: str, discovery: object) -> str:
    """The URL workers must use to share this process's discovery (the embedded root made explicit)."""
    return f"file://{discovery.root}" if isinstance(discovery, HostLocal) else url
