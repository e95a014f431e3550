"""`dyn serve`: one frontend in this process plus N worker subprocesses on shared planes.

Workers are `dyn worker` processes started with this process's planes; each asks the kernel to
SIGTERM it if this process dies (no orphans even on SIGKILL). Stop order on SIGINT/SIGTERM: HTTP
server, then workers (SIGTERM, grace period, SIGKILL), then the planes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

from dynamo_cli.config import ServeConfig, WorkerConfig
from dynamo_cli.errors import DynError
from dynamo_cli.frontend.server import FrontendService, bind_socket
from dynamo_cli.runtime.discovery import Discovery, HostLocal
from dynamo_cli.runtime.events import EventBus
from dynamo_cli.runtime.planes import open_planes
from dynamo_cli.runtime.supervisor import PARENT_ENV, stop_on_signals

logger = logging.getLogger(__name__)


class WorkerFailed(DynError):
    """A worker subprocess exited before registering."""


def worker_argv(config: WorkerConfig, discovery: str) -> list[str]:
    """The `dyn worker` command line equivalent to `config`."""
    import json

    argv = [sys.executable, "-m", "dynamo_cli.cli.main", "worker",
            "--engine", config.engine, "--model", config.model, "--role", config.role.value,
            "--namespace", config.namespace, "--component", config.component, "--endpoint", config.endpoint,
            "--host", config.host, "--discovery", discovery, "--events", config.planes.events,
            "--lease-ttl", str(config.planes.lease_ttl),
            "--graceful-shutdown", str(config.graceful_shutdown_s)]  # fmt: skip
    for flag, value in (("--served-model-name", config.served_model_name), ("--block-size", config.block_size),
                        ("--context-length", config.context_length)):  # fmt: skip
        if value is not None:
            argv += [flag, str(value)]
    if config.extra:
        argv += ["--extra-engine-args", json.dumps(config.extra)]
    return argv


async def _spawn(argv: list[str]) -> asyncio.subprocess.Process:
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    return await asyncio.create_subprocess_exec(*argv, env=env, stdin=asyncio.subprocess.DEVNULL)


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


async def _stop_workers(procs: list[asyncio.subprocess.Process], grace: float) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.terminate()
    try:
        async with asyncio.timeout(grace + 2):
            for proc in procs:
                await proc.wait()
    except TimeoutError:
        for proc in procs:
            if proc.returncode is None:
                logger.warning("worker pid %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                await proc.wait()


async def serve_all(config: ServeConfig) -> None:
    """Run frontend + workers until SIGINT/SIGTERM."""
    stop = asyncio.Event()
    stop_on_signals(stop)
    planes = config.frontend.planes
    procs: list[asyncio.subprocess.Process] = []
    async with open_planes(planes.discovery, planes.events, planes.lease_ttl) as (discovery, bus):
        try:
            await _serve(config, discovery, bus, procs, stop)
        finally:
            await _stop_workers(procs, config.worker.graceful_shutdown_s)


async def _serve(config: ServeConfig, discovery: Discovery, bus: EventBus,
                 procs: list[asyncio.subprocess.Process], stop: asyncio.Event) -> None:  # fmt: skip
    planes = config.frontend.planes
    sock = bind_socket(config.frontend.host, config.frontend.port)
    url = f"http://{config.frontend.host}:{sock.getsockname()[1]}"
    service = FrontendService(config.frontend, discovery, bus)
    argv = worker_argv(config.worker, _shared_discovery(planes.discovery, discovery))
    procs.extend([await _spawn(argv) for _ in range(config.num_workers)])  # the caller stops them
    expected = config.num_workers
    if config.num_routers:  # `--router remote --routers N`: the frontend's registry holds the routers
        from dynamo_cli.router.service import router_argv

        router_cmd = router_argv(config, _shared_discovery(planes.discovery, discovery))
        procs.extend([await _spawn(router_cmd) for _ in range(config.num_routers)])
        expected = config.num_routers

    async def on_ready() -> None:
        await _wait_ready(service, procs, expected, config.ready_timeout_s)
        print(f"dyn serve ready: {url} ({config.num_workers} workers, router {config.frontend.router})", flush=True)

    await service.run(sock, stop, on_ready)


def _shared_discovery(url: str, discovery: object) -> str:
    """The URL workers must use to share this process's discovery (the embedded root made explicit)."""
    return f"file://{discovery.root}" if isinstance(discovery, HostLocal) else url
