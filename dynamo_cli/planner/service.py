"""`dyn plan run` assembled: discovery, the frontend scraper, a connector, the planner loop and its probes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from dynamo_cli.config import ChildCommand
from dynamo_cli.errors import ConfigError, PlaneUnavailable
from dynamo_cli.planner.connectors import Connector, LocalConnector, VirtualConnector
from dynamo_cli.planner.kubernetes import KubernetesConfig, KubernetesConnector, check_kubernetes
from dynamo_cli.planner.observe import (
    FrontendScraper,
    WorkerLoads,
    count_workers,
    discovered_frontends,
    follow_worker_loads,
)
from dynamo_cli.planner.planner import Planner, PlannerConfig, Reporter
from dynamo_cli.planner.predictors import PREDICTORS
from dynamo_cli.planner.probes import WatchedSource, planner_system_server
from dynamo_cli.planner.profile import Profile
from dynamo_cli.runtime.discovery import Discovery
from dynamo_cli.runtime.planes import open_discovery, open_event_bus
from dynamo_cli.runtime.process import Process
from dynamo_cli.runtime.supervisor import stop_on_signals
from dynamo_cli.runtime.system import ServingState

logger = logging.getLogger(__name__)

CONNECTORS = ("local", "virtual", "kubernetes")


@dataclass(frozen=True, slots=True)
class PlanRun:
    """Everything `dyn plan run` needs besides the profile."""

    planner: PlannerConfig
    """Targets, bounds, cadence, predictor."""
    frontends: tuple[str, ...]
    """Frontend base URLs whose /metrics are read (empty: those registered in discovery)."""
    namespace: str
    """The deployment's namespace (worker counts, virtual decision keys)."""
    discovery: str
    """The deployment's `--discovery` URL."""
    events: str = "embedded"
    """The deployment's `--events` URL: the workers' per-step load comes over it."""
    lease_ttl: float = 10.0
    """This process's discovery lease."""
    connector: str = "local"
    """local | virtual | kubernetes (ignored with dry_run)."""
    dry_run: bool = False
    """Only report decisions."""
    decode: ChildCommand | None = None
    """local: how the decode (agg: the one) pool's `dyn worker`s start (config.py `child_command`)."""
    prefill: ChildCommand | None = None
    """local, disagg: how the prefill pool's start."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """local: added to each worker's environment (planes, cluster secret)."""
    grace_s: float = 5.0
    """local: the workers' graceful-shutdown period."""
    ack_timeout_s: float = 1800.0
    """virtual: longest wait for the orchestrator's ack."""
    ack_poll_s: float = 1.0
    """virtual: ack polling period."""
    kubernetes: KubernetesConfig | None = None
    """kubernetes: the namespace and Deployments to scale (agg: decode only)."""
    duration_s: float = 0.0
    """Stop after this long (0: until SIGINT/SIGTERM)."""
    host: str = "127.0.0.1"
    """The address the system server listens on (0.0.0.0 for a kubelet's probes)."""
    system_port: int | None = None
    """The planner's `/live`, `/health` and `/metrics` (0: any free port; None: no system server)."""


def check_run(run: PlanRun) -> None:
    """ConfigError for flags that do not fit together."""
    config, targets = run.planner, run.planner.targets
    if targets.ttft_ms <= 0 or targets.itl_ms <= 0:
        raise ConfigError(f"--ttft and --itl must be positive, got {targets.ttft_ms} and {targets.itl_ms}")
    if config.mode not in ("agg", "disagg"):
        raise ConfigError(f"--mode '{config.mode}' is invalid; use agg or disagg")
    if config.interval_s <= 0 or config.load_interval_s < 0:
        raise ConfigError(
            f"--interval must be > 0 and --load-interval >= 0, got {config.interval_s} and {config.load_interval_s}"
        )
    bounds = config.bounds
    if bounds.min_workers < 0 or bounds.max_workers < max(bounds.min_workers, 1):
        raise ConfigError(
            f"need 0 <= --min-workers <= --max-workers and --max-workers >= 1, got "
            f"{bounds.min_workers} and {bounds.max_workers}"
        )
    if config.startup_s < 0:
        raise ConfigError(f"--startup must be >= 0, got {config.startup_s}")
    if config.ranks_per_worker < 0:
        raise ConfigError(
            f"--ranks-per-worker must be >= 0 (0: as the workers' cards say), got {config.ranks_per_worker}"
        )
    if not 0 < config.headroom <= 1:
        raise ConfigError(f"--headroom must be in (0, 1], got {config.headroom}")
    if config.predictor not in PREDICTORS:
        raise ConfigError(f"--predictor '{config.predictor}' is not known; use one of {', '.join(PREDICTORS)}")
    if run.connector not in CONNECTORS:
        raise ConfigError(f"--connector '{run.connector}' is invalid; use one of {', '.join(CONNECTORS)}")
    if run.connector == "kubernetes" and not run.dry_run:
        if run.kubernetes is None:
            raise ConfigError("--connector kubernetes needs --k8s-namespace")
        check_kubernetes(run.kubernetes)
    if run.system_port is not None and not 0 <= run.system_port <= 65535:
        raise ConfigError(f"--system-port must be 0..65535, got {run.system_port}")


def _connector(run: PlanRun, discovery: Discovery) -> Connector | None:
    if run.dry_run:
        return None
    if run.connector == "virtual":
        return VirtualConnector(discovery, run.namespace, ack_timeout_s=run.ack_timeout_s, poll_s=run.ack_poll_s)
    if run.connector == "kubernetes":
        assert run.kubernetes is not None  # check_run
        return KubernetesConnector(run.kubernetes)
    if run.decode is None:
        raise ConfigError("the local connector needs the workers' command")
    prefill = run.prefill if run.planner.mode == "disagg" else None
    return LocalConnector(run.decode, prefill, run.worker_env, grace_s=run.grace_s)


async def serve_planner(
    run: PlanRun, profile: Profile, report: Reporter | None = None, announce: Callable[[str], None] | None = None
) -> Planner:
    """Plan until SIGINT/SIGTERM (or `duration_s`), from the first time a frontend answers (`announce`d then);
    a local connector's workers are drained on the way out (the process skeleton closes its parts in reverse)."""
    check_run(run)
    stop = asyncio.Event()
    stop_on_signals(stop)
    async with Process("planner") as process:
        discovery = open_discovery(run.discovery, ttl=run.lease_ttl)
        await discovery.start()
        process.opens(discovery.close)
        bus = open_event_bus(run.events, discovery)
        process.opens(bus.close)
        await bus.start()
        connector = _connector(run, discovery)
        if connector is not None:
            process.opens(connector.close)
        client = httpx.AsyncClient()
        process.opens(client.aclose)
        urls = list(run.frontends) or (lambda: discovered_frontends(discovery, run.namespace))
        loads = WorkerLoads()
        source = WatchedSource(FrontendScraper(urls, client))
        workers = lambda: count_workers(discovery, run.namespace)  # noqa: E731
        planner = Planner(run.planner, profile, source, connector, workers, report, loads.total)
        system_text = await _system_server(process, run, planner, source)
        process.tasks.spawn(follow_worker_loads(bus, run.namespace, loads))
        if run.duration_s > 0:
            process.tasks.spawn(_stop_after(stop, run.duration_s))
        if await _first_read(planner, source, stop, run.planner.load_interval_s or run.planner.interval_s):
            source.state = ServingState.READY
            process.ready(f"{_describe(run)}{system_text}", announce or logger.info)
            await planner.run(stop)
        source.state = ServingState.DRAINING
        stop.set()
    return planner


async def _system_server(process: Process, run: PlanRun, planner: Planner, source: WatchedSource) -> str:
    """The planner's `/live`, `/health` and `/metrics` (`--system-port`), opened on `process`: the ready line's
    ` system=HOST:PORT`, or "" with no port."""
    if run.system_port is None:
        return ""
    server = planner_system_server(run.host, run.system_port, planner, source)
    address = await server.start()
    process.opens(server.close)
    return f" system={address}"


async def _first_read(planner: Planner, source: WatchedSource, stop: asyncio.Event, retry_s: float) -> bool:
    """Read the counters the first interval is measured from, every `retry_s` until a frontend answers (True) or
    the planner is stopped (False): a planner started before its frontends waits for them."""
    while not stop.is_set():
        try:
            await planner.baseline()
            return True
        except (PlaneUnavailable, TimeoutError):
            level = logging.WARNING if source.num_failed == 1 else logging.DEBUG  # /health tells the rest
            logger.log(level, "planner waiting for a frontend: %s", source.error)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(retry_s):
                await stop.wait()
    return False


def _describe(run: PlanRun) -> str:
    frontends = ",".join(run.frontends) or "discovery"
    connector = "none (dry run)" if run.dry_run else run.connector
    return f"namespace={run.namespace} mode={run.planner.mode} frontends={frontends} connector={connector}"


async def _stop_after(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()
    stop.set()
