"""Run the frontend: planes, model registry, event subscriptions and the HTTP server.

The HTTP server is uvicorn with httptools on uvloop by default (measured here ~19,000 hello-world
requests/s against ~2,200 for hypercorn); `--http-server hypercorn` keeps hypercorn (HTTP/2) available.
Either serves HTTPS with `--tls-cert-file/--tls-key-file`, requiring client certificates signed by
`--tls-ca-file` when one is given (mutual TLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.routing import Route

from dynamo_cli.config import ROUTER_MODES, FrontendConfig, TlsConfig
from dynamo_cli.core.dispatch import ToRouters, ToWorkers
from dynamo_cli.core.registry import ROUTER_COMPONENT
from dynamo_cli.core.stack import Routing, routing_stack
from dynamo_cli.errors import ConfigError
from dynamo_cli.frontend.app import Frontend
from dynamo_cli.frontend.metrics import FrontendMetrics
from dynamo_cli.frontend.metrics_group import MetricsGroup
from dynamo_cli.frontend.served_models import FrontendRegistry
from dynamo_cli.model_card import ModelCard
from dynamo_cli.routing.base import RandomPolicy, RoundRobinPolicy, RoutingPolicy
from dynamo_cli.routing.kv_policy import kv_policy_factory
from dynamo_cli.runtime.discovery import Discovery
from dynamo_cli.runtime.events import EventBus
from dynamo_cli.runtime.process import Process
from dynamo_cli.runtime.supervisor import cancel_and_wait, freeze_heap
from dynamo_cli.tracing import start_tracing

if TYPE_CHECKING:
    from dynamo_cli.frontend.kserve.server import KServeServer

logger = logging.getLogger(__name__)


def policy_factory(config: FrontendConfig, mode: str | None = None) -> Callable[[ModelCard], RoutingPolicy]:
    """Build one routing policy per model (and per role pool) for `--router` (or `mode`)."""
    mode = mode or config.router
    if mode in ("round-robin", "remote"):  # remote: spread over `dyn router` replicas, which pick workers
        return lambda card: RoundRobinPolicy()
    if mode == "random":
        return lambda card: RandomPolicy()
    if mode == "kv":
        return kv_policy_factory(config.kv_router)
    raise ConfigError(f"--router '{mode}' is unknown; use one of: {', '.join(ROUTER_MODES)}")


def bind_socket(host: str, port: int, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """Bind the HTTP socket up front so port 0 works and the real port can be printed (`reuse_port`: shared with
    the other frontends of `dyn serve --frontends N`, the kernel spreading connections over them; `listen`
    False: it gets none until the server starts, which listens)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if reuse_port and listen and port:  # the group's first: the port must be free, not another group's to share
        bind_socket(host, port).close()
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port") from exc
    if listen:
        sock.listen(2048)
    sock.setblocking(False)
    return sock


def check_tls(tls: TlsConfig) -> None:
    """Load the certificate, key and CA as the server will, so a bad file fails at start with its name."""
    if tls.cert_file is None:
        return
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    flag, files = "--tls-cert-file/--tls-key-file", f"{tls.cert_file} / {tls.key_file}"
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file, password=_no_password)
        if tls.ca_file is not None:
            flag, files = "--tls-ca-file", tls.ca_file
            context.load_verify_locations(tls.ca_file)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"{flag} ({files}) cannot be loaded: {exc}; pass PEM files (a certificate "
            "chain, its matching private key and a CA bundle)"
        ) from None


def _no_password() -> bytes:
    # OpenSSL would otherwise prompt on the terminal (and the server would prompt again)
    raise ConfigError("--tls-key-file is encrypted; pass an unencrypted PEM key (`openssl pkey -in KEY -out KEY2`)")


def _routing(config: FrontendConfig, prefill_mode: str | None, behind_routers: bool) -> Routing:
    """How the frontend routes: by itself, or through `dyn router`s that choose, queue and watch their backends."""
    return Routing(
        config.migration_limit,
        config.busy,
        config.disagg,
        config.queue,
        config.health,
        kv_events="kv" in (config.router, prefill_mode),
        replica_sync=config.replica_sync and config.router == "kv",  # `--router-replica-sync`
        upstream=ToRouters() if behind_routers else ToWorkers(),
        sessions=config.sessions,
        watches_workers=not behind_routers,
    )


class FrontendService:
    """Owns the registry's watches, the event pumps and the HTTP server."""

    def __init__(self, config: FrontendConfig, discovery: Discovery, bus: EventBus) -> None:
        check_tls(config.tls)
        self.config = config
        self.metrics = FrontendMetrics()
        behind_routers = config.router == "remote"  # then the routers choose, queue and watch their backends
        accept = (lambda name: name.component == ROUTER_COMPONENT) if behind_routers else None
        prefill_mode = config.disagg.prefill_router_mode
        self.registry = FrontendRegistry(
            discovery,
            config.namespace,
            policy_factory(config),
            accept,
            secret=config.planes.cluster_secret,
            prefill_policy_factory=policy_factory(config, prefill_mode),
        )
        routing = _routing(config, prefill_mode, behind_routers)
        self.stack = routing_stack(routing, self.registry, self.metrics, bus, config.namespace, discovery.lease_id)
        """The registry, rules, health monitor and replicas' sync this frontend routes with."""
        self.tracing = start_tracing(config.telemetry, "dyn-frontend")
        """Each request's spans (`--otlp-endpoint`); None: tracing off. Shut down by the process."""
        self.group = MetricsGroup(Path(config.metrics_dir), self.metrics.registry) if config.metrics_dir else None
        """`dyn serve --frontends N`: the frontends' shared metrics (/metrics shows the group's totals)."""
        rules = self.stack.rules
        self.app = Frontend(config, self.registry, self.metrics, rules, self.tracing, self.group, discovery.lease_id)
        self._discovery = discovery
        self._bus = bus
        self.process = Process("serve", self.tracing)
        """NOTE: its skeleton (runtime/process.py): the background tasks (discovery watches, event pumps, KV repair
        and catch-up, the HTTP server itself) cancelled when `run` returns, the registry closed, tracing shut."""
        self.kserve: KServeServer | None = None
        """The KServe gRPC server (`--kserve-grpc-port`), once `run` started it."""
        self._loops: list[Callable[[], Coroutine[Any, Any, None]]] = []
        """Loops of services attached to this frontend (the batch runner), run by `run` as its tasks."""

    def attach(self, routes: list[Route], loop: Callable[[], Coroutine[Any, Any, None]] | None) -> None:
        """A service on this frontend: its routes behind the gate, and its loop owned by `run`."""
        self.app.add_routes(routes)
        if loop is not None:
            self._loops.append(loop)

    async def run(
        self,
        sock: socket.socket,
        stop: asyncio.Event,
        on_ready: Callable[[], Awaitable[None]],
        *,
        serve_first: bool = True,
    ) -> None:
        """Serve until `stop` is set. `serve_first`: answer HTTP while `on_ready` waits (the port is this
        deployment's alone; its clients wait for the ready line); else only once it returned (a frontend joining
        a group on a shared port: until it knows the workers, the kernel hands its connections to the others)."""
        async with self.process as process:
            tasks = process.tasks
            process.opens(self.registry.close)
            await self.stack.start(tasks, self._bus, self._discovery, self.config.namespace)
            if self.group is not None:
                tasks.spawn(self.group.share(self.app.rest.refresh_metrics))
            if self.config.kserve_grpc_port is not None:
                from dynamo_cli.frontend.kserve.server import KServeServer

                self.kserve = KServeServer(self.config, self.app)
                await self.kserve.start()
                process.opens(self.kserve.stop, front=True)
            if serve_first:
                server = tasks.spawn(self._serve_http(sock, stop))
                await on_ready()
            else:
                await on_ready()
                server = tasks.spawn(self._serve_http(sock, stop))
            for attached in self._loops:  # once ready: the batch runner finds the workers `dyn serve` started
                tasks.spawn(attached())
            freeze_heap()
            await server
            if self.kserve is not None:  # its calls in flight end (or are cut) while the routing is still up
                await self.kserve.stop()

    @property
    def kserve_address(self) -> str | None:
        """Where the KServe gRPC server listens (`host:port`), None when it is off."""
        if self.kserve is None:
            return None
        return f"{self.config.advertised_host}:{self.kserve.port}"

    async def _serve_http(self, sock: socket.socket, stop: asyncio.Event) -> None:
        if self.config.http_server == "hypercorn":
            return await self._serve_hypercorn(sock, stop)
        if self.config.http_server != "uvicorn":
            raise ConfigError(f"--http-server '{self.config.http_server}' is unknown; use uvicorn or hypercorn")
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Any:  # signals belong to our supervisor
                yield

        tls = self.config.tls
        config = uvicorn.Config(
            self.app,
            http=_uvicorn_protocol(),
            log_config=None,  # uvicorn's lines go through the process's handler (its format: text or JSON)
            lifespan="off",
            access_log=False,
            log_level="warning",
            timeout_keep_alive=30,
            backlog=2048,
            timeout_graceful_shutdown=max(1, round(self.config.graceful_shutdown_s)),
            ssl_certfile=tls.cert_file,
            ssl_keyfile=tls.key_file,
            ssl_ca_certs=tls.ca_file,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls.ca_file else ssl.CERT_NONE,
        )
        server = _Server(config)
        watcher = asyncio.get_running_loop().create_task(stop.wait())  # owned here: awaited below
        watcher.add_done_callback(lambda _: setattr(server, "should_exit", True))
        try:
            await server.serve(sockets=[sock])
        finally:
            await cancel_and_wait(watcher)

    async def _serve_hypercorn(self, sock: socket.socket, stop: asyncio.Event) -> None:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        config = Config()
        config.bind = [f"fd://{sock.fileno()}"]
        config.accesslog = None
        config.graceful_timeout = self.config.graceful_shutdown_s
        tls = self.config.tls
        if tls.cert_file is not None:
            config.certfile, config.keyfile = tls.cert_file, tls.key_file
            if tls.ca_file is not None:
                config.ca_certs, config.verify_mode = tls.ca_file, ssl.CERT_REQUIRED
        await serve(self.app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]


def _uvicorn_protocol() -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, but an idle keep-alive connection is aborted at shutdown, not closed: a
    TLS close waits for the client's close_notify, which an idle client never sends, so one such client
    held `dyn serve`'s exit on SIGTERM for 30 s. Connections with a response in flight still finish it."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _Protocol(HttpToolsProtocol):
        def shutdown(self) -> None:
            if self.cycle is None or self.cycle.response_complete:
                self.transport.abort()
            else:
                super().shutdown()

    return _Protocol
