"""The processes' settings: where the planes are, one worker, one `dyn router`, and a whole `dyn serve`; and
how a process hands its child the config it runs (one JSON document in its environment)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgspec

from dynamo_cli.config import routing
from dynamo_cli.config.common import (
    BLOCK_SIZE,
    DEFAULT_ENGINE,
    DEFAULT_MODEL,
    DEFAULT_NAMESPACE,
    GRACEFUL_SHUTDOWN,
    NAMESPACE,
    PlanesConfig,
)
from dynamo_cli.config.frontend import FrontendConfig
from dynamo_cli.config.group import MAX_NODES, GroupConfig
from dynamo_cli.config.lora import LoraConfig
from dynamo_cli.config.routing import BusyThresholds, DisaggConfig, HealthChecks, KvRouterConfig, QueueConfig
from dynamo_cli.config.telemetry import TelemetryConfig
from dynamo_cli.engine import KvTierConfig, Role
from dynamo_cli.errors import ConfigError
from dynamo_cli.settings import DISAGG, ENGINE, HTTP, PLANES, ROUTING, SUPERVISION, repeated, setting
from dynamo_cli.wire import GENERATE

KV_TRANSFERS = ("auto", "tcp", "nixl")
"""`--kv-transfer`: NIXL when it imports, else TCP; or either one."""
MAX_FRONTENDS = 256
"""`--frontends`: a bound, so that a typo cannot fork thousands of processes."""


def parse_role(value: str) -> Role:
    """`--role`'s text as a Role, or ConfigError naming the choices."""
    try:
        return Role(value)
    except ValueError:
        raise ConfigError(f"--role '{value}' is invalid; use one of: prefill, decode, both") from None


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """`dyn worker`."""

    engine: str = setting(DEFAULT_ENGINE, "--engine", "-e", env="DYN_ENGINE")
    """Engine plugin, by its registry name."""
    model: str = setting(DEFAULT_MODEL, "--model", "-m", env="DYN_MODEL")
    """Model alias (smollm2), GGUF file or HF dir."""
    served_model_name: str | None = setting(None, "--served-model-name", env="DYN_SERVED_MODEL_NAME")
    """Name clients use."""
    namespace: str = setting(DEFAULT_NAMESPACE, NAMESPACE)
    component: str = setting("", "--component", env="DYN_COMPONENT", panel=PLANES)
    """The component it registers under (default: backend with --role both, else the role's name)."""
    endpoint: str = setting(GENERATE.name, "--endpoint", env="DYN_ENDPOINT", panel=PLANES)
    """Endpoint name."""
    role: Role = setting(
        Role.BOTH,
        "--role",
        env="DYN_ROLE",
        cli_type=str,
        parse=parse_role,
        show=lambda role: role.value,
    )
    """What the worker runs: prefill | decode | both."""
    host: str = setting("127.0.0.1", "--host", env="DYN_WORKER_HOST")
    """Request-plane address: where it listens, and what it advertises."""
    port: int = setting(0, "--port", env="DYN_WORKER_PORT")
    """Request-plane port (0: any)."""
    block_size: int | None = setting(None, BLOCK_SIZE)
    context_length: int | None = setting(None, "--context-length", env="DYN_CONTEXT_LENGTH", panel=ENGINE)
    """Largest prompt + output, in tokens."""
    graceful_shutdown_s: float = setting(5.0, GRACEFUL_SHUTDOWN)
    """How long SIGTERM waits for in-flight streams after deregistering."""
    planes: PlanesConfig = field(default_factory=PlanesConfig)
    extra: dict[str, Any] = field(default_factory=dict)
    """Engine-specific options (speedup_ratio, num_gpu_blocks, n_ctx...)."""
    kv_transfer: str = setting("auto", "--kv-transfer", env="DYN_KV_TRANSFER", panel=DISAGG)
    """How decode workers pull prefilled KV: auto | tcp | nixl (auto: NIXL when it imports, else TCP)."""
    kv_transfer_port: int = setting(0, "--kv-transfer-port", env="DYN_KV_TRANSFER_PORT", panel=DISAGG)
    """Prefill role: port of the KV transfer server, on --host (0: any)."""
    kv_transfer_ttl_s: float = setting(30.0, "--kv-transfer-ttl", env="DYN_KV_TRANSFER_TTL", panel=DISAGG)
    """Prefill role: seconds KV no decode worker pulled is kept (the client left, the decode worker died)."""
    kv_tiers: KvTierConfig = field(default_factory=KvTierConfig)
    """Host and disk KV tiers below the engine's cache (`--kv-host-cache-gb`, `--kv-disk-cache-gb` ...)."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    group: GroupConfig = field(default_factory=GroupConfig)
    """The nodes its engine spans (`--nnodes`, `--node-rank`, `--leader-addr`); a group of one by default."""

    def __post_init__(self) -> None:
        self._place_leader()
        if self.kv_transfer not in KV_TRANSFERS or self.kv_transfer_ttl_s <= 0:
            raise ConfigError(
                f"--kv-transfer '{self.kv_transfer}' / --kv-transfer-ttl {self.kv_transfer_ttl_s} "
                f"is invalid; use one of {', '.join(KV_TRANSFERS)} and a positive number of seconds"
            )
        if not self.component:  # frozen: set once, here
            object.__setattr__(self, "component", "backend" if self.role is Role.BOTH else self.role.value)

    def _place_leader(self) -> None:
        """A group's leader listens where its followers join: on `--leader-addr`'s port."""
        group = self.group
        if not (group.is_grouped and group.is_leader) or self.port == group.leader_port:
            return
        if self.port:
            raise ConfigError(
                f"--port {self.port} and --leader-addr {group.leader_addr}: the leader listens on the leader "
                "address's port; drop --port"
            )
        object.__setattr__(self, "port", group.leader_port)  # frozen: set once, here


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """`dyn router`: one standalone KV router replica."""

    namespace: str = setting(DEFAULT_NAMESPACE, NAMESPACE)
    component: str = setting("backend", "--component", env="DYN_ROUTER_BACKEND_COMPONENT", panel=PLANES)
    """Component of the backend workers to route to."""
    host: str = setting("127.0.0.1", "--host", env="DYN_ROUTER_HOST")
    """Request-plane address: where it listens, and what it advertises."""
    port: int = setting(0, "--port", env="DYN_ROUTER_PORT")
    """Request-plane port (0: any)."""
    kv_router: KvRouterConfig = field(default_factory=KvRouterConfig)
    """The routing settings; `block_size` None = the backend card's."""
    graceful_shutdown_s: float = setting(5.0, GRACEFUL_SHUTDOWN)
    """How long SIGTERM waits for in-flight streams after deregistering."""
    planes: PlanesConfig = field(default_factory=PlanesConfig)
    prefill_component: str = setting("prefill", "--prefill-component", env="DYN_ROUTER_PREFILL_COMPONENT", panel=PLANES)
    """Component of the prefill workers (disaggregation): a model that has some gets a prefill stage.

    The prefill stage: core/disagg.py."""
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    sessions: routing.SessionConfig = field(default_factory=routing.SessionConfig)
    busy: BusyThresholds = field(default_factory=BusyThresholds)
    """When a backend counts as busy; `max_inflight` counts this replica's streams (as a frontend's own)."""
    health: HealthChecks = field(default_factory=HealthChecks)
    """How hung backends are found and let back in."""
    queue: QueueConfig = field(default_factory=QueueConfig)
    """The wait queue of requests that find every backend busy."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """`dyn serve`: a frontend plus worker subprocesses."""

    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    num_workers: int = setting(1, "--workers", "-n", env="DYN_WORKERS")
    """Worker processes: aggregated ones, or with --disagg the decode workers (0: frontend only)."""
    num_routers: int = setting(0, "--routers", env="DYN_ROUTERS", panel=ROUTING)
    """With --router remote: `dyn router` replicas to start; the frontend then waits for them."""
    ready_timeout_s: float = setting(300.0, "--ready-timeout", env="DYN_READY_TIMEOUT", panel=SUPERVISION)
    """Seconds to wait for every worker to register before giving up."""
    max_restarts: int = setting(5, "--max-restarts", env="DYN_MAX_RESTARTS", panel=SUPERVISION)
    """Restarts of a worker slot allowed within 5 minutes when it exits unexpectedly (0: never)."""
    nodes_per_worker: int = setting(1, "--nodes-per-worker", env="DYN_NODES_PER_WORKER", panel=SUPERVISION)
    """Processes ("nodes") each worker's engine spans on this host: a leader that serves and headless followers,
    started, stopped and restarted as one group (`dyn worker --nnodes`)."""
    num_prefill_workers: int = 0
    """`--disagg`: prefill-role workers started beside the `num_workers` (then decode-role) workers."""
    num_encode_workers: int = setting(0, "--encode-workers", env="DYN_ENCODE_WORKERS", panel=DISAGG)
    """E/P/D: encode-role workers (`dyn worker --role encode`: the vision encoder only) beside the others; images go
    to them before their prompt is prefilled (core/encode_stage.py)."""
    backends: tuple[str, ...] = setting((), "--backend", env="DYN_BACKENDS", panel=ROUTING, **repeated())
    """An OpenAI-compatible server to route to (repeatable; instead of --workers): vLLM, SGLang, llama.cpp's server,
    another `dyn serve`. Each gets a worker of its own (`--engine http`) that forwards to it. `URL,KEY=VALUE,...` gives
    that worker engine options of its own: `http://h:8000,kv_events=tcp://h:5557,kv_replay=tcp://h:5558`."""
    backend_file: str | None = setting(None, "--backend-file", env="DYN_BACKEND_FILE", panel=ROUTING)
    """A file of backends, one `--backend` a line (`#` comments), instead of --backend: read again every 2 s, a line
    added starts its worker, a line removed stops it (backend_file.py)."""
    num_frontends: int = setting(1, "--frontends", env="DYN_FRONTENDS", panel=HTTP)
    """Frontend processes sharing the HTTP port (SO_REUSEPORT) and their routers' in-flight load.

    This one and `num_frontends - 1` children on the same port (launcher.py)."""
    ready_workers: int | None = None
    """Workers (or routers) to see before ready; None: the ones this process starts. A frontend child of
    `dyn serve --frontends N` waits for its parent's."""

    def __post_init__(self) -> None:
        if self.num_workers < 0 or self.num_encode_workers < 0:
            raise ConfigError(f"--workers and --encode-workers must be >= 0, got {self.num_workers}")
        if not 1 <= self.num_frontends <= MAX_FRONTENDS:
            raise ConfigError(f"--frontends must be between 1 and {MAX_FRONTENDS}, got {self.num_frontends}")
        if self.num_routers < 0 or (self.num_routers and self.frontend.router != "remote"):
            raise ConfigError(f"--routers {self.num_routers} needs --router remote and a count >= 0")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not 1 <= self.nodes_per_worker <= MAX_NODES:
            raise ConfigError(f"--nodes-per-worker must be between 1 and {MAX_NODES}, got {self.nodes_per_worker}")

    @property
    def joins_group(self) -> bool:
        """One of the other frontends of a `dyn serve --frontends N` (it starts nothing, and serves once ready)."""
        return self.ready_workers is not None

    def router_config(self) -> RouterConfig:
        """What each `dyn router` replica it starts runs with: this deployment's routing settings."""
        frontend = self.frontend
        return RouterConfig(
            namespace=frontend.namespace,
            component=self.worker.component,
            host=self.worker.host,
            kv_router=frontend.kv_router,
            graceful_shutdown_s=self.worker.graceful_shutdown_s,
            planes=frontend.planes,
            disagg=replace(frontend.disagg, prefill_router_mode=None),
            sessions=frontend.sessions,
            busy=frontend.busy,  # the busy thresholds and the queue act in the routers (the frontend sees no load)
            queue=frontend.queue,
            health=frontend.health,
            telemetry=self.worker.telemetry,
        )


##### Child processes: the config as one document #####

ChildConfig = TypeVar("ChildConfig", WorkerConfig, RouterConfig, ServeConfig)

CONFIG_DOCUMENTS: dict[type, tuple[str, str]] = {
    WorkerConfig: ("worker", "DYN_WORKER_CONFIG"),
    RouterConfig: ("router", "DYN_ROUTER_CONFIG"),
    ServeConfig: ("serve", "DYN_SERVE_CONFIG"),  # a frontend child of `dyn serve --frontends N`
}
"""Config type -> (the `dyn` command that runs it, the environment variable its JSON document travels in)."""


@dataclass(frozen=True, slots=True)
class ChildCommand:
    """How to start a `dyn` process with a given config: its command line and what its environment adds."""

    argv: tuple[str, ...]
    env: dict[str, str]
    """The config document (which carries the planes' URLs and the cluster secret: not on a command line
    `ps` shows to every user)."""


def child_command(config: WorkerConfig | RouterConfig | ServeConfig) -> ChildCommand:
    """The `dyn worker`, `dyn router` or `dyn serve` process that runs `config` exactly."""
    command, variable = CONFIG_DOCUMENTS[type(config)]
    argv = (sys.executable, "-m", "dynamo_cli.cli.main", command)
    return ChildCommand(argv, {variable: msgspec.json.encode(config).decode()})


def config_document(kind: type[ChildConfig], environ: Mapping[str, str] | None = None) -> ChildConfig | None:
    """The config a parent process handed this one (`child_command`), or None when started by hand."""
    _, variable = CONFIG_DOCUMENTS[kind]
    text = (os.environ if environ is None else environ).get(variable)
    if not text:
        return None
    try:
        return msgspec.json.decode(text, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"{variable} is not a valid {kind.__name__} document: {exc}; unset it") from None


def backend_options(spec: str) -> dict[str, str]:
    """A `--backend URL,KEY=VALUE,...`'s engine options for its worker: `url` and the pairs after it."""
    url, *pairs = spec.split(",")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--backend {spec}: the URL comes first, http(s)://HOST[:PORT]")
    options = {"url": url.strip()}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or key.strip() == "url":
            raise ConfigError(f"--backend {spec}: after the URL come KEY=VALUE engine options, not {pair!r}")
        options[key.strip()] = value.strip()
    return options
