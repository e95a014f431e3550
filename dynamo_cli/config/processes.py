"""The processes' settings: where the planes are, one worker, one `dyn router`, and a whole `dyn serve`; and
how a process hands its child the config it runs (one JSON document in its environment)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import msgspec

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
from dynamo_cli.config.routing import BusyThresholds, DisaggConfig, HealthChecks, KvRouterConfig, QueueConfig
from dynamo_cli.config.telemetry import TelemetryConfig
from dynamo_cli.engine import KvTierConfig, Role
from dynamo_cli.errors import ConfigError
from dynamo_cli.settings import DISAGG, ENGINE, HTTP, PLANES, ROUTING, SUPERVISION, setting
from dynamo_cli.wire import GENERATE

KV_TRANSFERS = ("auto", "tcp", "nixl")
MAX_FRONTENDS = 256
"""`--frontends`: a bound, so that a typo cannot fork thousands of processes."""
"""`--kv-transfer`: NIXL when it imports, else TCP; or either one."""


def parse_role(value: str) -> Role:
    """`--role`'s text as a Role, or ConfigError naming the choices."""
    try:
        return Role(value)
    except ValueError:
        raise ConfigError(f"--role '{value}' is invalid; use one of: prefill, decode, both") from None


LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
"""What an adapter's served name may be (it is a model name clients send, a key suffix, a metric label)."""
MAX_LORAS = 1024


def check_lora_name(name: str, what: str = "--lora") -> str:
    """`name` if it can serve as an adapter's model name, else ConfigError saying what may be."""
    if not LORA_NAME.fullmatch(name):
        raise ConfigError(
            f"{what}: adapter name {name[:64]!r} is invalid; use 1-128 letters, digits and ._:/@+- "
            "starting with a letter or digit"
        )
    return name


def parse_loras(values: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`--lora NAME=PATH` values, checked (a valid name, a path, no name twice); ConfigError otherwise."""
    seen: set[str] = set()
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not path:
            raise ConfigError(f"--lora {value!r} is invalid; write NAME=PATH (an adapter file)")
        if check_lora_name(name) in seen:
            raise ConfigError(f"--lora: adapter {name!r} is given twice")
        seen.add(name)
    return tuple(values)


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """LoRA adapters a worker serves over its base model (each one a model of its own; dynamo_cli/lora)."""

    adapters: tuple[str, ...] = setting(
        (),
        "--lora",
        env="DYN_LORAS",
        help="NAME=PATH: serve adapter PATH as model NAME (repeatable).",
        panel=ENGINE,
        cli_type=list[str] | None,
        parse=parse_loras,
        show=lambda adapters: list(adapters) or None,
    )
    """`NAME=PATH` of each adapter served from the start."""
    max_loras: int = setting(
        4,
        "--max-loras",
        env="DYN_MAX_LORAS",
        help="Adapters loaded at once; the least recently used goes first.",
        panel=ENGINE,
    )
    """Adapters resident at once; a request for another one evicts the least recently used idle one and loads."""
    lora_dirs: tuple[str, ...] = setting(
        (),
        "--lora-dir",
        env="DYN_LORA_DIRS",
        help="Where run-time loads may read adapters (repeatable; default: the --lora files' folders).",
        panel=ENGINE,
        cli_type=list[str] | None,
        parse=tuple,
        show=lambda dirs: list(dirs) or None,
    )
    """Folders `POST /v1/load_lora_adapter` may name files in: a load is a file read by the engine's parser on
    the worker's machine, so only these (and the `--lora` files' folders) are open to it."""

    def __post_init__(self) -> None:
        for name in ("adapters", "lora_dirs"):  # an option left unset arrives as None
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        parse_loras(self.adapters)
        if not 1 <= self.max_loras <= MAX_LORAS:
            raise ConfigError(f"--max-loras must be between 1 and {MAX_LORAS}, got {self.max_loras}")

    def named(self) -> dict[str, str]:
        """Adapter name -> path, in the order given."""
        return dict(value.partition("=")[::2] for value in self.adapters)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """`dyn worker`."""

    engine: str = setting(DEFAULT_ENGINE, "--engine", "-e", env="DYN_ENGINE", help="Engine plugin.")
    """Registry name of the engine plugin."""
    model: str = setting(
        DEFAULT_MODEL, "--model", "-m", env="DYN_MODEL", help="Model alias (smollm2), GGUF file or HF dir."
    )
    served_model_name: str | None = setting(
        None, "--served-model-name", env="DYN_SERVED_MODEL_NAME", help="Name clients use."
    )
    namespace: str = setting(DEFAULT_NAMESPACE, NAMESPACE)
    component: str = setting(
        "", "--component", env="DYN_COMPONENT", help="Default: backend, or the role.", panel=PLANES
    )
    """The component it registers under; empty: `backend` (role both) or the role's name."""
    endpoint: str = setting(GENERATE.name, "--endpoint", env="DYN_ENDPOINT", help="Endpoint name.", panel=PLANES)
    role: Role = setting(
        Role.BOTH,
        "--role",
        env="DYN_ROLE",
        help="prefill | decode | both",
        cli_type=str,
        parse=parse_role,
        show=lambda role: role.value,
    )
    host: str = setting("127.0.0.1", "--host", env="DYN_WORKER_HOST", help="Request-plane address.")
    """Address the request plane listens on and advertises."""
    port: int = setting(0, "--port", env="DYN_WORKER_PORT", help="Request-plane port (0: any).")
    block_size: int | None = setting(None, BLOCK_SIZE)
    context_length: int | None = setting(
        None, "--context-length", env="DYN_CONTEXT_LENGTH", help="Largest prompt + output.", panel=ENGINE
    )
    graceful_shutdown_s: float = setting(5.0, GRACEFUL_SHUTDOWN)
    """How long SIGTERM waits for in-flight streams after deregistering."""
    planes: PlanesConfig = field(default_factory=PlanesConfig)
    extra: dict[str, Any] = field(default_factory=dict)
    """Engine-specific options (speedup_ratio, num_gpu_blocks, n_ctx...)."""
    kv_transfer: str = setting(
        "auto",
        "--kv-transfer",
        env="DYN_KV_TRANSFER",
        help="How KV is pulled: " + " | ".join(KV_TRANSFERS),
        panel=DISAGG,
    )
    """How decode workers pull prefilled KV: `tcp`, `nixl`, or `auto` (NIXL when it imports, else TCP)."""
    kv_transfer_port: int = setting(
        0, "--kv-transfer-port", env="DYN_KV_TRANSFER_PORT", help="Prefill role (0: any).", panel=DISAGG
    )
    """Port of a prefill worker's KV transfer server (0: any free port), on `host`."""
    kv_transfer_ttl_s: float = setting(
        30.0,
        "--kv-transfer-ttl",
        env="DYN_KV_TRANSFER_TTL",
        help="Prefill role: seconds unpulled KV is kept.",
        panel=DISAGG,
    )
    """Seconds a prefill worker keeps KV no decode worker pulled (the client left, the decode died)."""
    kv_tiers: KvTierConfig = field(default_factory=KvTierConfig)
    """Host and disk KV tiers below the engine's cache (`--kv-host-cache-gb`, `--kv-disk-cache-gb` ...)."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if self.kv_transfer not in KV_TRANSFERS or self.kv_transfer_ttl_s <= 0:
            raise ConfigError(
                f"--kv-transfer '{self.kv_transfer}' / --kv-transfer-ttl {self.kv_transfer_ttl_s} "
                f"is invalid; use one of {', '.join(KV_TRANSFERS)} and a positive number of seconds"
            )
        if not self.component:  # frozen: set once, here
            object.__setattr__(self, "component", "backend" if self.role is Role.BOTH else self.role.value)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """`dyn router`: one standalone KV router replica."""

    namespace: str = setting(DEFAULT_NAMESPACE, NAMESPACE)
    component: str = setting(
        "backend",
        "--component",
        env="DYN_ROUTER_BACKEND_COMPONENT",
        help="Component of the backend workers to route to.",
        panel=PLANES,
    )
    """Component of the backend workers routed to."""
    host: str = setting("127.0.0.1", "--host", env="DYN_ROUTER_HOST", help="Request-plane address.")
    """Address the request plane listens on and advertises."""
    port: int = setting(0, "--port", env="DYN_ROUTER_PORT", help="Request-plane port (0: any).")
    kv_router: KvRouterConfig = field(default_factory=KvRouterConfig)
    """The routing settings; `block_size` None = the backend card's."""
    graceful_shutdown_s: float = setting(5.0, GRACEFUL_SHUTDOWN)
    """How long SIGTERM waits for in-flight streams after deregistering."""
    planes: PlanesConfig = field(default_factory=PlanesConfig)
    prefill_component: str = setting(
        "prefill",
        "--prefill-component",
        env="DYN_ROUTER_PREFILL_COMPONENT",
        help="Component of the prefill workers (disaggregation).",
        panel=PLANES,
    )
    """Component of the prefill workers: a model that has some gets a prefill stage (core/disagg.py)."""
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
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
    num_workers: int = setting(1, "--workers", "-n", env="DYN_WORKERS", help="Worker processes (0: frontend only).")
    """Aggregated workers, or with `--disagg` the decode workers."""
    num_routers: int = setting(
        0, "--routers", env="DYN_ROUTERS", help="With --router remote: `dyn router` replicas to start.", panel=ROUTING
    )
    """`dyn router` replicas to spawn (with `--router remote`); the frontend then waits for them."""
    ready_timeout_s: float = setting(
        300.0,
        "--ready-timeout",
        env="DYN_READY_TIMEOUT",
        help="Seconds to wait for every worker to register.",
        panel=SUPERVISION,
    )
    """How long to wait for every worker to register before giving up."""
    max_restarts: int = setting(
        5,
        "--max-restarts",
        env="DYN_MAX_RESTARTS",
        help="Restarts of a worker that exits unexpectedly, within 5 minutes (0: never).",
        panel=SUPERVISION,
    )
    """Restarts of one worker slot allowed within 5 minutes after it exits unexpectedly (0: never)."""
    num_prefill_workers: int = 0
    """`--disagg`: prefill-role workers started beside the `num_workers` (then decode-role) workers."""
    num_frontends: int = setting(
        1,
        "--frontends",
        env="DYN_FRONTENDS",
        help="Frontend processes sharing the HTTP port (SO_REUSEPORT) and their routers' in-flight load.",
        panel=HTTP,
    )
    """Frontend processes: this one and `num_frontends - 1` children on the same port (launcher.py)."""
    ready_workers: int | None = None
    """Workers (or routers) to see before ready; None: the ones this process starts. A frontend child of
    `dyn serve --frontends N` waits for its parent's."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ConfigError(f"--workers must be >= 0, got {self.num_workers}")
        if not 1 <= self.num_frontends <= MAX_FRONTENDS:
            raise ConfigError(f"--frontends must be between 1 and {MAX_FRONTENDS}, got {self.num_frontends}")
        if self.num_routers < 0 or (self.num_routers and self.frontend.router != "remote"):
            raise ConfigError(f"--routers {self.num_routers} needs --router remote and a count >= 0")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")

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
